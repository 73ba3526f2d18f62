"""Checkpointed RNG states across device types (megatron/checkpoint/rng.py, mpu.random.device_rng_state_from).

The tensor-parallel tracker's states are in the saving device's generator format: the CPU's 5056-byte Mersenne
Twister state or CUDA's 16-byte Philox (seed, offset). A checkpoint written on GPUs is simulated here by replacing
the saved tracker states with Philox-format ones, as torch.cuda.get_rng_state() returns them."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import mpu
from megatron.checkpoint import rng

NAME = "model-parallel-rng"


@pytest.fixture
def tracker():
    tracker = mpu.get_cuda_rng_tracker()
    saved = tracker.get_states(), set(tracker.seeds)
    tracker.reset()
    tracker.add(NAME, 2718 + 5)
    yield tracker
    tracker.states, tracker.seeds = saved


def philox_state(seed, offset):
    """A CUDA generator state as torch.cuda.get_rng_state() returns it: seed and offset, 8 bytes each."""
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8).clone()


def as_if_saved_on_gpus(state, seed, with_type=True):
    converted = dict(state, tracker={NAME: philox_state(seed, 4 * 1024)})
    if with_type:
        converted["tracker_device_type"] = "cuda"
    else:
        converted.pop("tracker_device_type")
    return converted


def dropout_mask():
    with mpu.get_cuda_rng_tracker().fork():
        return F.dropout(torch.ones(4096), p=0.5, training=True) > 0


def test_saved_state_names_its_device_type(tracker):
    state = rng.get_rng_state()
    assert state["tracker_device_type"] == "cpu"
    assert state["tracker"][NAME].numel() == torch.get_rng_state().numel()
    assert mpu.random.device_rng_state_from(state["tracker"][NAME], "cpu") is state["tracker"][NAME]


def test_saved_state_names_the_runs_device_type_not_the_cpu(tracker, monkeypatch):
    """On a (mocked) GPU run the saved type is "cuda" (the tracker's states are then Philox states), so a CPU run
    that loads the checkpoint converts them; a type fixed at "cpu" would pass on this machine only."""
    monkeypatch.setattr(mpu, "get_device", lambda: torch.device("cuda", 1))
    assert rng.get_rng_state()["tracker_device_type"] == "cuda"


@pytest.mark.parametrize("with_type", [True, False], ids=["typed", "old-checkpoint-sized"])
def test_gpu_checkpoint_resumes_dropout_on_the_cpu(tracker, with_type):
    """The Philox states cannot be CPU generator states (the unconverted load dies as on a GPU: wrong size); after
    conversion dropout runs, the same checkpoint gives the same masks every time, another state other masks."""
    saved = as_if_saved_on_gpus(rng.get_rng_state(), seed=1234, with_type=with_type)
    with pytest.raises(RuntimeError, match="wrong size|size"):
        torch.set_rng_state(saved["tracker"][NAME])
    rng.set_rng_state(saved)
    assert tracker.get_states()[NAME].numel() == torch.get_rng_state().numel()
    first = dropout_mask()
    assert 0.4 < first.float().mean() < 0.6
    rng.set_rng_state(saved)
    assert torch.equal(dropout_mask(), first)
    rng.set_rng_state(as_if_saved_on_gpus(rng.get_rng_state(), seed=1235, with_type=with_type))
    assert not torch.equal(dropout_mask(), first)


def test_same_device_type_resumes_the_stream_exactly(tracker):
    saved = rng.get_rng_state()
    expected = dropout_mask()
    rng.set_rng_state(saved)
    assert torch.equal(dropout_mask(), expected)


def _draws():
    """The next value of every stream preserved_rng_state keeps: python, numpy, torch and the tracker."""
    import random
    import numpy as np
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), dropout_mask().tolist()


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_preserved_rng_state_gives_every_stream_back(tracker, raises):
    """What is built or run for sampling and scoring (megatron/posttrain/reward.py, text_generation.hybrid) runs
    inside it: a body drawing from every stream, or failing half-way, leaves the next draws as without it."""
    state = rng.get_rng_state()
    expected = _draws()
    rng.set_rng_state(state)
    with pytest.raises(ValueError) if raises else contextlib.nullcontext():
        with rng.preserved_rng_state():
            _draws()
            torch.nn.Linear(8, 8)                            # a model's initialisation: the default generator
            if raises:
                raise ValueError("a body failing half-way")
    assert _draws() == expected
