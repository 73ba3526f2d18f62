"""finetune_gpt.py with the Llama options (SwiGLU, RMSNorm, rotary, untied head, no biases, one key/value head
replicated on both ranks at model-parallel size 2), SFT and DPO, against Hugging Face LlamaForCausalLM with the same
weights (a random HF model imported with tools/convert_from_hf.py) trained by plain PyTorch: the SFT loss with
labels -100 and one SGD-like AdamW step (test_sft.py's), and two DPO steps with a frozen reference (test_preference.py's),
at mp 2 in one launch of 2 processes.
"""
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.model.test_llama import hf_llama
from tests.posttrain.test_preference import METRICS, TWO_STEPS, _hf_dpo, _logged, write_pairs
from tests.posttrain.test_preference import _preprocess as _preprocess_pairs
from tests.posttrain.test_sft import SEQ, SGD_LIKE, _check_against_hf, _model_flags, _run_jobs, write_examples
from tests.posttrain.test_sft import _saved_weights_as_hf, convert_from_hf, preprocess_sft_data

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
    model = _model_flags(webtext_data) + LLAMA + ["--load", start]
    sft = model + ["--data-path", sft_prefix, "--split", "80,20,0", "--save", str(root / "sft"), "--batch-size", "4"] \
        + SGD_LIKE
    dpo = model + ["--data-path", pairs_prefix, "--split", "100,0,0", "--save", str(root / "dpo"), "--log-jsonl",
                   str(root / "dpo.jsonl")] + TWO_STEPS
    results = run_distributed(_run_jobs, 2, args=([("sft", "finetune", sft), ("dpo", "finetune", dpo)],),
                              timeout=900)
    assert results[0] == results[1], "the model-parallel ranks log different losses"
    common = {"root": root, "hf_dir": hf_dir, "webtext": webtext_data}
    return {"sft": dict(common, prefix=sft_prefix), "dpo": dict(common, prefix=pairs_prefix)}, results[0]


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
