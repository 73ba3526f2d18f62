"""Capturing generate's static one-token step (generation.DecodeStep): the CUDA graph, a strict CPU stand-in for it,
and which of them generate uses.

    replay = cuda_graph_capture(step.forward)    # CUDA: the step's kernels in a torch.cuda.CUDAGraph
    replay = strict_capture(step.forward)        # any device: the step's aten ops recorded, then replayed
    logits = replay()                            # after the step's input buffers were refilled in place

A CUDA graph replays the kernels it captured on the memory they used: Python is not run again, so every Python
number the step computed (a cache length, a split size) is frozen at its capture-time value, and anything that
reads the device from the host (`.item()`, `.tolist()`, `bool(t)`, `nonzero`, a boolean-mask index, a shape that
depends on the values) cannot be captured at all. strict_capture behaves the same way on the CPU, so the CPU suite
sees what a GPU would: it records every aten op of one forward (TorchDispatchMode) with its arguments, fails on a
host read (HostReadInCapture, naming the op), and each replay re-executes the recorded ops on the same input
buffers, parameters and cache, with the recorded Python scalars: forward() is never called again.

Which capture generate uses (capture_for): the CUDA graph on CUDA at model-parallel size 1, unless the model has a
module whose forward reads the host (`graph_capturable = False`: the MoE layer, whose dispatch sizes its
all-to-all and expert pieces from token counts read on the host, mpu/moe.py); such a model decodes its static steps
eagerly and says so once per process.
"""
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

import mpu

_aten = torch.ops.aten
DATA_DEPENDENT_SHAPES = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                         _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.argwhere.default,
                         _aten.repeat_interleave.Tensor, _aten.nonzero_static.default}
"""Ops whose output size is read from the values (a device-to-host sync on CUDA). nonzero_static is listed as
well: its size is fixed, but torch's CUDA kernel still synchronizes."""
HOST_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}
"""Ops that hand a device value to Python (`.item()`, `bool(t)`, `int(t)`, torch.equal)."""
HOST_DATA = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
"""A tensor made from Python data (torch.tensor(...)) inside the step: a host-to-device copy, its values frozen."""


class HostReadInCapture(RuntimeError):
    """The captured step reads the device from the host, or its shapes depend on the values: a CUDA graph cannot
    hold it (the message names the op)."""


def _boolean_index(func, args):
    """An index/index_put with a boolean mask among its indices (its result size is the mask's count)."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        return False
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])


def _refuse(what):
    raise HostReadInCapture(f"the captured decode step {what}: a CUDA graph cannot capture it (make the step "
                            "read only device tensors at fixed shapes, or decode this model without a graph)")


@dataclass(frozen=True)
class _Output:
    """A recorded argument that is an earlier op's output: its `leaf`-th output tensor."""
    op: int
    leaf: int


class _Recorder(TorchDispatchMode):
    """Records (op, argument leaves, output shapes) of every aten op run inside it; a tensor argument is either an
    earlier op's output (_Output) or a tensor that existed before (kept as it is: the buffers, parameters and
    cache a graph reads in place); any other argument is a constant."""

    def __init__(self):
        super().__init__()
        self.ops = []            # (func, argument spec, argument leaves, output shapes)
        self.produced = {}       # id(tensor) -> _Output
        self.alive = []          # the outputs, held so that ids are not reused while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            _refuse(f"reads a device value on the host ({func})")
        if func in DATA_DEPENDENT_SHAPES or _boolean_index(func, args):
            _refuse(f"has an output whose size depends on the values ({func})")
        if func in HOST_DATA:
            _refuse(f"makes a tensor from Python data ({func}; a host-to-device copy, its values frozen)")
        leaves, spec = tree_flatten((args, kwargs))
        recorded = [self.produced.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in leaves]
        output = func(*args, **kwargs)
        out_leaves = tree_flatten(output)[0]
        for position, leaf in enumerate(out_leaves):
            if isinstance(leaf, (bool, int, float, complex)):
                _refuse(f"hands a device value to Python ({func} returned {type(leaf).__name__})")
            if isinstance(leaf, torch.Tensor):
                self.produced[id(leaf)] = _Output(len(self.ops), position)
                self.alive.append(leaf)
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in out_leaves]
        self.ops.append((func, spec, recorded, shapes))
        return output


class _NoHostCopies(TorchFunctionMode):
    """Tensor.tolist/.numpy inside the recording fail: on the CPU they read memory without any aten op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            _refuse(f"copies a tensor to the host (Tensor.{func.__name__})")
        return func(*args, **(kwargs or {}))


class Recording:
    """The ops of one captured forward; replay() re-executes them in order and returns the forward's output."""

    def __init__(self, ops, output):
        self.ops, self.output = ops, output      # output: the _Output forward returned

    def op_names(self):
        return [str(func) for func, *_ in self.ops]

    def replay(self):
        results = []
        for func, spec, recorded, shapes in self.ops:
            leaves = [results[x.op][x.leaf] if isinstance(x, _Output) else x for x in recorded]
            args, kwargs = tree_unflatten(leaves, spec)
            out_leaves = tree_flatten(func(*args, **kwargs))[0]
            got = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in out_leaves]
            if got != shapes:
                _refuse(f"changed an output's shape at replay ({func}: {shapes} at capture, {got} now)")
            results.append(out_leaves)
        return results[self.output.op][self.output.leaf]


