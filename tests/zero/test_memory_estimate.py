"""megatron/guards/memory.py: the model-state estimate equals the engine's real tensors to the byte (stages 0-2, mp 1
and 2, dp 2); GPT-2 parameter counts match a real GPT2Model; tools/estimate_memory.py prints the same numbers
as the training script's start-up line."""
import json
import os
import re
import sys

import pytest
import torch

from megatron.guards import memory
from megatron.spawn import run_distributed
from tests.helpers import (ds_config, engine_train_step, MOCK_VOCAB, NO_DROPOUT, ParallelTinyNet, param_groups, REPO,
                           TINY, TINY_SHAPE, TinyNet)
from tests import warm_python

BUCKET = 300


# (dtype, stage, offload_optimizer): stages 0-2 in fp32 and bf16, and stage 2 with the optimizer offloaded
VARIANTS = [(dtype, stage, False) for dtype in ("float32", "bfloat16") for stage in (0, 1, 2)] + \
    [(dtype, 2, True) for dtype in ("float32", "bfloat16")]


def _engine_memory(model_parallel):
    import mpu
    from megatron import zero
    out = []
    for dtype, stage, offload in VARIANTS:
        model = ParallelTinyNet() if model_parallel else TinyNet()
        groups = param_groups(model)
        counts = [sum(p.numel() for p in g["params"]) for g in groups]
        config = ds_config(stage, 2, reduce_bucket_size=BUCKET, overlap_comm=stage == 2, contiguous_gradients=True)
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if dtype == "bfloat16":
            config["bf16"] = {"enabled": True}
        engine, optimizer, _, _ = zero.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-3),
                                                  config=config, mpu=mpu, dist_init_required=False)
        dp = mpu.get_data_parallel_world_size()
        estimate = memory.model_state_bytes(counts, dtype, zero.load_config(config, dp), dp)
        engine_train_step(engine, 0, 2 * dp)
        out.append(((dtype, stage, offload), counts, estimate, memory.measured_model_state_bytes(optimizer)))
    return out


_RESULTS = {}


def _engine_memory_results(mp):
    """Every rank's [(variant, group counts, estimate, measured)] at model-parallel size mp, dp 2 (one run each)."""
    if mp not in _RESULTS:
        _RESULTS[mp] = run_distributed(_engine_memory, 2 * mp, args=(mp > 1,), model_parallel_size=mp)
    return _RESULTS[mp]


@pytest.mark.parametrize("mp", [1, 2])
def test_estimate_equals_engine_tensors_to_the_byte(mp):
    for rank_results in _engine_memory_results(mp):
        for variant, counts, estimate, measured in rank_results:
            where = (mp, variant)
            for kind in memory.KINDS + ("total", "host"):
                assert estimate[kind] == measured[kind], (where, kind, estimate, measured)
            assert 0 <= measured["buckets"] <= estimate["buckets"], (where, estimate, measured)
            P = sum(counts)
            if variant == ("bfloat16", 2, False):     # the ZeRO paper's 2P + (2 + 12)P/dp, plus padding
                assert 2 * P + 14 * P / 2 <= estimate["total"] <= 2 * P + 14 * P / 2 + 16 * 2 * 32 * len(counts)


