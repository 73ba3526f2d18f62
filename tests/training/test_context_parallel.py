"""--context-parallel-size (mpu/context_parallel.py, megatron/data/context_parallel.py, pretrain_gpt.py's batch and
loss).

What is asserted (fp32, dropout off; the reference is the run at context-parallel size 1 in one process):
- model level, 5 SGD steps of tiny GPT-2 (learned positions) and tiny Llama (rotary, GQA 2 of 4 heads, SwiGLU,
  RMSNorm, untied head) at C = 4, C = 2 x dp 2 and C = 2 x TP 2 with sequence parallelism (gradients gathered to
  full size): every step's whole-sequence loss and every parameter's gradient after
  the data-parallel wrapper's reduction over data x context ranks equal C = 1 within 1e-6 (the largest difference
  over all gradients relative to the largest gradient). The sequence is
  16 tokens, so C = 4 has chunks of 2 and every chunk border matters: a token seeing its successor in the next
  chunk, a chunk's positions off by one, or the loss averaged per rank instead of over the sequence (the loss mask
  leaves out the first 5 tokens of one row, so the ranks count different numbers of tokens) all fail here.
- training level (pretrain_gpt.main, Adam, global batch 4 of micro-batches 2), 5 steps' losses equal the C = 1 run
  within 1e-6 relative: the Megatron path at C = 4, C = 2 x data parallel 2 (the loader's samples), C = 2 x TP 2
  with sequence parallelism, C = 2 x pipeline 2, C = 2 with full and with selective recomputation, tiny Llama at
  C = 2 x dp 2 and C = 4; the ZeRO engine (--deepspeed) at stages 0-3 with C = 2 x dp 2 against the ZeRO run at C = 1;
- a ZeRO-2 checkpoint written at C = 2 x dp 2 (after 3 steps) resumes at C = 1 and at C = 4, and a Megatron-path
  one at C = 1, and steps 4-5 equal the straight C = 1 run's (C holds no parameters: a topology change like dp);
- a --seq-length not divisible by 2C, attention dropout with C > 1, C > 1 for an entry point other than
  pretrain_gpt.py (they read whole sequences) and C > 1 with --num-experts are refused in one line naming the fix.
"""
import dataclasses
import os

import pytest
import torch

import mpu
from megatron.spawn import run_distributed
from tests.helpers import (gathered_model_parallel, max_relative_difference, NO_DROPOUT, parser_error, TINY,
                           train_each, write_config)

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB, STEPS, LR = 2, 32, 4, 16, 2, 64, 5, 0.5
TOLERANCE = 1e-6


# ---- model level: losses and gradients ----------------------------------------------------------------------------

def _config(llama, sequence_parallel=False):
    from megatron.model.gpt2_model import GPT2ModelConfig
    config = GPT2ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             max_sequence_length=SEQ, sequence_parallel=sequence_parallel)
    if llama:
        config = dataclasses.replace(config, num_key_value_heads=2, swiglu=True, ffn_hidden_size=48,
                                     normalization="rmsnorm", add_bias_linear=False,
                                     learned_position_embeddings=False, rotary=True,
                                     untie_embeddings_and_output_weights=True)
    return config


def _tokens(step):
    generator = torch.Generator().manual_seed(100 + step)          # the same batch on every rank
    text = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return text[:, :-1], text[:, 1:]


def _sgd_run(cp, llama, tp=1):
    """STEPS SGD steps at context-parallel size cp (x tensor parallel tp with sequence parallelism): each step's
    whole-sequence loss and reduced gradients (full size)."""
    from megatron.data.context_parallel import batch_on_this_context_parallel_rank, masked_token_mean
    from megatron.model.distributed import DistributedDataParallel
    from megatron.model.gpt2_model import GPT2Model
    mpu.initialize_model_parallel(tp, context_parallel_size=cp)
    mpu.model_parallel_cuda_manual_seed(1234)
    model = DistributedDataParallel(GPT2Model(_config(llama, sequence_parallel=tp > 1)))
    losses, grads = [], []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        tokens, labels = _tokens(step)
        mask = torch.ones(tokens.shape)
        mask[0, :5] = 0      # fewer loss tokens on some ranks: a per-rank mean is not the sequence's mean
        tokens, labels, mask = batch_on_this_context_parallel_rank(tokens, labels, mask)
        loss, whole = masked_token_mean(model(tokens, labels=labels), mask)
        loss.backward()
        model.allreduce_params(reduce_after=False)
        losses.append(float(whole.detach()))
        grads.append(_full_gradients(model.module))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    mpu.destroy_model_parallel()
    return losses, grads


