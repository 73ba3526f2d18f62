"""RNG state tracking for model parallelism, and activation checkpointing that replays it.

Dropout inside model-parallel regions (attention probabilities of a head shard, say) must differ across
model-parallel ranks, while dropout on replicated activations must be the same on every model-parallel rank.
The tracker keeps named RNG states; `fork(name)` swaps the device generator to that state for a region and
swaps it back afterwards, so the default stream continues as if the region never ran.

Seeds (`model_parallel_cuda_manual_seed(seed)`): default generator = seed (same on all mp ranks);
tracker 'model-parallel-rng' = seed + 2718 + model-parallel rank.

Weights a rank builds but does not keep (the layers of other pipeline stages, the experts of other expert-parallel
ranks) still take their draws from the default generator: `skip_init_draws` advances it exactly as those draws would,
so every kept weight equals the single-process model's.

Device-agnostic: the states are those of the generator of `get_device()` (CUDA's when present, else CPU's).
"""
import contextlib
import hashlib
import math

import torch
from torch.utils.checkpoint import detach_variable

from .initialize import get_model_parallel_rank
from .utils import get_device

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


def _get_device_rng_state():
    device = get_device()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_device_rng_state(state):
    device = get_device()
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def device_rng_state_from(state, saved_device_type):
    """A generator state in this process's device format (CPU's 5056-byte Mersenne Twister state, CUDA's 16-byte
    Philox seed and offset) from `state`, saved where the device was `saved_device_type`: `state` itself when the
    formats agree; otherwise a fresh state seeded from a digest of `state`'s bytes (the other device's stream
    cannot be continued, but every resume of the same checkpoint then draws the same masks, and tensor-parallel
    ranks, whose saved states differ, keep different streams). Without this a CPU checkpoint dies on a GPU at the
    first dropout ("RNG state is wrong size"), and a GPU checkpoint on the CPU."""
    device = get_device()
    if saved_device_type == device.type and state.numel() == _get_device_rng_state().numel():
        return state
    digest = hashlib.sha256(state.cpu().numpy().tobytes()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator.get_state()


def _manual_seed_device(seed):
    device = get_device()
    if device.type == "cuda":
        with torch.cuda.device(device):   # the generator _get/_set_device_rng_state use, even if not current
            torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RngStatesTracker:
    """Named device-RNG states; `fork(name)` runs a region under one of them."""

    def __init__(self):
        self.states = {}
        self.seeds = set()

    def __deepcopy__(self, memo):
        return self  # process-wide generator state: a deep-copied model must keep drawing from the same streams

    def reset(self):
        self.states = {}
        self.seeds = set()

    def get_states(self):
        """A copy of every tracked state (name -> ByteTensor)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states, saved_device_type=None):
        """Restore get_states()'s copy; `saved_device_type` (the device type it was taken on; None: this one)
        converts states of another device's format (device_rng_state_from)."""
        self.states = {name: state.clone() if saved_device_type is None else
                       device_rng_state_from(state, saved_device_type) for name, state in states.items()}

    def add(self, name, seed):
        if seed in self.seeds:
            raise ValueError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists in the tracker")
        self.seeds.add(seed)
        original = _get_device_rng_state()
        _manual_seed_device(seed)
        self.states[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not in the tracker; call model_parallel_cuda_manual_seed first")
        original = _get_device_rng_state()
        _set_device_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_rng_state()
            _set_device_rng_state(original)


_RNG_STATE_TRACKER = RngStatesTracker()


def get_cuda_rng_tracker():
    """The process-wide tracker (the name is Megatron's; it tracks the CPU generator on CPU)."""
    return _RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed):
    """Seed the default generators with `seed` and the tracker's model-parallel state per mp rank."""
    model_parallel_seed = seed + 2718 + get_model_parallel_rank()
    torch.manual_seed(seed)
    _manual_seed_device(seed)
    _RNG_STATE_TRACKER.reset()
    _RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def skip_init_draws(shapes, device):
    """Advance `device`'s default generator exactly as normal_ into fresh fp32 tensors of `shapes` (in order) would,
    keeping none of them: the draws go into one scratch buffer of the largest shape (how much of the stream a draw
    consumes depends on its element count, dtype and device, not on its storage or its mean and std)."""
    if not shapes:
        return
    scratch = torch.empty(max(math.prod(shape) for shape in shapes), dtype=torch.float32, device=device)
    for shape in shapes:
        scratch[:math.prod(shape)].view(shape).normal_()


def get_rng_states():
    """Every RNG state a recompute must replay: (CPU generator, device generator, tracker states), copied."""
    return torch.get_rng_state(), _get_device_rng_state(), get_cuda_rng_tracker().get_states()


def set_rng_states(states):
    """Restore what `get_rng_states()` returned."""
    cpu_state, device_state, tracker_states = states
    torch.set_rng_state(cpu_state)
    _set_device_rng_state(device_state)
    get_cuda_rng_tracker().set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Keeps only the inputs of `run_function`; recomputes it in backward under the forward's RNG states
    (CPU, device and tracker), so recomputed dropout masks equal the original ones."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.fwd_rng_states = get_rng_states()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = detach_variable(ctx.saved_tensors)
        bwd_rng_states = get_rng_states()
        set_rng_states(ctx.fwd_rng_states)
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)
        set_rng_states(bwd_rng_states)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs) if out.requires_grad]
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(inp.grad if isinstance(inp, torch.Tensor) else None for inp in inputs)
        return (None,) + grads


def checkpoint(function, *args):
    """Activation checkpointing: forward without keeping activations, recompute them in backward."""
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        # Autograd runs backward only when an input requires grad: this empty one lets the recompute reach the
        # parameters inside `function` when no input does (frozen embeddings under LoRA feed the first layers).
        return CheckpointFunction.apply(lambda *inputs: function(*inputs[:-1]), *args,
                                        torch.empty(0, requires_grad=True))
    return CheckpointFunction.apply(function, *args)