def test_stage2_offload_estimate_and_measurement_equal_hand_computed_bytes():
    """Stage 2, dp 2, offload_optimizer cpu, TinyNet's groups [1792, 136] elements, each padded to a multiple of
    dp x 32 = 64: [1792, 192], so each rank owns 896 + 96 = 992. Device: the whole 16-bit (or fp32) parameter
    buffer only; host: the fp32 master partition (a copy even in fp32), the two fp32 Adam moments and the
    gradient partition in the parameters' dtype."""
    padded, own = 1792 + 192, 896 + 96
    expected = {"float32": ({"parameters": 4 * padded, "gradients": 0, "master": 0, "moments": 0},
                            4 * own + 8 * own + 4 * own),
                "bfloat16": ({"parameters": 2 * padded, "gradients": 0, "master": 0, "moments": 0},
                             4 * own + 8 * own + 2 * own)}
    checked = []
    for rank_results in _engine_memory_results(1):
        for (dtype, stage, offload), counts, estimate, measured in rank_results:
            if not offload:
                continue
            assert counts == [1792, 136]
            device, host = expected[dtype]
            for figures in (estimate, measured):
                assert {kind: figures[kind] for kind in memory.KINDS} == device, (dtype, figures)
                assert figures["total"] == device["parameters"] and figures["host"] == host, (dtype, figures)
            checked.append(dtype)
    assert sorted(checked) == ["bfloat16", "bfloat16", "float32", "float32"]     # two ranks


def _gpt2_counts(num_layers, hidden, heads, vocab, seq):
    import mpu
    from megatron.model import GPT2Model
    from megatron.model.gpt2_model import GPT2ModelConfig
    from megatron.training import param_groups_for_weight_decay
    model = GPT2Model(GPT2ModelConfig(num_layers=num_layers, vocab_size=vocab, hidden_size=hidden,
                                      num_attention_heads=heads, max_sequence_length=seq))
    return ([sum(p.numel() for p in g["params"]) for g in param_groups_for_weight_decay(model)],
            mpu.get_model_parallel_world_size(), sorted(p.numel() for p in model.parameters()))


@pytest.mark.parametrize("mp", [1, 2])
def test_gpt2_parameter_count_matches_real_model(mp):
    shape = dict(num_layers=3, hidden=48, heads=4, vocab=256, seq=40)
    for counts, size, sizes in run_distributed(_gpt2_counts, mp, args=tuple(shape.values()), model_parallel_size=mp):
        assert list(memory.gpt2_param_groups(3, 48, 256, 40, size)) == counts
        assert sorted(n for n, _ in memory.gpt2_parameter_sizes(3, 48, 256, 40, size)) == sizes


LLAMA_FLAGS = ["--num-key-value-heads", "2", "--ffn-hidden-size", "80", "--swiglu", "--normalization", "rmsnorm",
               "--disable-bias-linear", "--no-position-embedding", "--untie-embeddings-and-output-weights"]
LLAMA_ARCHITECTURE = dict(num_key_value_heads=2, ffn_hidden_size=80, swiglu=True, normalization="rmsnorm",
                          add_bias_linear=False, learned_position_embeddings=False, rotary=True,
                          untie_embeddings_and_output_weights=True)


def _llama_counts(num_layers, hidden, heads, vocab, seq):
    """(weight decay, no decay) parameters of this rank's real Llama-shaped GPT2Model."""
    from megatron.model import GPT2Model
    from megatron.model.gpt2_model import GPT2ModelConfig
    from megatron.training import param_groups_for_weight_decay
    model = GPT2Model(GPT2ModelConfig(num_layers=num_layers, vocab_size=vocab, hidden_size=hidden,
                                      num_attention_heads=heads, max_sequence_length=seq, **LLAMA_ARCHITECTURE))
    return [sum(p.numel() for p in g["params"]) for g in param_groups_for_weight_decay(model)]


def test_tool_parameters_for_llama_flags_equal_the_real_models(capsys):
    """Every Llama flag changes the count (no biases, no position table, an untied head, SwiGLU's three matrices,
    2 kv heads): the tool's parameters per rank at mp 2, and its fp32 parameter bytes, are the real model's."""
    import estimate_memory
    shape = (3, 48, 4, 256, 40)      # layers, hidden, heads, vocab (a multiple of 128 x mp: no padding), seq
    counts = run_distributed(_llama_counts, 2, args=shape, model_parallel_size=2)
    assert counts[0] == counts[1]
    states = estimate_memory.main(["--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "4",
                                   "--seq-length", "40", "--vocab-size", "256", "--model-parallel-size", "2",
                                   *LLAMA_FLAGS])
    printed = capsys.readouterr().out
    assert f"parameters per model-parallel rank: {sum(counts[0])} (weight decay {counts[0][0]}, no decay " \
           f"{counts[0][1]};" in printed, (counts, printed)
    assert states["parameters"] == 4 * sum(counts[0])