def _full_gradients(module):
    """Every gradient at full size: gathered_model_parallel, and for a grouped-query q/k/v (rank r holds
    [q_r; k_r; v_r], split) the pieces' q, k and v blocks joined in turn."""
    import torch.distributed as dist
    full = gathered_model_parallel(_NotGrouped(module), grads=True)
    world = mpu.get_model_parallel_world_size()
    for name, param in module.named_parameters():
        if not isinstance(getattr(param, "partition_stride", None), mpu.GroupedQKVStride):
            continue
        if world == 1:
            full[name] = param.grad.clone()
        else:
            pieces = [torch.empty_like(param.grad) for _ in range(world)]
            dist.all_gather(pieces, param.grad.contiguous(), group=mpu.get_model_parallel_group())
            stride = param.partition_stride
            sizes = [stride.query_rows // world, stride.kv_rows // world, stride.kv_rows // world]
            blocks = [piece.split(sizes) for piece in pieces]
            full[name] = torch.cat([blocks[r][j] for j in range(3) for r in range(world)])
    return full


class _NotGrouped(torch.nn.Module):
    """named_parameters() of `model` without the grouped-query q/k/v weights (_full_gradients joins those)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def named_parameters(self, *args, **kwargs):
        return [(name, p) for name, p in self.model.named_parameters()
                if not isinstance(getattr(p, "partition_stride", None), mpu.GroupedQKVStride)]


def _sgd_runs(layouts, llama):
    return [_sgd_run(cp, llama, tp) for cp, tp in layouts]


LAYOUTS = [(4, 1), (2, 1), (2, 2)]     # (C, tp) in a world of 4: C 4; C 2 x dp 2; C 2 x tp 2 + sequence parallel


@pytest.fixture(scope="module")
def sgd_results():
    """{(model, C, tp, rank): (losses, grads)}: C = 1 from one process, LAYOUTS from one launch of 4."""
    results = {}
    for llama in (False, True):
        results[llama, 1, 1, 0] = run_distributed(_sgd_runs, 1, args=([(1, 1)], llama))[0][0]
        for rank, runs in enumerate(run_distributed(_sgd_runs, 4, args=(LAYOUTS, llama))):
            for (cp, tp), run in zip(LAYOUTS, runs):
                results[llama, cp, tp, rank] = run
    return results


@pytest.mark.parametrize("llama", [False, True], ids=["gpt2", "llama"])
@pytest.mark.parametrize("cp,tp", LAYOUTS, ids=["cp4", "cp2-dp2", "cp2-tp2-sp"])
def test_losses_and_gradients_equal_one_process(sgd_results, llama, cp, tp):
    ref_losses, ref_grads = sgd_results[llama, 1, 1, 0]
    for rank in range(4):
        losses, grads = sgd_results[llama, cp, tp, rank]
        assert max_relative_difference(losses, ref_losses) < TOLERANCE, (rank, losses, ref_losses)
        for step in range(STEPS):
            assert _gradient_difference(grads[step], ref_grads[step]) < TOLERANCE, (rank, step)


def _gradient_difference(grads, reference):
    """max |g - ref| over every parameter's gradient / max |ref| over them all (one step's gradient as one vector:
    a per-tensor ratio of a tensor of tiny gradients, like a LayerNorm bias's ~1e-5, reads fp32 summation order)."""
    assert set(grads) == set(reference)
    worst = max(float((grads[name].double() - ref.double()).abs().max()) for name, ref in reference.items())
    return worst / max(float(ref.abs().max()) for ref in reference.values())


# ---- training level: pretrain_gpt.main ------------------------------------------------------------------------

RUN = TINY + NO_DROPOUT + ["--train-iters", str(STEPS), "--lr-decay-iters", str(STEPS), "--batch-size", "2",
                           "--global-batch-size", "4"]
LLAMA = ["--swiglu", "--ffn-hidden-size", "48", "--num-key-value-heads", "2", "--use-rotary-position-embeddings",
         "--no-position-embedding", "--normalization", "rmsnorm", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


def _zero(directory, stage):
    path = write_config(os.path.join(directory), train_batch_size=4, gradient_accumulation_steps=None,
                        zero_optimization={"stage": stage, "reduce_bucket_size": 5000,
                                           "allgather_bucket_size": 5000})
    os.rename(path, os.path.join(directory, f"ds_stage{stage}.json"))
    return ["--deepspeed", "--deepspeed_config", os.path.join(directory, f"ds_stage{stage}.json")]


def _cp(size):
    return ["--context-parallel-size", str(size)]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """The names' loss histories: references at C = 1 from one process, the rest from one launch of 4."""
    directory = str(tmp_path_factory.mktemp("cp"))
    zero = {stage: _zero(directory, stage) for stage in (0, 1, 2, 3)}
    save = ["--save", os.path.join(directory, "ckpt"), "--train-iters", "3"]
    load = ["--load", os.path.join(directory, "ckpt")]
    megatron_save = ["--save", os.path.join(directory, "megatron"), "--train-iters", "3"]
    megatron_load = ["--load", os.path.join(directory, "megatron")]
    one = {"ref": RUN, "ref llama": RUN + LLAMA, "ref zero": RUN + zero[2],
           "zero2 cp2 saved, resumed at cp1": RUN + zero[2] + load,
           "megatron cp2 saved, resumed at cp1": RUN + megatron_load}
    four = {"cp4": RUN + _cp(4), "cp2 dp2": RUN + _cp(2),
            "cp2 tp2 sp": RUN + _cp(2) + ["--model-parallel-size", "2", "--sequence-parallel"],
            "cp2 pp2": RUN + _cp(2) + ["--pipeline-model-parallel-size", "2"],
            "cp2 full recompute": RUN + _cp(2) + ["--recompute-granularity", "full", "--recompute-method", "uniform"],
            "cp2 selective recompute": RUN + _cp(2) + ["--recompute-granularity", "selective"],
            "llama cp2 dp2": RUN + LLAMA + _cp(2), "llama cp4": RUN + LLAMA + _cp(4),
            **{f"zero{stage} cp2 dp2": RUN + zero[stage] + _cp(2) for stage in (0, 1, 3)},
            "zero2 cp2 dp2": RUN + zero[2] + _cp(2), "zero2 cp2 dp2, 3 steps saved": RUN + zero[2] + _cp(2) + save,
            "megatron cp2 dp2, 3 steps saved": RUN + _cp(2) + megatron_save}
    histories = dict(zip(four, run_distributed(train_each, 4, args=(list(four.values()),))[0]))
    histories.update(zip(one, run_distributed(train_each, 1, args=(list(one.values()),))[0]))
    histories["zero2 cp2 saved, resumed at cp4"] = run_distributed(train_each, 4, args=([RUN + zero[2] + load +
                                                                                          _cp(4)],))[0][0]
    return histories


@pytest.mark.parametrize("name,reference", [
    ("cp4", "ref"), ("cp2 dp2", "ref"), ("cp2 tp2 sp", "ref"), ("cp2 pp2", "ref"), ("cp2 full recompute", "ref"),
    ("cp2 selective recompute", "ref"), ("llama cp2 dp2", "ref llama"), ("llama cp4", "ref llama"),
    ("zero0 cp2 dp2", "ref zero"), ("zero1 cp2 dp2", "ref zero"), ("zero2 cp2 dp2", "ref zero"),
    ("zero3 cp2 dp2", "ref zero")])
def test_training_losses_equal_one_process(training, name, reference):
    losses, expected = training[name]["lm loss"], training[reference]["lm loss"]
    assert len(losses) == STEPS and max_relative_difference(losses, expected) < TOLERANCE, (losses, expected)


@pytest.mark.parametrize("name,reference", [("zero2 cp2 saved, resumed at cp1", "ref zero"),
                                            ("zero2 cp2 saved, resumed at cp4", "ref zero"),
                                            ("megatron cp2 saved, resumed at cp1", "ref")])
def test_checkpoint_at_cp2_resumes_at_other_sizes(training, name, reference):
    history, expected = training[name], training[reference]
    assert history["iteration"] == [4, 5]
    assert max_relative_difference(history["lm loss"], expected["lm loss"][3:]) < TOLERANCE


def test_bad_lengths_and_dropout_are_one_line(capsys, monkeypatch):
    from megatron.arguments import parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    line = parser_error(lambda argv: parse_args(args_list=argv),
                        TINY + NO_DROPOUT + ["--seq-length", "20", "--context-parallel-size", "4"], capsys)
    assert line.endswith("error: --seq-length (20) is not divisible by 2C = 8 (--context-parallel-size 4): each "
                         "rank holds 2 of the 2C chunks; use a multiple of 8 (see --help)")
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + _cp(2), capsys)
    assert line.endswith("error: --context-parallel-size 2 computes attention ring-style without dropout: pass "
                         "--attention-dropout 0 (see --help)")
    line = parser_error(lambda argv: parse_args(lambda parser: parser, args_list=argv), TINY + NO_DROPOUT + _cp(2),
                        capsys)     # an entry point with its own flags (post-training, evaluation, generation)
    assert "--context-parallel-size 2 is for pretrain_gpt.py: this entry point reads whole sequences" in line
    monkeypatch.setenv("WORLD_SIZE", "1")     # scripts/finetune_gpt.sh's one process: that refusal, not "world size"
    from megatron.posttrain.sft_driver import add_finetune_args
    line = parser_error(lambda argv: parse_args(add_finetune_args, args_list=argv), TINY + NO_DROPOUT + _cp(2),
                        capsys)
    assert "error: --context-parallel-size 2 is for pretrain_gpt.py: this entry point reads whole sequences" in line
    monkeypatch.setenv("WORLD_SIZE", "4")
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + NO_DROPOUT + _cp(2) + ["--num-experts", "2"],
                        capsys)
    assert "--context-parallel-size 2 cannot be combined with --num-experts yet: drop one of them" in line


