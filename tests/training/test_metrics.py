"""--log-jsonl: one JSON object per log interval with every field of the log line, the phase timers and memory,
on the Megatron path and under --deepspeed; TensorBoard gets the same scalars when it is installed."""
import json
import re

import pytest

from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, TINY, train, train_each

KEYS = {"type", "iteration", "train_iters", "consumed_samples", "learning_rate", "losses", "loss_scale", "grad_norm",
        "skipped_iterations", "ms_per_iteration", "tokens_per_second", "tflops_per_rank", "timers_ms", "memory"}
ITERS, INTERVAL = 6, 2
LOG = ["--train-iters", str(ITERS), "--log-interval", str(INTERVAL)]


def _train_capturing(args_list):
    """(history, what this rank printed): the forkserver's workers write to the first test's captured stdout,
    so each worker captures its own."""
    import contextlib
    import io
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        history = train(args_list)
    return history, buffer.getvalue()


def _records(path):
    """The training records (the header and validation records are tests/training/test_plot_run.py's)."""
    with open(path) as handle:
        return [record for record in map(json.loads, handle) if record["type"] == "train"]


def _printed_losses(text):
    return [m.group(1) for m in re.finditer(r" iteration +\d+/ *\d+ \|.*? \| lm loss: (\S+) \|", text)]


def _check(records, history, printed, world_size, megatron_path, timed):
    """`timed`: --timing-log-level 1 (phase timers); otherwise level 0, the default: no phase times at all."""
    assert [r["iteration"] for r in records] == list(range(INTERVAL, ITERS + 1, INTERVAL))
    for index, record in enumerate(records):
        assert set(record) == KEYS, set(record) ^ KEYS
        losses = history["lm loss"][index * INTERVAL:(index + 1) * INTERVAL]
        assert record["losses"]["lm loss"] == sum(losses) / INTERVAL       # the same float the log line averages
        assert f"{record['losses']['lm loss']:.6E}" == printed[index]       # exactly what the log line printed
        assert record["consumed_samples"] == record["iteration"] * 4
        assert record["learning_rate"] == history["lr"][(index + 1) * INTERVAL - 1]
        assert record["grad_norm"] == history["grad norm"][(index + 1) * INTERVAL - 1]
        assert record["loss_scale"] == 1.0 and record["skipped_iterations"] == 0
        assert record["ms_per_iteration"] > 0 and record["tokens_per_second"] > 0 and record["tflops_per_rank"] > 0
        # matmul FLOPs per token, counted by hand for TINY (L 2, h 32, s 16, V 64): per layer qkv 2*3h*h,
        # projection 2*h*h, MLP 2*2*4h*h, attention 2*2*s*h, the head 2*h*V; forward + backward = 3 forwards
        L, h, s, V = 2, 32, 16, 64
        per_token = 3 * (L * (2 * 3 * h * h + 2 * h * h + 2 * 2 * 4 * h * h + 2 * 2 * s * h) + 2 * h * V)
        measured = record["tflops_per_rank"] * 1e12 * world_size / record["tokens_per_second"]
        assert abs(measured - per_token) <= 1e-6 * per_token, (measured, per_token)
        assert record["memory"]["kind"] == "cpu_rss" and record["memory"]["bytes"] > 10 * 2 ** 20
        timers = record["timers_ms"]
        assert set(timers) == {"forward", "backward", "allreduce", "optimizer", "batch-generator"}
        if not timed:
            assert set(timers.values()) == {None}
            continue
        assert timers["forward"] > 0 and timers["backward"] > 0 and timers["optimizer"] > 0
        assert 0 < timers["batch-generator"] < timers["forward"]    # the data wait, inside the forward phase
        if megatron_path:
            assert timers["allreduce"] is not None and timers["allreduce"] >= 0
        else:
            assert timers["allreduce"] is None            # inside the engine's backward
        # per iteration, not accumulated over the run (that would reach ~3x by the third record); 2x leaves room
        # for the timers' and the interval clock's different start points on a loaded machine (1.58x seen)
        assert sum(t for t in timers.values() if t) < record["ms_per_iteration"] * 2.0
    assert len(printed) == len(records)