def _printed(text, what):
    match = re.search(rf"model-state memory {what}[^(]*\(bytes, [^)]*\): (.*)", text)
    assert match, text
    return dict(kv.split("=") for kv in match.group(1).split(" (")[0].split())


def _train_capturing(args_list):
    from tests.training.test_metrics import _train_capturing as capture
    return capture(args_list)


ZERO3_OFFLOAD = ({"stage3_param_persistence_threshold": 64, "offload_optimizer": {"device": "cpu"},
                  "offload_param": {"device": "cpu"}},
                 ["--param-persistence-threshold", "64", "--offload-optimizer", "--offload-param"])


@pytest.mark.parametrize("stage,precision,zero_extra,tool_extra",
                         [(1, "bf16", {}, []), (2, "fp32", {}, []),
                          (3, "fp32", {"stage3_param_persistence_threshold": 64},
                           ["--param-persistence-threshold", "64"]), (3, "bf16", *ZERO3_OFFLOAD)])
def test_training_prints_estimate_and_measurement_and_tool_agrees(tmp_path, stage, precision, zero_extra,
                                                                    tool_extra):
    from tests.helpers import write_config
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    config = write_config(str(tmp_path), zero_optimization={"stage": stage, "reduce_bucket_size": BUCKET,
                                                            "contiguous_gradients": True, **zero_extra}, **extra)
    history, out = run_distributed(_train_capturing, 2, args=(TINY + NO_DROPOUT + [
        "--train-iters", "2", "--deepspeed", "--deepspeed_config", config],))[0]
    estimate, measured = _printed(out, "estimate"), _printed(out, "measured after step 1")
    for kind in memory.KINDS + ("total", "host"):
        assert estimate[kind] == measured[kind], (kind, estimate, measured)
    assert history["model_state_estimate"]["total"] == history["model_state_measured"]["total"]
    # TINY: 2 layers, h 32, 4 heads, s 16, vocab 64 padded to a multiple of 8
    tool = warm_python.run([sys.executable, "tools/estimate_memory.py", *TINY_SHAPE, *MOCK_VOCAB[1:],
                            "--data-parallel-size", "2", "--zero-stage", str(stage), "--reduce-bucket-size",
                            str(BUCKET), *tool_extra,
                            *([f"--{precision}"] if precision != "fp32" else [])],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr
    assert _printed(tool.stdout, "estimate") == estimate
    assert "activations per rank" in tool.stdout


def test_activation_formula():
    """Korthikanti et al. 2022 in 16 bits with 1-byte masks (the default layout): s*b*h*(34 + 5*a*s/h) bytes per
    layer, the tensor-parallel part divided by t; 34sbh with selective recomputation; the input 2sbh with full;
    plus the LayerNorms' fp32 statistics, 16sb. Our fp32 CPU layout (masks of 4 bytes): sbh(72 + 12as/h)."""
    import mpu
    s, b, h, a = 1024, 4, 1024, 16
    stats = 16 * s * b
    selective, full = mpu.RecomputeConfig("selective"), mpu.RecomputeConfig("full", "uniform", 1)
    assert memory.activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h) + stats
    assert memory.activation_bytes_per_layer(s, b, h, a, 2) == s * b * h * (10 + (24 + 5 * a * s / h) / 2) + stats
    assert memory.activation_bytes_per_layer(s, b, h, a, recompute=selective) == 34 * s * b * h + stats
    assert memory.activation_bytes_per_layer(s, b, h, a, 2, recompute=selective) == (10 + 24 / 2) * s * b * h + stats
    assert memory.activation_bytes_per_layer(s, b, h, a, 2, recompute=full) == 2 * s * b * h
    partitioned = memory.ActivationLayout(partition_activations=True)
    assert memory.activation_bytes_per_layer(s, b, h, a, 2, full, partitioned) == s * b * h
    cpu_fp32 = memory.ActivationLayout.for_run("cpu", 4, 0.1, 0.1)
    assert memory.activation_bytes_per_layer(s, b, h, a, layout=cpu_fp32) == s * b * h * (72 + 12 * a * s / h) + stats
    # CUDA: bool masks, SDPA's fused kernels keep their output and an fp32 log-sum-exp instead of the s x s scores
    cuda_bf16 = memory.ActivationLayout.for_run("cuda", 2, 0.1, 0.1)
    assert memory.activation_bytes_per_layer(s, b, h, a, layout=cuda_bf16) == 36 * s * b * h + 4 * a * s * b + stats
    no_dropout = memory.ActivationLayout.for_run("cpu", 4, 0.0, 0.0)   # the CPU's flash kernel, no masks
    assert memory.activation_bytes_per_layer(s, b, h, a, layout=no_dropout) == 68 * s * b * h + 4 * a * s * b + stats