def strict_capture(forward, warmup=2, recordings=None):
    """cuda_graph_capture's stand-in (module docstring): `warmup` eager runs, one recorded run, then replay() ->
    one output tensor (the capture's; every replay overwrites it, as a graph's static output). `recordings` (a
    list) gets the Recording, for tests that count captures or read the ops."""
    for _ in range(warmup):
        forward()
    recorder = _Recorder()
    with recorder, _NoHostCopies():
        output = forward()
    if id(output) not in recorder.produced:
        _refuse("returned a tensor no recorded op made")
    recording = Recording(recorder.ops, recorder.produced[id(output)])
    recorder.alive.clear()
    if recordings is not None:
        recordings.append(recording)

    def replay():
        output.copy_(recording.replay())
        return output
    return replay


def cuda_graph_capture(forward, warmup=2):
    """forward's kernels captured once into a torch.cuda.CUDAGraph; returns replay() -> forward's output tensor,
    which every replay overwrites. The warm-up runs (on a side stream, as torch's CUDA-graph notes ask) compute
    the step itself: they rewrite the same cache slot with the same values."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()

    def replay():
        graph.replay()
        return output
    return replay


def host_reading_modules(module):
    """Names of the kinds of submodule whose forward reads the host (`graph_capturable = False`), sorted."""
    return sorted({type(m).__name__ for m in module.modules() if not getattr(m, "graph_capturable", True)})


_SAID = set()


def _say_once(line):
    if line not in _SAID:
        _SAID.add(line)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(line, flush=True)


def graph_capture_default(device, module=None):
    """The capture generate uses when cuda_graph is None: cuda_graph_capture on CUDA at model-parallel size 1;
    None (eager static steps) on the CPU, at larger model-parallel sizes (collectives inside a captured graph
    have not been checked on a GPU here: pass cuda_graph=True to try), and for a model with a module that reads
    the host in its forward (host_reading_modules: the MoE layer), named once per process."""
    if device.type != "cuda" or mpu.get_model_parallel_world_size() != 1:
        return None
    kinds = host_reading_modules(module) if module is not None else []
    if kinds:
        _say_once(f"generation: CUDA graphs off for this model: its {', '.join(kinds)} layers read the host in "
                  "forward (token counts per expert); the static decode steps run eagerly")
        return None
    return cuda_graph_capture


def capture_for(cuda_graph, device, module=None):
    """The capture function generate's `cuda_graph` option names: None -> graph_capture_default, True ->
    cuda_graph_capture, False -> None (eager), a callable -> itself."""
    if cuda_graph is None:
        return graph_capture_default(device, module)
    if callable(cuda_graph):
        return cuda_graph
    return cuda_graph_capture if cuda_graph else None


GRAPH_CACHE_SIZE = 4
"""Captured steps kept per model (each holds a KV cache of its batch and length)."""


class CapturedSteps:
    """A model's captured one-token steps (generation.DecodeStep with its capture and KV cache), kept across
    generate calls by (capture, batch, mask rows, cache length): a later call of the same shape restarts that cache
    and replays the same capture (a capture costs two warm-up steps and the capture itself; lm-eval requests and
    rollout batches repeat shapes). At most GRAPH_CACHE_SIZE, the least recently used dropped first. A capture reads
    the parameters' memory, so they are all dropped when a parameter's storage moves (and, on the CPU, where the
    decode layouts are copies made at capture, when a parameter is changed in place)."""

    def __init__(self):
        self.steps, self.weights = {}, None

    @staticmethod
    def of(module):
        if "_captured_steps" not in module.__dict__:
            module.__dict__["_captured_steps"] = CapturedSteps()
        return module.__dict__["_captured_steps"]

    def find(self, capture, batch, mask_rows, total, device):
        """The kept step of this shape, or None (always None without a capture)."""
        if capture is None:
            return None
        step = self.steps.pop((capture, batch, mask_rows, total), None)
        if step is not None:
            if self._weights(step.model, device) != self.weights:
                self.steps.clear()
                return None
            self.steps[step.key] = step                   # now the most recently used
        return step

    def keep(self, step):
        """Keep a new step (when it has a capture); returns it."""
        if step.capture is not None:
            weights = self._weights(step.model, step.position.device)
            if weights != self.weights:
                self.steps.clear()
                self.weights = weights
            self.steps[step.key] = step
            while len(self.steps) > GRAPH_CACHE_SIZE:
                self.steps.pop(next(iter(self.steps)))
        return step

    @staticmethod
    def _weights(model, device):
        return tuple((p.data_ptr(), p._version if device.type == "cpu" else 0) for p in model.parameters())
