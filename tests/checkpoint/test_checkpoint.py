"""Megatron-path checkpoints resume exactly: N steps + save + fresh processes + load + N steps == 2N straight steps,
bitwise (losses, validation losses, loss scale, skipped steps, and the final checkpoint file itself), with dropout
on, at (mp 1, dp 2), (mp 2, dp 1) on real data, and in fp16 with overflow skips on both sides of the save. Also:
SIGKILL in the middle of a save leaves the previous checkpoint loaded; SIGTERM to one rank of two with
--exit-signal-handler makes both save the same iteration and return normally, and the resumed run continues exactly.

No tolerance anywhere: on one CPU the same ops in the same order give the same bits, so any difference is lost state.
"""
import os
import signal
import threading
import time

import pytest
import torch

from megatron.spawn import run_distributed

from tests.helpers import set_tracker, TINY_SHAPE


MODEL = TINY_SHAPE + ["--make-vocab-size-divisible-by", "8", "--batch-size", "2", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--log-interval", "100", "--train-iters", "6", "--eval-interval", "2",
         "--eval-iters", "1"]
MOCK = ["--mock-data", "--vocab-size", "64"]
N = 3  # the straight runs save at N (and at 2N, the end); resumed runs load iteration N
FP16 = ["--fp16", "--initial-loss-scale", "1048576", "--loss-scale-window", "2", "--hysteresis", "1"]


def _train(args_list):
    import pretrain_gpt
    return pretrain_gpt.main(args_list)


def _train_and_sigterm_rank_1(args_list):
    """Rank 1 sends itself SIGTERM as soon as the training loop's handler is installed (rank 0 gets no signal)."""
    if os.environ["RANK"] == "1":
        threading.Thread(target=_sigterm_once_handled, daemon=True).start()
    return _train(args_list)


def _sigterm_once_handled():
    from megatron.guards.exit_controller import ExitController
    while not isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), ExitController):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGTERM)


def _run(world_size, args_list, fn=_train):
    return run_distributed(fn, world_size, args=(args_list,))


def train_killed_in_save(args_list, iteration):
    """Train, but SIGKILL every rank during the save of `iteration`: after the files are written into the
    temporary directory, before it is renamed into place (rank 0 in publish_directory, the others where they
    would wait for it). The fault is injected here, from the test, not in the save path."""
    from megatron.checkpoint import atomic_io
    from megatron.checkpoint.layout import iteration_dir_name
    publish = atomic_io.publish_directory

    def publish_or_die(tmp_dir, final_dir):
        if os.path.basename(final_dir) == iteration_dir_name(iteration):
            os.kill(os.getpid(), signal.SIGKILL)
        publish(tmp_dir, final_dir)
    atomic_io.publish_directory = publish_or_die
    original_agree = atomic_io.agree_on_success

    def agree_or_die(error, what, *args, **kwargs):  # the other ranks die where rank 0 would have published
        if what.startswith("publishing") and what.endswith(iteration_dir_name(iteration)):
            os.kill(os.getpid(), signal.SIGKILL)
        return original_agree(error, what, *args, **kwargs)
    atomic_io.agree_on_success = agree_or_die
    return _train(args_list)


def _load(save_dir, iteration, mp_rank=0):
    return torch.load(os.path.join(save_dir, f"iter_{iteration:07d}", f"mp_rank_{mp_rank:02d}", "model_optim_rng.pt"),
                      weights_only=True)


def _assert_same(a, b, where="checkpoint"):
    """Bitwise equality of two nested checkpoint states."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _assert_continues(straight, resumed, first_iteration):
    """The resumed histories equal the straight run's from `first_iteration` on (every rank)."""
    start = first_iteration - 1
    for rank, (s, r) in enumerate(zip(straight, resumed)):
        assert r["iteration"] == s["iteration"][start:], f"rank {rank}: resumed at the wrong iteration"
        for key in ("lm loss", "loss scale", "skipped", "lr"):
            assert r[key] == s[key][start:], f"rank {rank}: {key} differs after resuming"
        evals = sum(1 for it in s["iteration"][:start] if it % 2 == 0)  # --eval-interval 2
        assert r["valid"] == s["valid"][evals:], f"rank {rank}: validation losses differ after resuming"
        assert r["final_valid"] == s["final_valid"]