def test_activation_peak_per_recompute_method():
    """The peak of a stage: what it keeps, plus a recomputation's working set (full: its largest group, behind the
    checkpointed inputs; selective: one attention core), times the micro-batches in flight before the last."""
    import mpu
    s, b, h, a, L = 512, 2, 256, 8, 8
    layer = memory.activation_bytes_per_layer(s, b, h, a)
    kept_input, core = 2 * s * b * h, a * s * s * b * 5
    assert memory.activation_bytes(L, s, b, h, a) == L * layer
    assert memory.activation_bytes(L, s, b, h, a, micro_batches_in_flight=3) == 3 * L * layer
    selective = memory.activation_bytes_per_layer(s, b, h, a, recompute=mpu.RecomputeConfig("selective"))
    assert selective == layer - core
    assert memory.activation_bytes(L, s, b, h, a, recompute=mpu.RecomputeConfig("selective")) == L * selective + core
    for n, peak in ((1, L * kept_input + layer), (2, L // 2 * kept_input + 2 * layer),
                    (3, 3 * kept_input + 3 * layer)):                          # groups of 3, 3 and 2
        assert memory.activation_bytes(L, s, b, h, a, recompute=mpu.RecomputeConfig("full", "uniform", n)) == peak
    block = mpu.RecomputeConfig("full", "block", 3)
    assert memory.activation_bytes_saved(L, s, b, h, a, recompute=block) == 3 * kept_input + 5 * layer
    assert memory.activation_bytes(L, s, b, h, a, recompute=block) == 3 * kept_input + 5 * layer
    every = mpu.RecomputeConfig("full", "block", L)        # all layers one by one: the uniform-1 peak
    assert memory.activation_bytes(L, s, b, h, a, recompute=every) == L * kept_input + layer
    assert memory.activation_bytes(L, s, b, h, a, recompute=every, micro_batches_in_flight=2) == \
        2 * L * kept_input + layer
    from megatron import zero
    config = zero.load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                               "zero_optimization": {"stage": 2}}, 2)
    # buckets: DeepSpeed's defaults, contiguous_gradients off: one reduce_bucket_size (5e8) buffer of 2 bytes each
    assert memory.model_state_bytes(64, "fp16", config, 2) == {
        "parameters": 128, "gradients": 64, "master": 128, "moments": 256, "total": 576, "host": 0,
        "buckets": 10 ** 9}


