"""The fused compute path (--torch-compile, mpu/fused.py): the same training as eager with dropout on (each step's
loss within 1e-6 relative), GPT-2 and the Llama options, under model parallelism (Megatron path) and data parallelism
at ZeRO 0-3, with activation checkpointing; the fused loss equals the eager loss and its gradient."""
import json

import pytest
import torch

from megatron.spawn import run_distributed
from tests.helpers import TINY, train_each

ITERS_20 = ["--train-iters", "20"]
MICRO_2 = ["--batch-size", "2", "--global-batch-size", "4"]     # one process: 2 micro-batches of 2 per step
MP2 = ["--batch-size", "4", "--model-parallel-size", "2"]
PP2_INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
                   "1", "--batch-size", "2", "--global-batch-size", "8"]
CROSS_ENTROPY_DTYPES = (torch.float32, torch.bfloat16)
# scripts/pretrain_llama.sh's options: grouped-query attention (2 key/value heads of 4), rotary, SwiGLU, RMSNorm,
# no biases, an untied head
LLAMA = ["--swiglu", "--ffn-hidden-size", "48", "--num-key-value-heads", "2", "--use-rotary-position-embeddings",
         "--no-position-embedding", "--normalization", "rmsnorm", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
LLAMA_ONE_KV_HEAD = [flag if flag != "2" else "1" for flag in LLAMA]     # at mp2: the key/value head replicated
ZERO3 = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
STAGES = (0, 1, 2, 3)
TOLERANCE = 1e-6     # relative, of each step's loss (measured: at most 2.4e-7, mp2 Llama)
# inductor compiling from nothing on 2 busy cores: the 2-process launch has taken ~300 s of a loaded clean-clone run
LAUNCH_TIMEOUT = 900


def _launch(world_size, runs):
    """{name: lm losses} of the named runs (extra flags over TINY), one after the other in one launch of
    `world_size` processes: the compiled graphs are built once and reused, as a long run reuses them."""
    names = list(runs)
    histories = run_distributed(train_each, world_size, args=([TINY + runs[name] for name in names],),
                                timeout=LAUNCH_TIMEOUT)[0]
    return {name: history["lm loss"] for name, history in zip(names, histories)}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    """Three sets of compiled pieces (dropout 0.1 throughout): mp1 at micro-batch 2 (the single process, then the
    ZeRO-3 ranks: the same graphs, from inductor's cache), mp2 at micro-batch 4 with gradients, and mp2 without
    (checkpointing's first forward)."""
    configs = {}
    for stage in STAGES:
        configs[stage] = tmp_path_factory.mktemp(f"zero{stage}") / "ds_config.json"
        zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
        configs[stage].write_text(json.dumps({**ZERO3, "zero_optimization": zero}))
    single = _launch(1, {"eager_20": ITERS_20 + MICRO_2, "fused_20": ITERS_20 + MICRO_2 + ["--torch-compile"],
                         "llama_eager_20": ITERS_20 + MICRO_2 + LLAMA,
                         "llama_fused_20": ITERS_20 + MICRO_2 + LLAMA + ["--torch-compile"]})
    runs = {"mp2_dropout_eager": MP2, "mp2_dropout_fused": MP2 + ["--torch-compile"],
            "mp2_dropout_fused_checkpointed": MP2 + ["--torch-compile", "--checkpoint-activations"],
            "mp2_llama_eager": MP2 + LLAMA, "mp2_llama_fused": MP2 + LLAMA + ["--torch-compile"],
            "mp2_llama_one_kv_head_eager": MP2 + LLAMA_ONE_KV_HEAD,
            "mp2_llama_one_kv_head_fused": MP2 + LLAMA_ONE_KV_HEAD + ["--torch-compile"]}
    runs["pp2_interleaved_eager"] = PP2_INTERLEAVED
    runs["pp2_interleaved_fused"] = PP2_INTERLEAVED + ["--torch-compile"]
    for stage, config in configs.items():
        zero = ["--batch-size", "2", "--deepspeed", "--deepspeed_config", str(config)]
        runs[f"dp2_zero{stage}_eager"], runs[f"dp2_zero{stage}_fused"] = zero, zero + ["--torch-compile"]
    lock = tmp_path_factory.mktemp("compile") / "lock"
    ranks = run_distributed(_parallel_runs, 2, args=([TINY + flags for flags in runs.values()], CROSS_ENTROPY_DTYPES,
                                                     str(lock)), timeout=LAUNCH_TIMEOUT)
    histories, cross_entropy, _ = ranks[0]
    parallel = {name: history["lm loss"] for name, history in zip(runs, histories)}
    return {**single, **parallel, "cross_entropy": cross_entropy, "padded": [rank[2] for rank in ranks]}


def _one_rank_at_a_time(lock_path):
    """Each compiled piece called under a file lock, its backward too (AOTAutograd compiles that at the first
    backward): a graph new to both ranks compiles on one while the other waits, then comes from inductor's caches
    on the other (no collective runs inside a piece or its backward)."""
    import fcntl
    compile_ = torch.compile
    lock = open(lock_path, "a")

    def acquire(*_):
        fcntl.flock(lock, fcntl.LOCK_EX)

    def release(*_):
        fcntl.flock(lock, fcntl.LOCK_UN)

    def serialized(fn, **options):
        built = compile_(fn, **options)

        def run(*args):
            acquire()
            try:
                out = built(*args)
            finally:
                release()
            node = next((t.grad_fn for t in (out if isinstance(out, tuple) else (out,))
                         if torch.is_tensor(t) and t.grad_fn is not None), None)
            if node is not None:      # the compiled backward runs between the node's pre-hook and hook
                node.register_prehook(acquire)
                node.register_hook(release)
            return out
        return run
    torch.compile = serialized


def _parallel_runs(argv_lists, dtypes, lock_path):
    """The 2-process runs and the loss checks in one launch (one start of the compiler per process)."""
    import mpu
    _one_rank_at_a_time(lock_path)
    from tests.model.test_vocab_padding import REAL_VOCABS, _padded_losses
    histories = train_each(argv_lists)
    cross_entropy = _fused_and_eager_losses(dtypes)
    padded = _padded_losses(REAL_VOCABS, fused=True)
    mpu.destroy_model_parallel()
    return histories, cross_entropy, padded


def _max_relative_difference(a, b):
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_fused_equals_eager_over_20_steps_with_dropout(losses, model):
    """Dropout on (0.1), 2 micro-batches a step: the compiled pieces draw aten's masks from the same generator states
    as eager. Llama: grouped-query attention with rotary tables, SwiGLU, RMSNorm, no biases."""
    prefix = "" if model == "gpt2" else "llama_"
    eager, fused = losses[f"{prefix}eager_20"], losses[f"{prefix}fused_20"]
    assert len(fused) == 20 and fused[-1] < fused[0]
    assert _max_relative_difference(fused, eager) <= TOLERANCE, (fused, eager)


@pytest.mark.parametrize("path", ["mp2_dropout", "mp2_llama", "mp2_llama_one_kv_head", "pp2_interleaved"] +
                         [f"dp2_zero{stage}" for stage in STAGES],
                         ids=["mp2-megatron", "mp2-llama", "mp2-llama-replicated-kv-head", "pp2-interleaved"] +
                         [f"dp2-zero{stage}" for stage in STAGES])
def test_fused_parallel_equals_eager_parallel_with_dropout(losses, path):
    """The Megatron path at mp2: the attention dropout stays under the model-parallel RNG fork and each row-parallel
    bias is added once, after the all-reduce. The ZeRO path at stages 0-3 (stage 3: every layer's weights gathered
    around its compiled pieces and released after, no persistent parameters). Eager parallel equals the eager single process
    in tests/training/test_training.py and tests/zero/."""
    eager, fused = losses[f"{path}_eager"], losses[f"{path}_fused"]
    assert eager[0] != eager[-1]
    assert _max_relative_difference(fused, eager) <= TOLERANCE, (fused, eager)


def test_activation_checkpointing_stays_bitwise_with_the_fused_path(losses):
    """mp2, dropout 0.1 on attention and hidden states: recomputing the compiled pieces replays the default and
    the model-parallel RNG streams, so the losses are bitwise those without checkpointing."""
    plain, checkpointed = losses["mp2_dropout_fused"], losses["mp2_dropout_fused_checkpointed"]
    assert plain[0] != plain[-1]
    assert checkpointed == plain


def _fused_and_eager_losses(dtypes):
    """{dtype: ({fused: (loss, logits grad)}, torch's loss, torch's logits grad)} on this rank (mp2)."""
    import mpu
    mpu.initialize_model_parallel(2)
    rank, world = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    out = {}
    for dtype in dtypes:
        generator = torch.Generator().manual_seed(3)
        full = (torch.randn(3, 5, 24, generator=generator) * 4).to(dtype)   # [b, s, V], V split over the ranks
        target = torch.randint(0, 24, (3, 5), generator=generator)
        grad_output = torch.rand(3, 5, generator=generator)
        mine = full.chunk(world, dim=-1)[rank]
        results = {}
        for fused in (False, True):
            leaf = mine.clone().requires_grad_()
            logits = leaf * 1     # a non-leaf: the fused backward overwrites the logits it saved
            loss = mpu.vocab_parallel_cross_entropy(logits, target, fused=fused)
            assert torch.equal(leaf.detach(), mine), "the forward must not modify the logits"
            loss.backward(grad_output)
            results[fused] = loss.detach(), leaf.grad
        # An independent reference: torch's cross entropy over the whole vocabulary, in fp32.
        whole = full.float().requires_grad_()
        expected = torch.nn.functional.cross_entropy(whole.view(-1, 24), target.view(-1), reduction="none")
        expected.view(3, 5).backward(grad_output)
        out[dtype] = results, expected.detach().view(3, 5), whole.grad.chunk(world, dim=-1)[rank]
    return out


def test_fused_vocab_parallel_cross_entropy_equals_eager_and_torch(losses):
    """At mp2 (targets on both ranks' vocabulary slices), fp32 and bf16: loss and gradient equal the eager
    function's and torch.nn.functional.cross_entropy's."""
    by_dtype = losses["cross_entropy"]
    for dtype in CROSS_ENTROPY_DTYPES:
        results, expected, expected_grad = by_dtype[dtype]
        (eager_loss, eager_grad), (fused_loss, fused_grad) = results[False], results[True]
        assert fused_grad.dtype == dtype
        torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_grad, eager_grad)          # dtype-aware defaults (bf16: 1.6e-2 relative)
        tolerance = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(fused_loss, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(fused_grad.float(), expected_grad, rtol=tolerance, atol=tolerance)


def test_fused_loss_leaves_the_padded_vocabulary_out(losses):
    """tests/model/test_vocab_padding.py's cases on the fused loss at mp2: V = 37 and V = 20 padded to 48, padded
    logits random or +50: torch's loss and gradient over the first V logits, exactly 0 on the padding."""
    from tests.model.test_vocab_padding import assert_padded_losses
    assert len(losses["padded"]) == 2
    assert_padded_losses(losses["padded"])