def test_start_up_estimates_know_the_context_parallel_size():
    """operations.activation_estimate as training calls it at C = 4: the layers of s/C = 32 of 128 tokens with ring
    attention's fp32 output (a hand-computed per-layer count), and ZeRO-2's partitions over dp x C = 8 ranks."""
    import argparse
    from megatron import zero
    from megatron.guards import memory, operations
    args = argparse.Namespace(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                              pipeline_model_parallel_size=1, num_micro_batches=1, params_dtype="float32",
                              attention_dropout=0.0, hidden_dropout=0.0, num_layers=2, seq_length=128, batch_size=2,
                              hidden_size=64, num_attention_heads=4, model_parallel_size=1, sequence_parallel=False,
                              context_parallel_size=4, data_parallel_size=2)
    total, setting = operations.activation_estimate(args)
    s, b, h, a = 32, 2, 64, 4
    per_layer = s * b * h * 16 + 16 * s * b + s * b * h * 48 + 4 * (s * b * h + a * s * b)   # fp32, no dropout
    assert total == 2 * per_layer
    assert setting.endswith(", 32 of 128 tokens (context parallel)")
    args.zero_config = zero.load_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, 2)
    assert operations.model_state_estimate([1000, 24], args) == \
        memory.model_state_bytes([1000, 24], "float32", args.zero_config, 8)