def test_megatron_path_estimate_equals_measurement_and_tool():
    history, out = run_distributed(_train_capturing, 2, args=(TINY + NO_DROPOUT + [
        "--train-iters", "2", "--batch-size", "2", "--bf16"],))[0]
    estimate, measured = _printed(out, "estimate"), _printed(out, "measured after step 1")
    for kind in memory.KINDS + ("master_gradients", "total"):
        assert estimate[kind] == measured[kind], (kind, estimate, measured)
    tool = warm_python.run([sys.executable, "tools/estimate_memory.py", *TINY_SHAPE, *MOCK_VOCAB[1:],
                            "--data-parallel-size", "2", "--bf16", "--micro-batch-size", "2", "--device", "cpu",
                            "--attention-dropout", "0", "--hidden-dropout", "0"],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert _printed(tool.stdout, "estimate") == estimate
    started = re.search(r"activation memory estimate per rank \(bytes, [^)]*\): (\d+)", out)
    assert started and int(started.group(1)) == _tool_activations(tool.stdout) > 0, (out, tool.stdout)


def _tool_activations(stdout):
    match = re.search(r"activations per rank \(bytes, [^)]*\): (\d+)", stdout)
    assert match, stdout
    return int(match.group(1))


TOOL_SHAPE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
              "--vocab-size", "256", "--micro-batch-size", "2"]


@pytest.mark.parametrize("flags,recompute", [
    ([], (None, None, None)), (["--recompute-granularity", "selective"], ("selective", None, None)),
    (["--checkpoint-activations"], ("full", "uniform", 1)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     ("full", "block", 2)),
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_tool_activations_follow_the_recompute_flags(capsys, flags, recompute, device):
    import mpu
    import estimate_memory
    estimate_memory.main(TOOL_SHAPE + flags + ["--device", device])
    layout = memory.ActivationLayout.for_run(device, 4, 0.1, 0.1)
    assert _tool_activations(capsys.readouterr().out) == memory.activation_bytes(
        4, 128, 2, 64, 4, 1, mpu.RecomputeConfig(*recompute), layout)


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint-activations", "--recompute-granularity", "selective"], "give one spelling"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], "for the full granularity only"),
    (["--recompute-granularity", "full"], "needs a method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "5"],
     "--recompute-num-layers (5) is more than --num-layers (4)"),
])
def test_tool_refuses_inconsistent_recompute_flags(flags, message):
    import estimate_memory
    with pytest.raises(SystemExit) as exit_info:
        estimate_memory.main(TOOL_SHAPE + flags)
    assert message in str(exit_info.value.code)


def test_start_up_activation_estimate_counts_the_stage_and_the_micro_batches_in_flight():
    """operations.activation_estimate as training calls it: pipeline stage 0 of 2 holds 2 of 4 layers and 1F1B
    keeps min(2 - 0, 4 micro-batches) = 2 in flight there; the run's recompute flags and the CPU layout."""
    import argparse
    import mpu
    from megatron.guards import operations
    args = argparse.Namespace(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
                              pipeline_model_parallel_size=2, num_micro_batches=4, params_dtype="bfloat16",
                              attention_dropout=0.1, hidden_dropout=0.0, num_layers=4, seq_length=128, batch_size=2,
                              hidden_size=64, num_attention_heads=4, model_parallel_size=1, sequence_parallel=False)
    total, setting = operations.activation_estimate(args)
    layout = memory.ActivationLayout(bytes_per_element=2, mask_bytes=2, attention_scores=True, hidden_dropout=False)
    assert total == memory.activation_bytes(2, 128, 2, 64, 4, 1, mpu.RecomputeConfig("full", "block", 1), layout, 2)
    assert total == 2 * memory.activation_bytes_saved(2, 128, 2, 64, 4, 1, mpu.RecomputeConfig("full", "block", 1),
                                                      layout)
    assert setting == "micro batch 2 x 2 in flight, 2 layers, recompute full, block of the first 1 layer"


