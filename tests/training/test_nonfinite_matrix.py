"""One NaN element in one parameter's gradient at iteration 3, on every path (Megatron's optimizer, ZeRO stages
0-3 under --deepspeed), precision (fp32, bf16, fp16) and layout (data-parallel 2; model-parallel 2; pipeline 2).

fp32/bf16 stop at iteration 3 naming that parameter, with a non-finite gradient norm in the message (not a sentinel
such as -1, which passes isfinite), before the step is applied and before iteration 3 is saved: the tracker names
iteration 2, whose files hold only finite tensors. With --skip-nonfinite-steps they skip iteration 3 instead (its
weights equal iteration 2's). fp16: the loss scaler skips the overflow step (weights unchanged) and halves the scale.

The poisoned parameter is not the first in named_parameters order (a wrong name shows), and only one element of one
rank's gradient is NaN (a check with .all() instead of .any() misses it). Every case of one layout runs in one
2-process spawn, one pretrain() after another."""
import contextlib
import io
import math
import os
import re

import pytest
import torch

from megatron.spawn import run_distributed
from megatron.checkpoint.layout import LATEST_FILE, MODEL, MODULE, TRACKER_FILENAME
from tests.helpers import NO_DROPOUT, TINY, write_config

POISONED = "transformer.layers.1.mlp.dense_4h_to_h.weight"   # on the last stage under pipelining
BAD_ITERATION, BAD_ELEMENT = 3, 37
LOSS_SCALE = 1024.0                                         # fp16: low enough that no clean step overflows
PATHS = ("megatron", "zero0", "zero1", "zero2", "zero3")
PRECISIONS = ("fp32", "bf16", "fp16")
LAYOUTS = {"dp2": [], "mp2": ["--model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}
POISONED_RANK = 1     # dp2: the second data-parallel rank; mp2: the second shard; pp2: the last stage


def _flags(path, precision, mode, directory):
    """The command line of one case; checkpoints after every iteration into directory/checkpoints."""
    flags = TINY + NO_DROPOUT + ["--lr-decay-style", "constant", "--warmup", "0", "--batch-size", "2",
                                 "--train-iters", str(BAD_ITERATION + (1 if mode == "stop" else 0)),
                                 "--save", os.path.join(directory, "checkpoints"), "--save-interval", "1"]
    flags += ["--skip-nonfinite-steps"] if mode == "skip" else []
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "hysteresis": 1}
    if path == "megatron":
        return flags + {"fp32": [], "bf16": ["--bf16"],
                        "fp16": ["--fp16", "--initial-loss-scale", str(LOSS_SCALE), "--hysteresis", "1"]}[precision]
    precision_block = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": fp16}}[precision]
    config = write_config(directory, zero_optimization={"stage": int(path[-1])}, **precision_block)
    return flags + ["--deepspeed", "--deepspeed_config", config]


def _poisoning_provider(poison_rank):
    import pretrain_gpt

    def provider():
        model = pretrain_gpt.model_provider()
        param = dict(model.named_parameters()).get(POISONED)
        if param is not None and torch.distributed.get_rank() == poison_rank:
            backwards = [0]   # one micro-batch per iteration: the hook's n-th call is iteration n's backward

            def hook(grad):
                backwards[0] += 1
                if backwards[0] != BAD_ITERATION:
                    return grad
                grad = grad.clone()
                grad.view(-1)[BAD_ELEMENT] = float("nan")
                return grad
            param.register_hook(hook)
        return model
    return provider


def _run_cases(cases):
    """Each (flags, poison_rank) in turn in this process: its NonFiniteError's text or None, the history's skipped
    flags, loss scales and gradient norms, and the 'skipped step' lines it printed."""
    import pretrain_gpt
    from megatron import training
    from megatron.guards.operations import NonFiniteError
    results = []
    for flags, poison_rank in cases:
        printed, error, history = io.StringIO(), None, {}
        try:
            with contextlib.redirect_stdout(printed):
                history = training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                                            _poisoning_provider(poison_rank), pretrain_gpt.forward_step,
                                            args_list=flags)
        except NonFiniteError as stop:
            error = str(stop)
        results.append({"error": error, "skipped": history.get("skipped"), "loss scale": history.get("loss scale"),
                        "grad norm": history.get("grad norm"),
                        "skip lines": [line for line in printed.getvalue().splitlines() if "skipped step:" in line]})
    return results


def _tensors(value, where=""):
    if torch.is_tensor(value):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{where}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{where}/{index}")


def _checkpoint_files(save, iteration):
    """Every file of the checkpoint, loaded as a user would (weights_only; a stage-3 optimizer file holds the
    stand-in of DeepSpeed's loss scaler, allowed by SAFE_GLOBALS)."""
    from megatron.checkpoint.deepspeed_classes import SAFE_GLOBALS
    directory = os.path.join(save, f"iter_{iteration:07d}")
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        return {os.path.relpath(os.path.join(root, name), directory): torch.load(os.path.join(root, name),
                                                                                  weights_only=True)
                for root, _, names in os.walk(directory) for name in names if name.endswith(".pt")}


