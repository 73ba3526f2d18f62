"""--recompute-granularity full|selective, --recompute-method uniform|block, --recompute-num-layers (mpu/recompute.py).

Every mode is bitwise the run without recomputation (losses, every gradient, the weights after SGD steps, the RNG
streams) with dropout on: in one process (none, selective, full uniform 1 and 2, block 1 and 2 on 4 layers), at
model-parallel size 2 (selective, also with zero.checkpointing partitioning configured, and block 2), and through
pretrain_gpt.py at pp 2 on the Megatron path and on ZeRO-1 with LoRA. The layers each method checkpoints are the
right ones. The activation bytes kept for backward, measured with saved_tensors_hooks (distinct storages, parameters
excluded), are within 10% of memory.activation_bytes_saved (the issue's bound), and on the CPU equal to it. The
flags: Megatron-LM's rules, each refused combination one line; the TFLOP/s count of the recomputed work.
"""
import pytest
import torch

import mpu
from megatron.guards import memory
from megatron.guards.memory import saved_activation_bytes as _saved_activation_bytes  # tests import this name
from megatron.spawn import run_distributed
from tests.helpers import TINY, parser_error, train_each

LAYERS, HIDDEN, HEADS, SEQ, BATCH, STEPS, LR, DROPOUT = 4, 32, 4, 16, 2, 3, 0.1, 0.2
MEASURE_SEQ = 64        # the memory measurement's sequence: a/s/h large enough for the s x s terms to matter
MEASURE_BATCHES = (1, 2)  # at micro batch 1 the math attention keeps v as a view of the whole qkv output
MODES = {"none": mpu.RecomputeConfig(), "selective": mpu.RecomputeConfig("selective"),
         "full uniform 1": mpu.RecomputeConfig("full", "uniform", 1),
         "full uniform 2": mpu.RecomputeConfig("full", "uniform", 2),
         "full block 1": mpu.RecomputeConfig("full", "block", 1),
         "full block 2": mpu.RecomputeConfig("full", "block", 2)}
MP2_MODES = ("none", "selective", "full block 2")
# The layers the first forward runs without autograd (inside a checkpoint), per mode: a stage of 4 layers.
CHECKPOINTED = {"none": [False] * 4, "selective": [False] * 4, "full uniform 1": [True] * 4,
                "full uniform 2": [True] * 4, "full block 1": [True, False, False, False],
                "full block 2": [True, True, False, False]}


def _inputs(seq=SEQ, batch=BATCH):
    generator = torch.Generator().manual_seed(7)                   # the same draws on every rank and device
    x = torch.randn(batch, seq, HIDDEN, generator=generator).to(mpu.get_device())
    return x, torch.randn(batch, seq, HIDDEN, generator=generator).to(mpu.get_device())


def _train_steps(model, x, target):
    """STEPS forward/backward/SGD steps from one RNG state: losses, gradients (the input's too) per step, final
    weights, RNG states afterwards (all on the CPU)."""
    mpu.model_parallel_cuda_manual_seed(99)
    losses, grads = [], []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        loss = (model(leaf) * target).sum()
        loss.backward()
        losses.append(loss.detach().cpu())
        grads.append({"input": leaf.grad.cpu(), **{n: p.grad.cpu() for n, p in model.named_parameters()}})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    device_state = torch.cuda.get_rng_state(mpu.get_device()) if mpu.get_device().type == "cuda" else None
    rng = (torch.get_rng_state(), device_state, mpu.get_cuda_rng_tracker().get_states())
    return losses, grads, weights, rng


def _checkpointed_layers(model, x):
    """Per layer, whether the first forward ran it without autograd (inside a checkpointed group)."""
    seen = []
    handles = [layer.register_forward_pre_hook(lambda *_: seen.append(not torch.is_grad_enabled()))
               for layer in model.layers]
    model(x.clone().requires_grad_())
    for handle in handles:
        handle.remove()
    return seen


