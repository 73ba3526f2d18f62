"""Host syncs in the training step: every read of a device value on the host (Tensor.item, tolist, bool/float/int,
numpy, cpu) stalls a GPU until its queue drains. The ZeRO path's step has at most 3: the losses once
(training.losses_to_host), the gradient norm once (grad_norm.global_norm_and_overflow), and at model-parallel
size > 1 the batch's shapes (mpu.broadcast_data). Counted on the CPU by wrapping those Tensor methods inside
train_step (and inside losses_to_host for several micro-batches of several losses: one read); and the phase
timers synchronize the device only when timing is asked for (--timing-log-level)."""
import collections
import traceback

import pytest
import torch

from megatron.spawn import run_distributed
from megatron.timers import Timers
from tests.helpers import NO_DROPOUT, TINY, train, write_config

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")
ITERS = 4


def _count_reads(args_list):
    """Train; {(method, caller file:line): calls per step} inside train_step, and whether the timers are on."""
    import megatron.training as training
    from megatron.global_vars import get_timers
    counts, counting = collections.Counter(), [False]

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if counting[0]:
                caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                              if "/torch/" not in f.filename)
                counts[(name, f"{caller.filename.rsplit('/', 2)[-1]}:{caller.lineno}")] += 1
            return original(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)
    for name in READS:
        wrap(name)
    step = training.train_step

    def counted_step(*args, **kwargs):
        counting[0] = True
        try:
            return step(*args, **kwargs)
        finally:
            counting[0] = False
    training.train_step = counted_step
    train(args_list)
    return {key: calls / ITERS for key, calls in counts.items()}, get_timers().enabled


@pytest.mark.parametrize("model_parallel_size,most", [(1, 2), (2, 3)])
def test_zero2_step_reads_the_device_at_most_three_times(tmp_path, model_parallel_size, most):
    config = write_config(str(tmp_path))
    args = TINY + NO_DROPOUT + ["--train-iters", str(ITERS), "--deepspeed", "--deepspeed_config", config,
                                "--model-parallel-size", str(model_parallel_size)]
    reads, timers_on = run_distributed(_count_reads, 2, args=(args,))[0]
    assert sum(reads.values()) <= most, reads
    assert not timers_on                     # --timing-log-level 0 (the default): no phase timers


class _Device:
    type = "cuda"


def test_timers_synchronize_only_when_enabled(monkeypatch):
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    quiet, timed = Timers(enabled=False, device=_Device()), Timers(enabled=True, device=_Device())
    for timers in (quiet, timed):
        with timers("forward"):
            pass
    assert len(syncs) == 2                   # the enabled timer's start and stop, none from the disabled one
    assert quiet.summary() == {} and quiet("forward").count == 1
    assert timed.summary()["forward"]["count"] == 1


def test_several_losses_of_several_micro_batches_are_read_in_one_host_read(monkeypatch):
    """training.losses_to_host on 3 micro-batches x (a 0-d loss, a (sum, count) pair, a float left as it is): one
    read of the device in all (a read per loss would be 9 here), and every value the tensor's own float."""
    import megatron.training as training
    reads = []

    def counted(name, original):
        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)
        return read
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    losses = [{"lm loss": torch.tensor(0.25 * i), "tokens": (torch.tensor(3.0 + i), torch.tensor(4 + i)),
               "lr": 1e-3} for i in range(3)]
    host = training.losses_to_host(losses)
    assert len(reads) == 1, reads
    assert host == [{"lm loss": 0.25 * i, "tokens": (3.0 + i, 4.0 + i), "lr": 1e-3} for i in range(3)]