def test_jsonl_megatron_path(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("")                                    # appended to, not truncated
    history, out = run_distributed(_train_capturing, 2, args=(TINY + NO_DROPOUT + LOG + [
        "--batch-size", "2", "--log-jsonl", str(path), "--timing-log-level", "1"],))[0]
    _check(_records(path), history, _printed_losses(out), 2, megatron_path=True, timed=True)
    assert out.count("time (ms) | forward: ") == ITERS // INTERVAL


def test_jsonl_deepspeed_path(tmp_path):
    from tests.helpers import write_config
    config = write_config(str(tmp_path))
    path = tmp_path / "log.jsonl"
    history, out = run_distributed(_train_capturing, 2, args=(TINY + NO_DROPOUT + LOG + [
        "--deepspeed", "--deepspeed_config", config, "--log-jsonl", str(path)],))[0]
    _check(_records(path), history, _printed_losses(out), 2, megatron_path=False, timed=False)
    assert "time (ms)" not in out                          # level 0: no phase timer line


def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed in the test environment")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    path = tmp_path / "log.jsonl"
    run_distributed(train, 1, args=(TINY + NO_DROPOUT + LOG + ["--log-jsonl", str(path),
                                                                "--tensorboard-dir", str(tmp_path / "tb"),
                                                                "--timing-log-level", "1"],))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    records = _records(path)
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx([r["losses"]["lm loss"] for r in records])
    assert {"learning_rate", "loss_scale", "grad_norm", "tokens_per_second", "forward_ms"} <= set(events.Tags()["scalars"])


def test_the_last_iteration_is_logged_whatever_the_interval(tmp_path):
    """--train-iters 7 --log-interval 5: records at 5 and 7, the second the mean of iterations 6 and 7 alone; an
    early exit (--exit-interval 3, interval 5) logs its iteration 3 too, and a --train-iters 4 run (below the
    interval; make rlhf's TRAIN_ITERS=4) its 4; each --log-jsonl in a folder that did not exist (created)."""
    runs = {"7": ["--train-iters", "7"], "exit": ["--train-iters", "7", "--exit-interval", "3"],
            "4": ["--train-iters", "4"]}
    logs = {name: tmp_path / "new" / name / "log.jsonl" for name in runs}
    histories = run_distributed(train_each, 1, args=([TINY + NO_DROPOUT + flags + [
        "--log-interval", "5", "--log-jsonl", str(logs[name])] for name, flags in runs.items()],))[0]
    for (name, ends), history in zip({"7": [5, 7], "exit": [3], "4": [4]}.items(), histories):
        records = _records(logs[name])
        assert [r["iteration"] for r in records] == ends, name
        starts = [0] + ends[:-1]
        for record, start, end in zip(records, starts, ends):
            losses = history["lm loss"][start:end]
            assert record["losses"]["lm loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-12), name
    import plot_run      # the plot reads them: a run shorter than one interval has its training record
    assert plot_run.read_run(str(logs["4"]), "4")


def test_an_unwritable_log_jsonl_is_one_line(tmp_path):
    from megatron.cli import UserError
    from megatron.guards.operations import write_jsonl_record
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "log.jsonl"        # its folder is a file
    with pytest.raises(UserError) as error:
        write_jsonl_record(str(path), {"type": "header"})
    assert str(error.value) == (f"--log-jsonl {path}: cannot write it ({tmp_path / 'file'} is a file, not a "
                                "folder); choose another file")


@pytest.mark.parametrize("train_iters, logged", [(4, [(4, 0.625)]), (7, [(5, 0.5), (7, 0.25)])])
def test_the_rlhf_loop_logs_its_last_iteration(monkeypatch, train_iters, logged):
    """train_rlhf.py's interval log at --log-interval 5 (scripts/rlhf.sh's LOG_INTERVAL): TRAIN_ITERS=4 logs
    iteration 4, 7 iterations log 5 and 7, each the mean of its own iterations' rewards (hand-computed)."""
    from types import SimpleNamespace
    from megatron import training
    from megatron.posttrain.rlhf_driver import IntervalLog
    lines = []
    monkeypatch.setattr(training, "training_log", lambda means, state, *rest: lines.append(
        (state.iteration, means["reward"])) or {})
    log = IntervalLog(SimpleNamespace(log_interval=5, train_iters=train_iters, log_jsonl=None, rank=0))
    state, optimizer = SimpleNamespace(iteration=0), SimpleNamespace(param_groups=[{"lr": 0.1}])
    for reward in [0.5, 0.25, 1.0, 0.75, 0.0, 0.125, 0.375][:train_iters]:
        state.iteration += 1
        log.add({"reward": reward}, state, optimizer, None)
    assert lines == logged
