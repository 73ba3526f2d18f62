"""GPT2Model at model-parallel size 1 against Hugging Face transformers' GPT2LMHeadModel with the same weights.

Device-agnostic: both models and the tokens live on the device GPT2Model is built on (mpu's: the GPU under `pytest
--device cuda`); workers return logits on the CPU, so ranks on different GPUs compare on one device.
"""
import torch

from megatron.spawn import run_distributed

CONFIG = dict(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4, max_sequence_length=16)


def build_model(seed=1234, **overrides):
    import mpu
    from megatron.model import GPT2Model, GPT2ModelConfig
    mpu.model_parallel_cuda_manual_seed(seed)
    return GPT2Model(GPT2ModelConfig(**dict(CONFIG, **overrides)), parallel_output=False)


def copy_into_hf(model, hf):
    """Our nn.Linear-layout weights into HF's Conv1D layout ([in, out])."""
    sd = hf.transformer
    with torch.no_grad():
        sd.wte.weight.copy_(model.word_embeddings.weight)
        sd.wpe.weight.copy_(model.position_embeddings.weight)
        for ours, theirs in zip(model.transformer.layers, sd.h):
            theirs.ln_1.load_state_dict(ours.input_layernorm.state_dict())
            theirs.ln_2.load_state_dict(ours.post_attention_layernorm.state_dict())
            pairs = [(theirs.attn.c_attn, ours.attention.query_key_value), (theirs.attn.c_proj, ours.attention.dense),
                     (theirs.mlp.c_fc, ours.mlp.dense_h_to_4h), (theirs.mlp.c_proj, ours.mlp.dense_4h_to_h)]
            for conv1d, linear in pairs:
                conv1d.weight.copy_(linear.weight.t())
                conv1d.bias.copy_(linear.bias)
        sd.ln_f.load_state_dict(model.transformer.final_layernorm.state_dict())


def _compare_with_hf():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = build_model().eval()
    hf_config = GPT2Config(vocab_size=CONFIG["vocab_size"], n_positions=CONFIG["max_sequence_length"],
                           n_embd=CONFIG["hidden_size"], n_layer=CONFIG["num_layers"],
                           n_head=CONFIG["num_attention_heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    device = model.word_embeddings.weight.device
    hf = GPT2LMHeadModel(hf_config).to(device).eval()
    copy_into_hf(model, hf)
    tokens = torch.randint(0, CONFIG["vocab_size"], (3, CONFIG["max_sequence_length"]),
                           generator=torch.Generator().manual_seed(0)).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.size(1), device=device).unsqueeze(0).expand_as(inputs)
    with torch.no_grad():
        logits = model(inputs, position_ids)
        loss = model(inputs, position_ids, labels=labels).mean()
        hf_out = hf(input_ids=tokens, labels=tokens)
    return {"logits": (logits - hf_out.logits[:, :-1]).abs().max().item(),
            "loss": abs(loss.item() - hf_out.loss.item()) / hf_out.loss.item()}


def test_gpt2_matches_huggingface():
    """Logits to 1e-5; the mean loss (near log V ~ 4.2) to 1e-6 relative, a few fp32 ulps: the two sum the
    per-token losses in different orders, and a GPU's reductions order them differently again."""
    result = run_distributed(_compare_with_hf, 1, model_parallel_size=1)[0]
    assert result["logits"] <= 1e-5, result
    assert result["loss"] <= 1e-6, result


def _parallel_logits():
    model = build_model().eval()
    device = model.word_embeddings.weight.device
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    position_ids = torch.arange(12, device=device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, position_ids).cpu()


def test_model_is_identical_at_any_model_parallel_size():
    reference = run_distributed(_parallel_logits, 1, model_parallel_size=1)[0]
    for logits in run_distributed(_parallel_logits, 2, model_parallel_size=2):
        assert (logits - reference).abs().max().item() <= 1e-6
