"""tools/convert_to_hf.py and tools/zero_to_fp32.py on MoE checkpoints saved under expert parallelism
(megatron/checkpoint/experts.py: rank 0's param names hold its own experts only; data-parallel rank d's optimizer
file holds the experts of expert-parallel position d % EP), and the refusal of an MoE model without the Llama
options (Mixtral is Llama with MoE).

- a Mixtral-shaped model (Llama options, 4 experts, top 2) trained 2 steps at EP 2 x data-parallel 2, ZeRO 1 and
  ZeRO 2: convert_to_hf's MixtralForCausalLM gives the logits of our model built in one process from the live
  parameters (1e-4); zero_to_fp32 gives the live parameters bitwise (fp32), and in bf16 the fp32 masters the live
  bf16 parameters were rounded from; the exported tokenizer encodes as megatron.tokenizer;
- a GPT-2-shaped MoE (GeLU experts, biases, learned positions; --ffn-hidden-size set) is refused in one line naming
  the flags of the Llama options, and nothing is written.

One 2-process launch trains and saves all four checkpoints, one 1-process launch computes our logits; the tools run
in this process.
"""
import os

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, TINY_SHAPE, train_keeping_model, write_config

import convert_to_hf  # noqa: E402  (tests.helpers puts tools/ on sys.path)
import zero_to_fp32  # noqa: E402

LLAMA = ["--swiglu", "--use-rotary-position-embeddings", "--no-position-embedding", "--normalization", "rmsnorm",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-key-value-heads", "2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--ffn-hidden-size", "24"]
EP2 = ["--expert-model-parallel-size", "2"]
RUNS = {"zero1": (1, False, LLAMA + EP2), "zero2": (2, False, LLAMA + EP2), "zero2_bf16": (2, True, LLAMA + EP2),
        "gpt2_moe": (2, False, [])}               # name: (ZeRO stage, bf16, flags)
LLAMA_FLAGS = ["--swiglu", "--normalization rmsnorm", "--disable-bias-linear", "--no-position-embedding",
               "--use-rotary-position-embeddings"]
VOCAB = 8192                                      # the default data's tokenizer
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _train_all(runs):
    """Each run in turn; this rank's live parameters (its experts only under EP) and the model's config."""
    import mpu
    results = {}
    for name, argv in runs.items():
        _, model = train_keeping_model(argv)
        results[name] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                         "config": model.config}
        mpu.destroy_model_parallel()
    return results