def _worker(modes):
    from megatron.model.gpt2_model import activation_checkpointing_pair
    from megatron.zero import checkpointing
    mpu.model_parallel_cuda_manual_seed(1234)
    model = mpu.ParallelTransformer(LAYERS, HIDDEN, HEADS, DROPOUT, DROPOUT, final_layernorm=False)
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    x, target = _inputs()
    results = {"runs": {}, "checkpointed": {}, "saved bytes": {}}
    for name in modes:
        model.load_state_dict(initial)
        model.recompute = MODES[name]
        results["runs"][name] = _train_steps(model, x, target)
        results["checkpointed"][name] = _checkpointed_layers(model, x)
        results["saved bytes"][name] = {batch: _saved_activation_bytes(model, _inputs(MEASURE_SEQ, batch)[0])
                                        for batch in MEASURE_BATCHES}
    if mpu.get_model_parallel_world_size() > 1:
        # zero.checkpointing configured to partition (as --deepspeed_activation_checkpointing would): selective
        # must still keep q/k/v whole, they hold this rank's heads
        checkpointing.configure(mpu, partition_activations=True)
        model.set_activation_checkpointing(*activation_checkpointing_pair())
        model.load_state_dict(initial)
        model.recompute = MODES["selective"]
        results["runs"]["selective, zero.checkpointing partitioning"] = _train_steps(model, x, target)
        checkpointing.unconfigure()
    return results


@pytest.fixture(scope="module")
def single_process():
    return run_distributed(_worker, 1, args=(list(MODES),), model_parallel_size=1)[0]


@pytest.fixture(scope="module")
def model_parallel():
    return run_distributed(_worker, 2, args=(MP2_MODES,), model_parallel_size=2)


def _assert_bitwise_equal(where, got, want):
    (losses, grads, weights, rng), (ref_losses, ref_grads, ref_weights, ref_rng) = got, want
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"{where}: losses {losses} != {ref_losses}"
    for step, (g, ref) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == ref.keys()
        for key in ref:
            assert torch.equal(g[key], ref[key]), f"{where}: step {step} gradient of {key}"
    assert all(torch.equal(weights[key], ref_weights[key]) for key in ref_weights), f"{where}: weights"
    assert torch.equal(rng[0], ref_rng[0]), f"{where}: the default generator moved differently"
    assert rng[2].keys() == ref_rng[2].keys() and all(torch.equal(rng[2][k], ref_rng[2][k]) for k in rng[2]), \
        f"{where}: the tracker's stream moved differently"


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recomputation_is_bitwise_the_plain_run_with_dropout(single_process, mode):
    runs = single_process["runs"]
    _assert_bitwise_equal(mode, runs[mode], runs["none"])
    losses = runs["none"][0]
    assert len(set(float(loss) for loss in losses)) == STEPS          # dropout and the steps change the loss


@pytest.mark.parametrize("mode", [m for m in MP2_MODES if m != "none"] +
                         ["selective, zero.checkpointing partitioning"])
def test_mp2_recomputation_is_bitwise_the_plain_mp2_run(model_parallel, mode):
    for rank, results in enumerate(model_parallel):
        _assert_bitwise_equal(f"rank {rank} {mode}", results["runs"][mode], results["runs"]["none"])
    # the ranks' attention dropout masks differ (the tracker's per-rank stream): so do their q/k/v gradients
    grads = [results["runs"]["none"][1][0]["layers.0.attention.query_key_value.weight"] for results in model_parallel]
    assert not torch.equal(grads[0], grads[1])


def test_each_method_checkpoints_the_right_layers(single_process):
    assert single_process["checkpointed"] == CHECKPOINTED


def _layout():
    return memory.ActivationLayout.for_run("cpu", 4, DROPOUT, DROPOUT)