def test_estimate_memory_tool_knows_the_context_parallel_size():
    """tools/estimate_memory.py --context-parallel-size 4: activations of s/C tokens with the ring layout, model
    states partitioned over dp x C, and a length not divisible by 2C refused."""
    import estimate_memory
    from megatron.guards import memory
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--vocab-size", "100", "--micro-batch-size", "2", "--zero-stage", "2", "--data-parallel-size", "2"]
    with_cp = estimate_memory.estimate(estimate_memory.build_parser().parse_args(flags + _cp(4)))
    wide = estimate_memory.estimate(estimate_memory.build_parser().parse_args(
        [f if f != "2" or flags[i - 1] != "--data-parallel-size" else "8" for i, f in enumerate(flags)]))
    layout = memory.ActivationLayout.for_run("cuda", 4, 0.1, 0.1, context_parallel_size=4)
    assert with_cp[3] == memory.activation_bytes(2, 32, 2, 64, 4, 1, None, layout)
    assert with_cp[2] == wide[2]                          # ZeRO-2 at dp 2 x C 4 partitions like dp 8
    with pytest.raises(SystemExit, match=r"--seq-length \(100\) is not divisible by 2C = 8 "
                                         r"\(--context-parallel-size 4\)"):
        estimate_memory.main(flags[:7] + ["100"] + flags[8:] + _cp(4))