def test_start_up_activation_estimate_counts_interleaved_chunk_forwards():
    """Interleaved P = 4, v = 2, L = 8, M = 8: stage 0 holds 2 (P - 1) + (v - 1) P + 1 = 11 chunk forwards of one
    layer, Megatron-LM's L (1 + (P - 1) / (P v)) = 11 layers; stage 3 (v - 1) P + 1 = 5."""
    import argparse
    from unittest import mock
    import mpu
    from megatron.guards import operations
    args = argparse.Namespace(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                              pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
                              num_micro_batches=8, params_dtype="float32", attention_dropout=0.0, hidden_dropout=0.0,
                              num_layers=8, seq_length=16, batch_size=2, hidden_size=32, num_attention_heads=4,
                              model_parallel_size=1, sequence_parallel=False)
    for stage, in_flight in ((0, 11), (3, 5)):
        with mock.patch.object(mpu, "get_pipeline_model_parallel_rank", lambda: stage):
            total, setting = operations.activation_estimate(args)
        layout = memory.ActivationLayout.for_run("cpu", 4, 0.0, 0.0, False, False)
        assert total == memory.activation_bytes(1, 16, 2, 32, 4, 1, mpu.RecomputeConfig(), layout, in_flight)
        assert setting == f"micro batch 2 x {in_flight} chunk forwards in flight, 1 layers a chunk, recompute none"


def _training_path_estimates(paths_and_dtypes, dp):
    """operations.model_state_estimate as training calls it (the JSON file parsed by zero.load_config, TINY's real
    GPT2Model and its weight-decay groups), for each (config path, params dtype)."""
    import argparse
    from megatron import zero
    from megatron.guards import operations
    from megatron.model import GPT2Model
    from megatron.model.gpt2_model import GPT2ModelConfig
    from megatron.training import param_groups_for_weight_decay
    model = GPT2Model(GPT2ModelConfig(num_layers=2, vocab_size=64, hidden_size=32, num_attention_heads=4,
                                      max_sequence_length=16))
    counts = [sum(p.numel() for p in group["params"]) for group in param_groups_for_weight_decay(model)]
    return [operations.model_state_estimate(counts, argparse.Namespace(
        zero_config=zero.load_config(path, dp), params_dtype=dtype, data_parallel_size=dp), model)
        for path, dtype in paths_and_dtypes]


# (JSON config, params dtype, the tool's flags for it): every flag the tool maps to a key, off its default somewhere
TOOL_CASES = [
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 300, "overlap_comm": True,
                                                       "offload_optimizer": {"device": "cpu"}}}, "bfloat16",
     ["--bf16", "--zero-stage", "2", "--reduce-bucket-size", "300", "--overlap-comm", "--no-contiguous-gradients",
      "--offload-optimizer"]),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3, "reduce_bucket_size": 100_000,
                                                       "contiguous_gradients": True,
                                                       "stage3_param_persistence_threshold": 96,
                                                       "offload_param": {"device": "cpu"}}}, "float16",
     ["--fp16", "--zero-stage", "3", "--reduce-bucket-size", "100000", "--param-persistence-threshold", "96",
      "--offload-param"]),
    ({"zero_optimization": {"stage": 1}}, "float32", ["--zero-stage", "1"]),
]