@pytest.mark.parametrize("mp", [1, 2])
def test_saved_activation_bytes_match_the_formula(single_process, model_parallel, mp):
    results = [single_process] if mp == 1 else model_parallel
    for rank, result in enumerate(results):
        for mode, by_batch in result["saved bytes"].items():
            for batch, measured in by_batch.items():
                formula = memory.activation_bytes_saved(LAYERS, MEASURE_SEQ, batch, HIDDEN, HEADS, mp, MODES[mode],
                                                        _layout())
                assert abs(measured - formula) <= 0.1 * formula, (mp, rank, mode, batch, measured, formula)
                # tighter than the 10%: the derivation counts every tensor our layer keeps on the CPU,
                # so a changed term (or a torch whose math attention keeps other tensors) shows here
                assert measured == formula, (mp, rank, mode, batch, measured, formula)
    saved = {mode: by_batch[2] for mode, by_batch in results[0]["saved bytes"].items()}
    sbh = MEASURE_SEQ * 2 * HIDDEN * 4                               # one fp32 [b, s, h]
    if mp == 1:     # selective drops the s x s terms; uniform 2 keeps half the inputs of uniform 1
        assert saved["none"] > 2 * saved["selective"] > 8 * saved["full uniform 1"] == 8 * LAYERS * sbh
        assert saved["full uniform 2"] == 2 * sbh
        assert saved["full block 1"] == sbh + 3 * saved["none"] // LAYERS
    else:
        assert saved["none"] > 1.9 * saved["selective"] and saved["full block 2"] == 2 * sbh + saved["none"] // 2


# ---- the command line ------------------------------------------------------------------------------------------
BASE = ["--mock-data", "--num-layers", "4"]


def _parse(argv):
    from megatron.arguments import parse_args
    return parse_args(args_list=argv)


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations is the older spelling of --recompute-granularity full --recompute-method uniform "
     "--recompute-num-layers N: drop it or --recompute-granularity"),
    (["--checkpoint-num-layers", "2"], "--checkpoint-num-layers (2) needs --checkpoint-activations"),
    (["--recompute-method", "block"], "--recompute-method need --recompute-granularity full"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "--recompute-method are for --recompute-granularity full: selective recomputes"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"], "--recompute-num-layers are for"),
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method uniform"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"],
     "--recompute-num-layers (5) is more than the layers per pipeline stage (4 / 1 = 4)"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers is 0: it must be a positive number"),
    (["--recompute-granularity", "selective", "--torch-compile"], "selective recomputes the eager attention core"),
    (["--checkpoint-activations", "--deepspeed_activation_checkpointing"],
     "--deepspeed_activation_checkpointing sets how full recomputation keeps"),
])
def test_inconsistent_recompute_flags_are_one_line(capsys, flags, message):
    assert message in parser_error(_parse, BASE + flags, capsys)


@pytest.mark.parametrize("flags", [[], ["--recompute-granularity", "selective"]])
def test_zero_activation_checkpointing_needs_full_recomputation(tmp_path, capsys, flags):
    """--deepspeed_activation_checkpointing says how full recomputation keeps its checkpoints: with selective or no
    recomputation there are none to keep."""
    config = tmp_path / "ds_config.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}}')
    zero = ["--deepspeed", "--deepspeed_config", str(config), "--deepspeed_activation_checkpointing"]
    assert "it needs --deepspeed and --recompute-granularity full" in parser_error(_parse, BASE + zero + flags, capsys)
    args = _parse(BASE + zero + ["--recompute-granularity", "full", "--recompute-method", "uniform"])
    assert args.deepspeed_activation_checkpointing and args.recompute_granularity == "full"


