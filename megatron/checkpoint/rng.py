"""Every RNG state of a process (python, numpy, torch, CUDA when present, mpu's model-parallel tracker), as
tensors and plain values so that torch.load(weights_only=True) reads them back: what a checkpoint saves for an
exact resume (both paths; the ZeRO path in its client_state). Portable across device types: the tracker's states
are saved with the device type whose format they have, and converted when a run on another type loads them.

Also what anything run beside training (a model built or run for sampling or scoring) is wrapped in, so that the
training's streams do not move:

    with preserved_rng_state():          # or @preserved_rng_state() on the function
        reward_model = GPT2Model(config)  # its initialisation draws from the default generator; given back on exit
"""
import contextlib
import random

import numpy as np
import torch

import mpu


def get_rng_state():
    """Every RNG state (python, numpy, torch, cuda when present, every mpu tracker state), as tensors and plain
    values so that torch.load(weights_only=True) reads them back. Also used by the ZeRO path's client_state."""
    version, python_state, gauss = random.getstate()
    state = {"python_version": version, "python": torch.tensor(python_state, dtype=torch.int64),
             "python_gauss": gauss, "numpy": _numpy_state(), "torch": torch.get_rng_state(),
             "tracker": mpu.get_cuda_rng_tracker().get_states(), "tracker_device_type": mpu.get_device().type}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@contextlib.contextmanager
def preserved_rng_state():
    """Every RNG state get_rng_state() captures (python, numpy, torch, CUDA's current device, the mpu tracker) put
    back as it was when the body exits, however it exits: the body may draw (a model's initialisation, sampling,
    dropout, a user's reward function) without changing what training draws next. Usable as a decorator."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def _tracker_device_type(state):
    """The device type the tracker states were saved on; a checkpoint from before the key was written: CUDA's
    16-byte Philox states, else the CPU."""
    if "tracker_device_type" in state:
        return state["tracker_device_type"]
    sizes = {s.numel() for s in state["tracker"].values()}
    return "cuda" if sizes == {16} else "cpu"


def _numpy_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_rng_state(state):
    """Restore what get_rng_state() returned (without a "tracker" entry, e.g. from a checkpoint resized to another
    model-parallel size, the model-parallel tracker keeps its seeded states)."""
    random.setstate((state["python_version"], tuple(int(x) for x in state["python"].tolist()),
                     state["python_gauss"]))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "tracker" in state:   # the tracker's states are in the saving device's format: converted on another type
        mpu.get_cuda_rng_tracker().set_states(state["tracker"], _tracker_device_type(state))