def test_tool_estimate_for_a_json_config_equals_training_path(tmp_path):
    """tools/estimate_memory.py's flags for a JSON config give the training path's estimate for that file, every
    kind (buckets and host included); anchored by hand: stage 2 + overlap_comm without contiguous gradients holds
    (2 groups + MAX_IN_FLIGHT 2) x 300 elements x 2 bytes of buckets; stage 3 + offload_param keeps on the device only
    the parameters of at most 96 elements (per layer 4 LayerNorm vectors of 32, the QKV bias of 96 and two biases
    of 32, plus the final LayerNorm's 2 x 32: 2 x 288 + 64 = 640 elements, 2 bytes each), and with contiguous
    gradients its 2 bucket buffers hold the largest group (the decayed one: embeddings 64 x 32 + 16 x 32, per layer
    3 x 32 x 32 + 32 x 32 + 2 x 4 x 32 x 32: 2560 + 2 x 12288 = 27136 elements), not reduce_bucket_size."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import estimate_memory
    paths = []
    for i, (config, dtype, _) in enumerate(TOOL_CASES):
        path = tmp_path / f"ds_{i}.json"
        path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **config}))
        paths.append((str(path), dtype))
    training = run_distributed(_training_path_estimates, 1, args=(paths, 2), model_parallel_size=1)[0]
    shape = TINY_SHAPE + ["--vocab-size", "64", "--make-vocab-size-divisible-by", "8", "--data-parallel-size", "2"]
    for (config, _, flags), expected in zip(TOOL_CASES, training):
        assert estimate_memory.main(shape + flags) == expected, (flags, expected)
    assert training[0]["buckets"] == 4 * 300 * 2
    assert training[0]["moments"] == 0 and training[0]["host"] > 0
    assert training[1]["parameters"] == 640 * 2 and training[1]["buckets"] == 2 * 27136 * 2


def test_planning_table_against_the_zero_paper_formula():
    """Hand-worked from 2P + 2P + 12P (stage 0), 4P + 12P/dp (1), 2P + 14P/dp (2), 16P/dp (3) against 80 GB:
    the largest of the GPT-3 shapes that fits."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    import estimate_memory
    table = estimate_memory.plan(80e9)
    assert table["stage 0", 512] == "2.7B"         # 16 x 2.7e9 = 43 GB; 6.7B needs 107 GB
    assert table["stage 1", 8] == "13B"            # 5.5 x 13e9 = 72 GB; 30B needs 165 GB
    assert table["stage 2", 64] == "30B"           # 2.22 x 30e9 = 67 GB; 66B needs 146 GB
    assert table["stage 3", 8] == "30B"            # 2 x 30e9 = 60 GB; 66B needs 132 GB
    assert table["stage 3", 64] == "175B"          # 0.25 x 175e9 = 44 GB
    assert table["stage 2 + offload_optimizer", 1] == "30B"   # only the 2P parameters stay: 60 GB; 66B: 132 GB


@pytest.mark.parametrize("flags", [["--context-parallel-size", "2"], ["--optimizer", "muon", "--muon-lr", "0.02"]])
def test_start_up_estimate_equals_measurement_under_context_parallel_and_muon(tmp_path, flags):
    """ZeRO-2, 2 ranks: at context-parallel size 2 (dp 1; the state is partitioned over the data x context ranks)
    and with Muon at dp 2 (its matrices keep one momentum, Adam's rest two) the start-up estimate equals the
    engine's tensors after step 1 by kind (the buckets: a bound), and tools/estimate_memory.py prints the same
    numbers."""
    from tests.helpers import write_config
    config = write_config(str(tmp_path), zero_optimization={"stage": 2, "reduce_bucket_size": BUCKET,
                                                            "contiguous_gradients": True})
    _, out = run_distributed(_train_capturing, 2, args=(TINY + NO_DROPOUT + flags + [
        "--train-iters", "2", "--deepspeed", "--deepspeed_config", config],))[0]
    estimate, measured = _printed(out, "estimate"), _printed(out, "measured after step 1")
    for kind in memory.KINDS + ("total", "host"):
        assert estimate[kind] == measured[kind], (kind, estimate, measured)
    assert int(measured["buckets"]) <= int(estimate["buckets"])     # a bound (the peak seen vs the pool)
    tool_flags = ["--optimizer", "muon", "--data-parallel-size", "2"] if "muon" in flags else \
        ["--context-parallel-size", "2", "--data-parallel-size", "1"]
    tool = warm_python.run([sys.executable, "tools/estimate_memory.py", *TINY_SHAPE, *MOCK_VOCAB[1:], *tool_flags,
                            "--zero-stage", "2", "--reduce-bucket-size", str(BUCKET)],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0, tool.stderr
    assert _printed(tool.stdout, "estimate") == estimate