def _tracker_checkpoint(save):
    """(the tracker's iteration, its files {relative path: loaded}); asserts every tensor in them is finite."""
    with open(os.path.join(save, TRACKER_FILENAME)) as handle:
        iteration = int(handle.read().strip())
    if os.path.exists(os.path.join(save, LATEST_FILE)):   # the ZeRO engine's own tracker agrees
        with open(os.path.join(save, LATEST_FILE)) as handle:
            assert handle.read().strip() == f"iter_{iteration:07d}"
    files = _checkpoint_files(save, iteration)
    assert files, f"no checkpoint files for iteration {iteration} in {save}"
    bad = [f"{path}{where}" for path, loaded in files.items() for where, tensor in _tensors(loaded)
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    assert not bad, f"the tracker's checkpoint (iteration {iteration}) holds non-finite tensors: {bad}"
    return iteration, files


def _weights(files):
    """{file/parameter name: tensor} of the model weights in one checkpoint (either layout)."""
    return {f"{path}/{name}": tensor for path, loaded in files.items() for key in (MODEL, MODULE)
            if key in loaded for name, tensor in loaded[key].items()}


def _cases(layout):
    paths = PATHS if layout != "pp2" else ("megatron", "zero0", "zero1")   # ZeRO 2/3 refuse pipelining
    modes = ["stop", "skip"] if layout == "dp2" else ["stop"]
    return [(path, precision, mode) for path in paths for precision in PRECISIONS
            for mode in (modes if precision != "fp16" else ["fp16"])]


def _naming_rank(layout, path):
    """The rank whose name the message carries (the lowest rank holding the bad element): on the Megatron path and
    ZeRO 0 at dp2 every data-parallel rank holds the reduced NaN, so rank 0; ZeRO 1-3 partition it to its owner
    (layer 1 lies in the second half of the flat buffer: rank 1); mp2 and pp2: the poisoned shard or stage."""
    return 0 if layout == "dp2" and path in ("megatron", "zero0") else POISONED_RANK


def _check_stop(result, other, save, rank):
    error = result["error"]
    assert error is not None, f"the run did not stop (skipped {result['skipped']})"
    assert other["error"] == error, f"the ranks disagree: {error!r} / {other['error']!r}"
    assert error.startswith(f"non-finite values at iteration {BAD_ITERATION}:"), error
    norm = re.search(r", grad norm=(\S+); ", error)
    assert norm and norm.group(1) in ("nan", "inf"), error     # the real norm, not a finite stand-in such as -1
    named = re.search(r"first non-finite gradient: (\S+) \(rank (\d)\);", error)
    assert named and named.group(1) == POISONED and int(named.group(2)) == rank, error
    assert f"the latest checkpoint stays iteration {BAD_ITERATION - 1};" in error, error
    tracked, _ = _tracker_checkpoint(save)
    assert tracked == BAD_ITERATION - 1, f"the tracker names iteration {tracked}"
    assert not os.path.exists(os.path.join(save, f"iter_{BAD_ITERATION:07d}")), f"iteration {BAD_ITERATION} saved"
    return f"stopped at {BAD_ITERATION}, grad norm {norm.group(1)}, named {named.group(1)} (rank {named.group(2)})"


def _check_skip(result, other, save, mode, rank):
    assert result["error"] is None and other["error"] is None, f"stopped: {result['error']}"
    assert result["skipped"] == [0] * (BAD_ITERATION - 1) + [1], f"skipped {result['skipped']}"
    tracked, files = _tracker_checkpoint(save)
    assert tracked == BAD_ITERATION, f"the tracker names iteration {tracked}"
    before, after = _weights(_checkpoint_files(save, BAD_ITERATION - 1)), _weights(files)
    assert before and before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"the skipped step changed {changed}"
    norm = result["grad norm"][BAD_ITERATION - 1]
    assert not math.isfinite(norm), f"grad norm {norm} logged for the skipped step"
    if mode == "fp16":
        halved = [LOSS_SCALE] * (BAD_ITERATION - 1) + [LOSS_SCALE / 2]
        assert result["loss scale"] == halved, f"loss scales {result['loss scale']}"
        return f"skipped {BAD_ITERATION}, grad norm {norm}, weights unchanged, loss scale {result['loss scale']}"
    lines = result["skip lines"]
    assert len(lines) == 1 and f"non-finite values at iteration {BAD_ITERATION}:" in lines[0], f"printed {lines}"
    named = re.search(r"first non-finite gradient: (\S+ \(rank \d\))", lines[0])
    assert named and named.group(1) == f"{POISONED} (rank {rank})", lines[0]
    return f"skipped {BAD_ITERATION}, grad norm {norm}, weights unchanged, named {named.group(1)}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nonfinite_gradient_on_every_path_and_precision(tmp_path, layout):
    cases = _cases(layout)
    directories = [str(tmp_path / "-".join(case)) for case in cases]
    for directory in directories:
        os.makedirs(directory)
    spawned = [(_flags(*case, directory) + LAYOUTS[layout], POISONED_RANK)
               for case, directory in zip(cases, directories)]
    per_rank = run_distributed(_run_cases, 2, args=(spawned,))
    rows = []
    for index, ((path, precision, mode), directory) in enumerate(zip(cases, directories)):
        result, other, save = per_rank[0][index], per_rank[1][index], os.path.join(directory, "checkpoints")
        try:
            rank = _naming_rank(layout, path)
            outcome = (_check_stop(result, other, save, rank) if mode == "stop"
                       else _check_skip(result, other, save, mode, rank))
        except AssertionError as failure:
            outcome = f"FAILED: {str(failure).splitlines()[0]}"
        rows.append(f"{layout:4s} {path:8s} {precision:4s} {mode:4s} -> {outcome}")
    print("\n" + "\n".join(rows))
    failed = [row for row in rows if "-> FAILED" in row]
    assert not failed, "\n".join(failed)
