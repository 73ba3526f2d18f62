"""finetune_gpt.py and train_reward_model.py with the Llama options (SwiGLU, RMSNorm, rotary, untied head, no
biases, one key/value head replicated on both ranks at model-parallel size 2) against Hugging Face with the same
weights (a random LlamaForCausalLM imported with tools/convert_from_hf.py; LlamaForSequenceClassification for the
reward model) trained by plain PyTorch: the SFT loss with labels -100 and one SGD-like AdamW step (test_sft.py's),
two DPO steps with a frozen reference (test_preference.py's), two reward-model steps and the export
(test_reward.py's), at mp 2 in one launch of 2 processes.
"""
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.model.test_llama import hf_llama
from tests.posttrain.test_preference import METRICS, TWO_STEPS, _hf_dpo, _logged, write_pairs
from tests.posttrain.test_preference import _preprocess as _preprocess_pairs
from tests.posttrain.test_sft import SEQ, SGD_LIKE, _check_against_hf, _model_flags, _run_jobs, write_examples
from tests.posttrain.test_sft import _bind, _saved_weights_as_hf, convert_from_hf, preprocess_sft_data
from tests.posttrain import test_reward

VOCAB = 8192     # the default data's BPE
LLAMA = ["--swiglu", "--ffn-hidden-size", "64", "--num-key-value-heads", "1", "--use-rotary-position-embeddings",
         "--no-position-embedding", "--normalization", "rmsnorm", "--layernorm-epsilon", "1e-5",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--model-parallel-size", "2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, webtext_data):
    """The SFT examples and the preference pairs preprocessed, a random LlamaForCausalLM imported as our checkpoint;
    then SFT (one step) and DPO (two steps) at mp 2. ({"sft": ..., "dpo": ...} setups, test_sft's and
    test_preference's shape; the runs' histories)."""
    root = tmp_path_factory.mktemp("llama_posttrain")
    sft_prefix = str(root / "data" / "qa")
    preprocess_sft_data.main(["--input", write_examples(str(root / "examples.jsonl")), "--output-prefix",
                              sft_prefix, "--vocab-file", os.path.join(webtext_data, "vocab.json"), "--merge-file",
                              os.path.join(webtext_data, "merges.txt"), "--seq-length", str(SEQ)])
    pairs_prefix = _preprocess_pairs(root, webtext_data, write_pairs(str(root / "pairs.jsonl")), "--seq-length",
                                     str(SEQ))
    hf, _ = hf_llama(seed=3, vocab_size=VOCAB, max_position_embeddings=64, num_key_value_heads=1)
    with torch.no_grad():      # HF's 0.2 would make the 8192-way softmax nearly one-hot; keep the gradients alive
        for name, param in hf.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(0.25)
    hf_dir, start = str(root / "hf"), str(root / "imported")
    hf.save_pretrained(hf_dir)
    assert convert_from_hf.main(["--hf", hf_dir, "--save", start]) == 0
    reward_dir, reward_start = str(root / "hf_reward"), _write_reward_start(hf, str(root / "reward_start"))
    reward_hf(hf, reward_dir)
    model = _model_flags(webtext_data) + LLAMA + ["--load", start]
    sft = model + ["--data-path", sft_prefix, "--split", "80,20,0", "--save", str(root / "sft"), "--batch-size", "4"] \
        + SGD_LIKE
    dpo = model + ["--data-path", pairs_prefix, "--split", "100,0,0", "--save", str(root / "dpo"), "--log-jsonl",
                   str(root / "dpo.jsonl")] + TWO_STEPS
    reward = _model_flags(webtext_data) + LLAMA + ["--load", reward_start, "--data-path", pairs_prefix, "--split",
                                                   test_reward.SPLIT, "--save", str(root / "reward"), "--log-jsonl",
                                                   str(root / "reward.jsonl")] + test_reward.TWO_STEPS
    jobs = [("sft", "finetune", sft), ("dpo", "finetune", dpo), ("reward", "call", _bind(_reward_run, reward))]
    results = run_distributed(_run_jobs, 2, args=(jobs,), timeout=900)
    assert results[0] == results[1], "the model-parallel ranks log different losses"
    common = {"root": root, "hf_dir": hf_dir, "webtext": webtext_data}
    return {"sft": dict(common, prefix=sft_prefix), "dpo": dict(common, prefix=pairs_prefix),
            "reward": dict(common, prefix=pairs_prefix, hf_dir=reward_dir)}, results[0]


def _reward_run(args_list):
    """train_reward_model.main: its final validation metrics."""
    import train_reward_model
    return train_reward_model.main(args_list)["final_valid"]


def reward_hf(hf, directory):
    """A LlamaForSequenceClassification (one label, pad_token_id 0: the default BPE's end-of-text) with `hf`'s
    trunk and a seeded head, saved to `directory`; returns it."""
    from transformers import LlamaForSequenceClassification
    config = hf.config.to_dict()
    config.update(num_labels=1, pad_token_id=0, architectures=["LlamaForSequenceClassification"])
    config.pop("id2label", None), config.pop("label2id", None)
    model = LlamaForSequenceClassification(type(hf.config)(**config))
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert missing == ["score.weight"] and unexpected == ["lm_head.weight"], (missing, unexpected)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(1, config["hidden_size"], generator=torch.Generator().manual_seed(4)))
    model.save_pretrained(directory)
    return model