def test_pipeline_stage_bounds_recompute_num_layers(monkeypatch, capsys):
    """At pp 2 a stage holds 2 of the 4 layers: block 2 checkpoints all of them, 3 is out of range."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = BASE + ["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method",
                    "block", "--recompute-num-layers"]
    args = _parse(flags + ["2"])
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == ("full", "block", 2)
    assert "(3) is more than the layers per pipeline stage (4 / 2 = 2)" in parser_error(_parse, flags + ["3"], capsys)


@pytest.mark.parametrize("flags,resolved", [
    ([], (None, None, None)),
    (["--checkpoint-activations"], ("full", "uniform", 1)),
    (["--checkpoint-activations", "--checkpoint-num-layers", "6"], ("full", "uniform", 6)),  # one group, as before
    (["--recompute-granularity", "selective"], ("selective", None, None)),
    (["--recompute-granularity", "full", "--recompute-method", "block"], ("full", "block", 1)),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "4"],
     ("full", "uniform", 4)),
])
def test_flags_resolve_to_one_recompute_config(flags, resolved):
    from megatron.model.gpt2_model import recompute_config_from_args
    args = _parse(BASE + flags)
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers) == resolved
    assert recompute_config_from_args(args) == mpu.RecomputeConfig(*resolved)


def test_layer_chunks_table():
    """mpu/recompute.py's table, row by row."""
    def chunks(*config):
        return mpu.RecomputeConfig(*config).layer_chunks(4)
    assert chunks("full", "uniform", 1) == [(0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]
    assert chunks("full", "uniform", 2) == [(0, 2, True), (2, 4, True)]
    assert chunks("full", "uniform", 3) == [(0, 3, True), (3, 4, True)]
    assert chunks("full", "block", 1) == [(0, 1, True), (1, 2, False), (2, 3, False), (3, 4, False)]
    assert chunks("full", "block", 2) == [(0, 1, True), (1, 2, True), (2, 3, False), (3, 4, False)]
    assert chunks("selective") == chunks() == [(i, i + 1, False) for i in range(4)]
    for bad in [("full",), ("full", "uniform", 0), ("selective", "block"), ("selective", None, 1), (None, "uniform"),
                ("partial",), ("full", "uniform", True)]:
        with pytest.raises(ValueError):
            mpu.RecomputeConfig(*bad)


# ---- through pretrain_gpt.py: pipeline stages, the ZeRO engine, LoRA --------------------------------------------
PIPELINE = TINY + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--train-iters", "3",
                   "--hidden-dropout", "0.2", "--attention-dropout", "0.2", "--batch-size", "2",
                   "--global-batch-size", "4"]
RECOMPUTE_FLAGS = {"none": [], "selective": ["--recompute-granularity", "selective"],
                   "full block 1": ["--recompute-granularity", "full", "--recompute-method", "block"],
                   "full uniform 2": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                      "--recompute-num-layers", "2"]}


@pytest.fixture(scope="module")
def pipelined_runs(tmp_path_factory):
    """pp 2, 2 layers a stage, 2 micro-batches, dropout: the Megatron path, and ZeRO-1 with LoRA adapters."""
    config = tmp_path_factory.mktemp("zero1") / "ds_config.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, '
                      '"zero_optimization": {"stage": 1}}')
    paths = {"megatron": [], "zero1 lora": ["--deepspeed", "--deepspeed_config", str(config), "--lora-rank", "4"]}
    argv = [PIPELINE + extra + RECOMPUTE_FLAGS[mode] for extra in paths.values() for mode in RECOMPUTE_FLAGS]
    histories = run_distributed(train_each, 2, args=(argv,))
    losses = [history["lm loss"] for history in histories[1]]      # the last stage's
    return {(path, mode): losses.pop(0) for path in paths for mode in RECOMPUTE_FLAGS}


@pytest.mark.parametrize("path", ["megatron", "zero1 lora"])
def test_pipelined_training_is_bitwise_the_plain_run(pipelined_runs, path):
    plain = pipelined_runs[path, "none"]
    assert len(plain) == 3 and len(set(plain)) == 3
    for mode in RECOMPUTE_FLAGS:
        assert pipelined_runs[path, mode] == plain, (path, mode)


def test_flops_count_one_more_forward_of_what_is_recomputed():
    """The TFLOP/s log line's count: full uniform adds a forward of every layer, block the checkpointed share of
    each stage's layers, selective the attention core (QK^T and AV, 4sh per layer and token)."""
    from megatron.training import flops_per_token
    L, h, s, V = 4, 64, 128, 256
    plain, layer = flops_per_token(L, h, s, V), 24 * h * h * (1 + s / (6 * h))
    assert flops_per_token(L, h, s, V, checkpoint_activations=True) == plain + L * layer
    assert flops_per_token(L, h, s, V, recompute=MODES["full uniform 2"]) == plain + L * layer
    assert flops_per_token(L, h, s, V, recompute=MODES["full block 1"], num_stages=2) == plain + L * layer / 2
    assert flops_per_token(L, h, s, V, recompute=MODES["selective"]) == plain + L * 4 * s * h
