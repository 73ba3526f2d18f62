"""Hugging Face MixtralForCausalLM interchange (megatron/model/hf_mixtral.py): a tiny random Mixtral's logits equal
ours after import (max abs 1e-4; also at expert-parallel size 2 and tensor-parallel size 2), the export is
bitwise the HF state dict again, and after a few training steps the exported weights loaded into
MixtralForCausalLM give our logits; transformers 4's per-expert names import too."""
import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import TOOLS  # noqa: F401 (puts tools/ on sys.path: the converters are scripts)

HF_CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None, router_jitter_noise=0.0)
TOKENS = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(4))


def hf_mixtral(seed=0):
    """(MixtralForCausalLM in eval mode, its state dict) from seeded random weights (norms away from 1)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    hf = MixtralForCausalLM(MixtralConfig(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.uniform_(0.5, 1.5) if name.endswith("norm.weight") else param.normal_(0.0, 0.2)
    return hf, {name: tensor.clone() for name, tensor in hf.state_dict().items()}


def _ours(weights, model_config):
    """Our GPT2Model of `model_config` holding this rank's pieces of the full `weights` (its own experts)."""
    import mpu
    from megatron.checkpoint.reshard import shard_for
    from megatron.model import GPT2Model, GPT2ModelConfig
    fields = set(GPT2ModelConfig.__dataclass_fields__)
    model = GPT2Model(GPT2ModelConfig(**{k: v for k, v in model_config.items() if k in fields}),
                      parallel_output=False).eval()
    world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_for(name, weights[name], world, rank, model_config["vocab_size"], model_config))
    return model


def _logits_and_training(weights, model_config, ep):
    """(logits of TOKENS, this rank's parameters after 3 AdamW steps, their names)."""
    import mpu
    if ep > 1:
        mpu.initialize_expert_parallel(ep)
    model = _ours(weights, model_config)
    with torch.no_grad():
        logits = model(TOKENS)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(step))
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return logits, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def mixtral():
    hf, state = hf_mixtral()
    with torch.no_grad():
        logits = hf(TOKENS).logits
    return hf, state, logits


def test_import_matches_hf_logits_and_exports_back(mixtral):
    from megatron.model.hf_mixtral import from_hf_mixtral_state_dict, to_hf_mixtral_state_dict
    hf, state, hf_logits = mixtral
    weights, model_config = from_hf_mixtral_state_dict(state, hf.config)
    assert model_config["moe"].num_experts == 4 and model_config["moe"].topk == 2
    exported = to_hf_mixtral_state_dict(weights, model_config)
    assert exported.keys() == state.keys() and all(torch.equal(exported[k], state[k]) for k in state)
    logits, trained = run_distributed(_logits_and_training, 1, args=(weights, model_config, 1),
                                      model_parallel_size=1)[0]
    assert (logits - hf_logits).abs().max() <= 1e-4
    # the trained model, exported, is a MixtralForCausalLM computing our logits
    from transformers import MixtralForCausalLM
    trained_hf = MixtralForCausalLM(hf.config).eval()
    trained_hf.load_state_dict(to_hf_mixtral_state_dict(trained, model_config))
    ours_after = run_distributed(_logits_of, 1, args=(trained, model_config), model_parallel_size=1)[0]
    with torch.no_grad():
        assert (trained_hf(TOKENS).logits - ours_after).abs().max() <= 1e-4
    assert (ours_after - logits).abs().max() > 1e-2        # training changed the model


def _logits_of(weights, model_config):
    with torch.no_grad():
        return _ours(weights, model_config)(TOKENS)


@pytest.mark.parametrize("world,mp,ep", [(2, 1, 2), (2, 2, 1)])
def test_import_at_expert_and_tensor_parallel(mixtral, world, mp, ep):
    from megatron.model.hf_mixtral import from_hf_mixtral_state_dict
    hf, state, hf_logits = mixtral
    weights, model_config = from_hf_mixtral_state_dict(state, hf.config)
    results = run_distributed(_logits_and_training, world, args=(weights, model_config, ep), model_parallel_size=mp)
    for logits, _ in results:
        assert (logits - hf_logits).abs().max() <= 1e-4


def test_transformers_4_names_import():
    """block_sparse_moe.gate / experts.j.w1 (gate), w3 (up), w2 (down) -> the same weights as the fused names."""
    from megatron.model.hf_mixtral import from_hf_mixtral_state_dict
    hf, state = hf_mixtral(seed=1)
    legacy = {k: v for k, v in state.items() if ".mlp." not in k}
    f = HF_CONFIG["intermediate_size"]
    for i in range(HF_CONFIG["num_hidden_layers"]):
        legacy[f"model.layers.{i}.block_sparse_moe.gate.weight"] = state[f"model.layers.{i}.mlp.gate.weight"]
        for j in range(HF_CONFIG["num_local_experts"]):
            gate_up = state[f"model.layers.{i}.mlp.experts.gate_up_proj"][j]
            expert = f"model.layers.{i}.block_sparse_moe.experts.{j}."
            legacy[expert + "w1.weight"], legacy[expert + "w3.weight"] = gate_up[:f], gate_up[f:]
            legacy[expert + "w2.weight"] = state[f"model.layers.{i}.mlp.experts.down_proj"][j]
    fused, _ = from_hf_mixtral_state_dict(state, hf.config)
    from_legacy, _ = from_hf_mixtral_state_dict(legacy, hf.config)
    assert fused.keys() == from_legacy.keys() and all(torch.equal(fused[k], from_legacy[k]) for k in fused)


def test_config_round_trip_and_refusals():
    from transformers import MixtralConfig
    from megatron.model.hf_interchange import InterchangeError
    from megatron.model.hf_mixtral import check_mixtral_config, to_hf_mixtral_config_dict
    model_config = check_mixtral_config(MixtralConfig(**HF_CONFIG))
    again = check_mixtral_config(MixtralConfig(**to_hf_mixtral_config_dict(model_config)))
    assert again == model_config
    with pytest.raises(InterchangeError, match="sliding_window 8"):
        check_mixtral_config(MixtralConfig(**dict(HF_CONFIG, sliding_window=8)))


def test_tools_round_trip(mixtral, tmp_path):
    """tools/convert_from_hf.py writes a checkpoint whose record names the experts (and the flags that build it);
    tools/convert_to_hf.py turns it back into a MixtralForCausalLM directory with the same weights and logits (and
    without our tokenizer: the imported vocabulary is not ours)."""
    import convert_from_hf
    import convert_to_hf
    from transformers import MixtralForCausalLM
    hf, state, hf_logits = mixtral
    hf.save_pretrained(tmp_path / "hf")
    model_config, _ = convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                                              make_vocab_size_divisible_by=8)
    flags = convert_from_hf.architecture_flags(model_config)
    assert flags[flags.index("--num-experts") + 1] == "4" and flags[flags.index("--moe-router-topk") + 1] == "2"
    *_, tokenizer_note = convert_to_hf.convert(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    # the default vocab files (8192 tokens) are not this model's (64): no tokenizer, and the closing note says why
    assert "has 8192 tokens, the model 64" in tokenizer_note and not (tmp_path / "out" / "vocab.json").exists()
    back = MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in state.items())
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, hf_logits)