def _straight_and_resumed(tmp_path, world_size, extra, mp_ranks=(0,)):
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    straight = _run(world_size, MODEL + extra + ["--save", straight_dir, "--save-interval", str(N)])
    set_tracker(straight_dir, N)  # load the mid-run checkpoint, not the final one
    resumed = _run(world_size, MODEL + extra + ["--load", straight_dir, "--save", resumed_dir])
    _assert_continues(straight, resumed, N + 1)
    for mp_rank in mp_ranks:
        _assert_same(_load(straight_dir, 2 * N, mp_rank), _load(resumed_dir, 2 * N, mp_rank))
    return straight, resumed


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2N straight steps at (mp 1, dp 2), fp32, mock data, checkpoints at N and 2N."""
    save_dir = str(tmp_path_factory.mktemp("reference"))
    return save_dir, _run(2, MODEL + MOCK + ["--save", save_dir, "--save-interval", str(N)])


def test_resume_is_exact_mp1_dp2(reference, tmp_path):
    reference_dir, straight = reference
    resumed_dir = str(tmp_path / "resumed")
    set_tracker(reference_dir, N)
    resumed = _run(2, MODEL + MOCK + ["--load", reference_dir, "--save", resumed_dir])
    _assert_continues(straight, resumed, N + 1)
    _assert_same(_load(reference_dir, 2 * N), _load(resumed_dir, 2 * N))


def test_resume_is_exact_mp2_dp1_real_data(tmp_path, webtext_data):
    real = ["--data-path", os.path.join(webtext_data, "webtext_text_document"), "--vocab-file",
            os.path.join(webtext_data, "vocab.json"), "--merge-file", os.path.join(webtext_data, "merges.txt"),
            "--data-cache-path", str(tmp_path / "cache"), "--model-parallel-size", "2"]
    _straight_and_resumed(tmp_path, 2, real, mp_ranks=(0, 1))


LLAMA = ["--swiglu", "--ffn-hidden-size", "48", "--num-key-value-heads", "1", "--use-rotary-position-embeddings",
         "--no-position-embedding", "--normalization", "rmsnorm", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


def _train_then_load_as_gpt2(args_list, gpt2_args_list):
    """Train (resumed), then set up a GPT-2-shaped model loading the same checkpoint: (history, the error)."""
    import mpu
    import pretrain_gpt
    from megatron.checkpoint.layout import CheckpointError
    from megatron.initialize import initialize_megatron
    from megatron.training import setup_model_and_optimizer
    history = _train(args_list)
    mpu.destroy_model_parallel()
    initialize_megatron(args_list=gpt2_args_list)
    try:
        setup_model_and_optimizer(pretrain_gpt.model_provider)
    except CheckpointError as error:
        return history, str(error)
    return history, None


def test_resume_is_exact_llama_mp2_and_refused_as_gpt2(tmp_path):
    """The Llama options (one key/value head, replicated on both model-parallel ranks; dropout on, clipping active)
    at mp 2: N steps + save + fresh processes + load + N steps == 2N straight steps, bitwise; the same processes
    then refuse to load the checkpoint into a GPT-2-shaped model, in one line naming every differing option."""
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    llama = MODEL + MOCK + LLAMA + ["--model-parallel-size", "2", "--clip-grad", "0.05"]
    straight = _run(2, llama + ["--save", straight_dir, "--save-interval", str(N)])
    set_tracker(straight_dir, N)
    gpt2 = MODEL + MOCK + ["--model-parallel-size", "2", "--load", straight_dir]
    results = run_distributed(_train_then_load_as_gpt2, 2, args=(llama + ["--load", straight_dir, "--save",
                                                                          resumed_dir], gpt2))
    _assert_continues(straight, [history for history, _ in results], N + 1)
    for mp_rank in (0, 1):
        _assert_same(_load(straight_dir, 2 * N, mp_rank), _load(resumed_dir, 2 * N, mp_rank))
    for _, message in results:
        assert message is not None and "\n" not in message, message
        assert "was saved by another model shape: num_key_value_heads 1 (checkpoint) != None (this run); " \
            "ffn_hidden_size 48 (checkpoint) != None (this run); swiglu True (checkpoint) != False" in message, message
        assert message.endswith("untie_embeddings_and_output_weights True (checkpoint) != False (this run)"), message


def test_resume_is_exact_fp16_with_skips(tmp_path):
    straight, _ = _straight_and_resumed(tmp_path, 2, MOCK + FP16)
    skipped, scales = straight[0]["skipped"], straight[0]["loss scale"]
    assert any(skipped[:N]) and any(skipped[N:]), f"want overflow skips on both sides of the save: {skipped}"
    assert len(set(scales[N:])) > 1, f"want the loss scale to change after the save: {scales}"
    assert scales[N - 1] != 1048576, f"want a saved loss scale unlike a fresh run's: {scales}"
    assert _load(str(tmp_path / "resumed"), 2 * N)["skipped_iterations"] == sum(skipped)


def test_sigkill_during_save_leaves_previous_checkpoint(reference, tmp_path, monkeypatch):
    reference_dir, straight = reference
    save_dir = str(tmp_path / "run")
    args = MODEL + MOCK + ["--save", save_dir, "--save-interval", "1", "--save-keep-last", "2"]
    with pytest.raises(RuntimeError, match="exited with code -9|failed"):
        run_distributed(train_killed_in_save, 2, args=(args, N + 1))
    assert open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read() == str(N)
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000003", "iter_0000004.tmp",
                                            "latest_checkpointed_iteration.txt"]
    assert os.path.isfile(os.path.join(save_dir, "iter_0000004.tmp", "mp_rank_00", "model_optim_rng.pt"))

    resumed = _run(2, args + ["--load", save_dir])
    _assert_continues(straight, resumed, N + 1)
    assert sorted(os.listdir(save_dir)) == ["iter_0000005", "iter_0000006", "latest_checkpointed_iteration.txt"]
    _assert_same(_load(reference_dir, 2 * N), _load(save_dir, 2 * N))


def test_sigterm_to_one_rank_saves_same_iteration_and_resumes(reference, tmp_path):
    _, straight = reference
    save_dir = str(tmp_path / "run")
    args = MODEL + MOCK + ["--save", save_dir, "--exit-signal-handler"]
    stopped = _run(2, args, fn=_train_and_sigterm_rank_1)
    exit_iteration = stopped[0]["iteration"][-1]
    for rank, history in enumerate(stopped):
        assert history.get("exit_reason") == "SIGTERM (--exit-signal-handler)", f"rank {rank} did not stop on it"
        assert history["iteration"][-1] == history["last_saved_iteration"] == exit_iteration
    assert exit_iteration < 2 * N, "the signal came too late to test resuming"
    assert open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read() == str(exit_iteration)

    resumed = _run(2, MODEL + MOCK + ["--load", save_dir])
    _assert_continues(straight, resumed, exit_iteration + 1)