def _our_logits(models, tokens):
    """{name: logits of `tokens`} of our GPT2Model of each (config, weights) in `models`, built in one process
    (every expert here) holding the weights."""
    from megatron.model import GPT2Model
    logits = {}
    for name, (config, weights) in models.items():
        model = GPT2Model(config, num_tokentypes=0, parallel_output=False).eval()
        params = dict(model.named_parameters())
        assert params.keys() == weights.keys()
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(weights[key])
            position_ids = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
            logits[name] = model(tokens, position_ids)[..., :VOCAB].clone()
    logits["ep1_order"] = list(params)      # the parameter order at EP 1 (the optimizer groups' order)
    return logits


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory, webtext_data):
    root = tmp_path_factory.mktemp("moe_export")
    data = ["--data-path", os.path.join(webtext_data, "webtext_text_document"),
            "--vocab-file", os.path.join(webtext_data, "vocab.json"),
            "--merge-file", os.path.join(webtext_data, "merges.txt"), "--data-cache-path", str(root / "cache")]
    common = TINY_SHAPE + NO_DROPOUT + MOE + data + [
        "--max-position-embeddings", "16", "--train-iters", "2", "--lr", "1e-2", "--warmup", "0",
        "--log-interval", "100", "--eval-iters", "0", "--deepspeed"]
    argvs, saves = {}, {}
    for name, (stage, bf16, flags) in RUNS.items():
        os.makedirs(root / name)
        config = write_config(str(root / name), bf16={"enabled": bf16}, zero_optimization={
            "stage": stage, "reduce_bucket_size": 5000, "allgather_bucket_size": 5000})
        saves[name] = str(root / name / "ckpt")
        argvs[name] = common + flags + ["--deepspeed_config", config, "--save", saves[name]]
    ranks = run_distributed(_train_all, 2, args=(argvs,))
    live = {name: {**ranks[1][name]["params"], **ranks[0][name]["params"]} for name in RUNS}   # every expert
    fp32 = {name: (ranks[0][name]["config"], live[name]) for name in ("zero1", "zero2")}
    ours = run_distributed(_our_logits, 1, args=(fp32, TOKENS), model_parallel_size=1)[0]
    return {"root": root, "saves": saves, "live": live, "our_logits": ours,
            "rank_params": [r["zero2"]["params"] for r in ranks], "webtext": webtext_data}


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_mixtral_export_at_expert_parallel_2_gives_our_logits(moe_runs, name):
    from transformers import MixtralForCausalLM
    out = str(moe_runs["root"] / f"hf_{name}")
    assert convert_to_hf.main(["--load", moe_runs["saves"][name], "--output", out]) == 0
    hf = MixtralForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(TOKENS).logits
    ours = moe_runs["our_logits"][name]
    assert theirs.shape == ours.shape == (2, 16, VOCAB)
    assert (theirs - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_to_fp32_at_expert_parallel_2_gives_the_live_weights(moe_runs, name, tmp_path):
    out = str(tmp_path / "fp32.pt")
    assert zero_to_fp32.main([moe_runs["saves"][name], out]) == 0
    state = torch.load(out, weights_only=True)
    live = moe_runs["live"][name]
    assert state.keys() == live.keys()
    assert [n for n in live if not torch.equal(state[n], live[n])] == []
    # both positions' experts are there, and they differ (a position read from the other's files would not)
    expert = "transformer.layers.1.mlp.experts.{}.dense_h_to_4h.weight"
    assert expert.format(3) in moe_runs["rank_params"][1] and expert.format(3) not in moe_runs["rank_params"][0]
    assert not torch.equal(state[expert.format(1)], state[expert.format(3)])


def test_zero_to_fp32_of_bf16_at_expert_parallel_2_gives_the_masters(moe_runs, tmp_path):
    """The live bf16 parameters are the masters rounded; the consolidated fp32 masters are not the bf16 values."""
    out = str(tmp_path / "fp32.pt")
    assert zero_to_fp32.main([moe_runs["saves"]["zero2_bf16"], out]) == 0
    state = torch.load(out, weights_only=True)
    live = moe_runs["live"]["zero2_bf16"]
    assert state.keys() == live.keys() and all(t.dtype == torch.float32 for t in state.values())
    assert [n for n in live if not torch.equal(state[n].to(torch.bfloat16), live[n])] == []
    experts = [n for n in live if ".experts.3." in n]
    assert experts and all(not torch.equal(state[n], live[n].float()) for n in experts)


def test_checkpoint_util_at_expert_parallel_2_keeps_every_experts_optimizer_state(moe_runs, tmp_path):
    """--target-path zero writes a data-parallel-1, EP-1 checkpoint: its expert param group lists every expert in
    EP 1's order, with the fp32 masters of the live model."""
    import checkpoint_util
    from megatron.checkpoint.reshard import SavedCheckpoint
    _, written = checkpoint_util.resize(moe_runs["saves"]["zero2"], str(tmp_path / "ep1"), 1, "zero")
    resized = SavedCheckpoint(str(tmp_path / "ep1"))
    ep1_experts = [n for n in moe_runs["our_logits"]["ep1_order"] if ".experts." in n]
    assert [n for names in resized.param_names for n in names if ".experts." in n] == ep1_experts
    live = moe_runs["live"]["zero2"]
    assert [n for n in live if not torch.equal(resized.full_tensor(n, "master"), live[n])] == []


def test_mixtral_export_writes_our_tokenizer(moe_runs):
    from transformers import AutoTokenizer
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    out = str(moe_runs["root"] / "hf_tokenizer")
    assert convert_to_hf.main(["--load", moe_runs["saves"]["zero2"], "--output", out]) == 0
    ours = GPT2BPETokenizer(os.path.join(moe_runs["webtext"], "vocab.json"),
                            os.path.join(moe_runs["webtext"], "merges.txt"))
    theirs = AutoTokenizer.from_pretrained(out)
    text = "Mixture of experts: each token takes 2 of 4 MLPs.\n\n  Done."
    assert theirs(text)["input_ids"] == ours.tokenize(text)
    assert theirs.eos_token_id == ours.eod


@pytest.mark.parametrize("existing", [False, True], ids=["new_dir", "existing_dir"])
def test_gpt2_shaped_moe_is_refused_in_one_line_writing_nothing(moe_runs, existing, tmp_path, capsys):
    out = tmp_path / "hf"
    if existing:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    assert convert_to_hf.main(["--load", moe_runs["saves"]["gpt2_moe"], "--output", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Mixtral" in lines[0], lines
    assert all(flag in lines[0] for flag in LLAMA_FLAGS), lines[0]
    if existing:
        assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.exists()


@pytest.mark.parametrize("key,value,flag", [("swiglu", False, "--swiglu"),
                                            ("normalization", "layernorm", "--normalization rmsnorm"),
                                            ("add_bias_linear", True, "--disable-bias-linear"),
                                            ("learned_position_embeddings", True, "--no-position-embedding"),
                                            ("rotary", False, "--use-rotary-position-embeddings")])
def test_each_missing_llama_option_is_named(moe_runs, key, value, flag):
    """One Llama option off at a time: the refusal names that flag only."""
    from megatron.model.hf_interchange import InterchangeError
    from megatron.model.hf_mixtral import to_hf_mixtral_config_dict
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    model_config = dict(read_full_checkpoint(moe_runs["saves"]["zero2"]).model_config)
    to_hf_mixtral_config_dict(model_config)                       # all on: accepted
    with pytest.raises(InterchangeError) as refused:
        to_hf_mixtral_config_dict(dict(model_config, **{key: value}))
    assert [f for f in LLAMA_FLAGS if f in str(refused.value)] == [flag]


def test_expert_positions_at_data_parallel_4():
    """EP 2 at data-parallel 4 (two ranks per position): position p's files are ranks p and p + 2, in order; its
    names are rank 0's renumbered by p E/EP; every expert in EP 1's order, per MoE layer."""
    from megatron.checkpoint import experts, layout as ckpt
    files = [{ckpt.DATA_PARALLEL_RANK: rank} for rank in (3, 0, 2, 1)]   # in any order
    assert [f[ckpt.DATA_PARALLEL_RANK] for f in experts.files_at_position(files, 2, 1)] == [1, 3]
    assert [f[ckpt.DATA_PARALLEL_RANK] for f in experts.files_at_position(files, 2, 0)] == [0, 2]
    layer = "transformer.layers.{}.mlp.experts.{}.{}"
    rank0 = ["router"] + [layer.format(i, j, w) for i in (0, 1) for j in (0, 1) for w in ("w1", "w2")] + ["norm"]
    assert experts.names_at_position(rank0, 1, 2)[1:3] == [layer.format(0, 2, "w1"), layer.format(0, 2, "w2")]
    assert experts.with_every_expert(rank0, 2, 2) == \
        ["router"] + [layer.format(i, j, w) for i in (0, 1) for j in range(4) for w in ("w1", "w2")] + ["norm"]