def _write_reward_start(hf, directory):
    """Our release checkpoint at mp 2 (the run's size: the Megatron path's own load_state_dict) of reward_hf's
    model: `hf`'s weights, its lm_head as an LM checkpoint's untied output layer (which the reward model does not
    build: left out on load), and the same head as score.weight."""
    from megatron.checkpoint.full_checkpoint import write_full_checkpoint
    from megatron.model.hf_interchange import from_hf_llama_state_dict
    weights, model_config = from_hf_llama_state_dict({k: v.detach() for k, v in hf.state_dict().items()}, hf.config)
    weights["score.weight"] = torch.randn(1, model_config["hidden_size"],
                                          generator=torch.Generator().manual_seed(4))
    write_full_checkpoint(directory, weights, model_config, 2)
    return directory


def test_llama_sft_loss_and_step_equal_hf(setup):
    """The logged SFT loss equals HF's with labels -100 (1e-6), the weights after one SGD-like AdamW step too (1e-5
    of the step, worst tensor): test_sft.py's check on LlamaForCausalLM."""
    setups, results = setup
    _check_against_hf(setups["sft"], results["sft"], "sft")


def test_llama_dpo_loss_rewards_and_steps_equal_hf(setup):
    """Two DPO steps: the loss and TRL's rewards/* equal a plain-PyTorch DPO on LlamaForCausalLM (reference = a
    frozen copy of the start) within 1e-5, and the weights' change over the two steps within 5e-5 of it."""
    setups, _ = setup
    steps, before, after = _hf_dpo(setups["dpo"])
    logged = _logged(setups["dpo"], "dpo")
    assert len(logged) == 2
    assert abs(steps[1]["lm loss"] - steps[0]["lm loss"]) > 1e-3, steps             # step 2 sees a trained policy
    for ours, theirs in zip(logged, steps, strict=True):
        for key in ("lm loss",) + METRICS:
            assert abs(ours[key] - theirs[key]) <= 1e-5 * max(1.0, abs(theirs[key])), (key, ours, theirs)
    saved = _saved_weights_as_hf(str(setups["dpo"]["root"] / "dpo"))
    assert saved.keys() == after.keys()
    worst = 0.0
    for key, tensor in saved.items():
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        assert step_hf.abs().max() > 0, key
        worst = max(worst, ((step_ours - step_hf).abs().max() / step_hf.abs().max()).item())
    print(f"Llama DPO: losses {[r['lm loss'] for r in logged]}, two steps vs HF's: {worst:.2e} relative")
    assert worst <= 5e-5, f"the weights' change differs from HF's by {worst:.2e} (relative, worst tensor)"


def test_llama_reward_model_steps_equal_hf_and_exports(setup, tmp_path):
    """train_reward_model.py: two AdamW steps (clipping active) give the loss, accuracy, scores and gradient norm
    of a plain-PyTorch reward model on LlamaForSequenceClassification (1e-5; test_reward.py's), and
    tools/convert_to_hf.py writes a LlamaForSequenceClassification holding the trained weights (their change within
    2e-4 of HF's, test_reward.py's bound) whose scores of the validation pairs are the run's final validation. The
    reward model builds no untied output layer (loading the LM checkpoint's leaves it out)."""
    import json
    from safetensors.torch import load_file
    from transformers import LlamaForSequenceClassification
    setups, results = setup
    reward = setups["reward"]
    steps, before, after = test_reward._hf_reward_training(reward, "last-token")
    logged = test_reward._logged(reward, "reward")
    assert len(logged) == 2 and steps[0]["grad_norm"] > test_reward.CLIP, steps
    for ours, theirs in zip(logged, steps, strict=True):
        for key in test_reward.METRICS + ("grad_norm",):
            test_reward._close(ours[key], theirs[key], key)
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    trained = read_full_checkpoint(str(reward["root"] / "reward")).fp32_weights()
    assert "score.weight" in trained and "output_layer.weight" not in trained   # no unused LM head (V x h)
    out = str(tmp_path / "hf")
    assert test_reward.convert_to_hf.main(["--load", str(reward["root"] / "reward"), "--output", out,
                                           "--vocab-file", os.path.join(reward["webtext"], "vocab.json"),
                                           "--merge-file", os.path.join(reward["webtext"], "merges.txt")]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["pad_token_id"] == 0
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert saved.keys() == before.keys()                 # the trunk and score.weight: no output layer
    worst = 0.0
    for key, tensor in saved.items():
        step_hf, step_ours = after[key] - before[key], tensor - before[key]
        assert step_hf.abs().max() > 0, key
        worst = max(worst, ((step_ours - step_hf).abs().max() / step_hf.abs().max()).item())
    print(f"Llama reward: losses {[r['lm loss'] for r in logged]}, grad norms {[r['grad_norm'] for r in logged]}, "
          f"two steps vs HF's: {worst:.2e} relative")
    assert worst <= 2e-4, f"the weights' change differs from HF's by {worst:.2e} (relative, worst tensor)"
    model = LlamaForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        _, metrics = test_reward._hf_metrics(model, test_reward._pairs(reward, "valid"), "last-token")
    for key in test_reward.METRICS:
        test_reward._close(results["reward"][key], metrics[key], key)
