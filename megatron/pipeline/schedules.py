"""Forward/backward schedules over the micro-batches of one step (Megatron's schedules.py).

`get_forward_backward_func()` is the plain loop at pipeline size 1, the non-interleaved 1F1B schedule
(PipeDream-Flush, Narayanan et al. 2021) otherwise, and the interleaved one with model chunks (below). All take the
same callbacks:

    forward_step_func(data_iterator, model) -> (output, reduced losses dict)   # pretrain_gpt.forward_step
    backward_func(output, output_grad, micro_batch_index, after_backward)       # training.py's backward

On the last stage `output` is the micro-batch's loss and `output_grad` is None; before it, `output` is the
stage's activations and `output_grad` the gradient the next stage sent back (already scaled like the loss).
backward_func must call `after_backward()` once, right after the autograd backward and before any gradient
reduction: it sends the input gradient to the previous stage, which waits for it (a stage that entered a
data-parallel or embedding all-reduce first would leave that stage waiting forever: a deadlock).

1F1B on stage s of P, M micro-batches: warmup of min(P - s - 1, M) forwards, then alternately one forward
and one backward, then the remaining backwards (cooldown). Example, P = 4, M = 4 (F3 = forward of
micro-batch 3, time left to right, '.' = idle):

    stage 0: F0 F1 F2 .  .  .  F3 B0 .  B1 .  B2 .  B3
    stage 3:          F0 B0 F1 B1 F2 B2 F3 B3

Stage s holds the activations of at most P - s micro-batches (Megatron's bound; GPipe holds all M).
`pipeline_order()` is the same sequence as pure data, checked by the tests without processes.

Interleaved 1F1B (Megatron-LM's forward_backward_pipelining_with_interleaving; Narayanan et al. 2021, section
2.2), when each stage holds v > 1 model chunks (mpu's virtual pipeline size): the v M chunk forwards of a stage
run in groups of P micro-batches per chunk (forward k: chunk (k mod Pv) div P, micro-batch (k div Pv) P + k mod P),
backwards likewise from the last chunk down; warmup 2 (P - s - 1) + (v - 1) P chunk forwards (all of them when
M = P); M must be a multiple of P. Example, P = 2, v = 2, M = 4, stage 0 (F1.0 = forward of micro-batch 1 on
chunk 0):

    F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0

The bubble (idle time over busy time) shrinks from (P - 1) / M to (P - 1) / (v M), for v times the
point-to-point traffic. Interleaved, backward_func runs once per micro-batch and chunk (backward_position tells
the step's first and last).
`interleaved_order()` is that sequence as pure data. The schedule sets mpu's virtual pipeline rank to the chunk
of each forward and backward (the model runs that chunk; mpu.is_pipeline_last_stage() is then true on the last
chunk of the last stage only), and hands chunk c an iterator that replays the micro-batches the data iterator
gave chunk 0, so each micro-batch is drawn once, as without interleaving.

The helpers at the end are what a pipelined step needs after the backwards: the tied word-embedding gradient
summed over the embedding group, the global gradient norm over every stage, the losses from the last stage.
"""
import contextlib
import itertools
import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import mpu
from megatron.pipeline import p2p_communication as p2p
from megatron.utils import unwrap_model


def num_warmup_micro_batches(num_stages, stage, num_micro_batches, num_chunks=1):
    """Forwards stage `stage` runs before its first backward; interleaved (num_chunks v > 1), chunk forwards out
    of v M (Megatron-LM's count)."""
    if num_chunks == 1:
        return min(num_stages - stage - 1, num_micro_batches)
    total = num_micro_batches * num_chunks
    if num_micro_batches == num_stages:
        return total
    return min((num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages, total)


def forwards_in_flight(num_stages, stage, num_micro_batches, num_chunks=1):
    """The most (chunk) forwards whose activations stage `stage` holds at once: its warmup's plus the steady
    state's next one, at most all of them. 1F1B: min(P - s, M); interleaved on stage 0 with M large:
    2 (P - 1) + (v - 1) P + 1 chunks of L / (P v) layers, i.e. L (1 + (P - 1) / (P v)) layers (Megatron-LM's)."""
    warmup = num_warmup_micro_batches(num_stages, stage, num_micro_batches, num_chunks)
    return min(warmup + 1, num_micro_batches * num_chunks)


def model_chunk_id(k, num_stages, num_chunks, forward):
    """The model chunk of a stage's k-th forward (or backward: chunks run from the last down)."""
    chunk = k % (num_stages * num_chunks) // num_stages
    return chunk if forward else num_chunks - 1 - chunk


def micro_batch_id(k, num_stages, num_chunks):
    """The micro-batch of a stage's k-th forward (or backward) in its model chunk."""
    return k // (num_stages * num_chunks) * num_stages + k % num_stages


def interleaving_error(num_micro_batches, num_stages):
    """Megatron-LM's words when the interleaved schedule cannot run M micro-batches on P stages, else None."""
    if num_micro_batches % num_stages:
        return (f"number of microbatches ({num_micro_batches}) is not divisible by pipeline-model-parallel-size "
                f"({num_stages}) when using interleaved schedule")
    return None


def pipeline_order(num_stages, stage, num_micro_batches):
    """The 1F1B sequence of stage `stage`: [("F", micro-batch), ("B", micro-batch), ...]."""
    warmup = num_warmup_micro_batches(num_stages, stage, num_micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]


def interleaved_order(num_stages, stage, num_micro_batches, num_chunks):
    """The interleaved sequence of stage `stage`: [("F", micro-batch, chunk), ("B", micro-batch, chunk), ...]."""
    total = num_micro_batches * num_chunks
    warmup = num_warmup_micro_batches(num_stages, stage, num_micro_batches, num_chunks)

    def op(kind, k):
        return kind, micro_batch_id(k, num_stages, num_chunks), model_chunk_id(k, num_stages, num_chunks, kind == "F")
    order = [op("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [op("F", warmup + k), op("B", k)]
    return order + [op("B", k) for k in range(total - warmup, total)]


def get_forward_backward_func():
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    if mpu.get_virtual_pipeline_model_parallel_world_size() is not None:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving


def backward_position(micro_batch_index, num_micro_batches):
    """(first, last): whether the backward now running (of `micro_batch_index`, in the model chunk mpu names) is
    the step's first / last on this rank. Interleaved backwards run from the last chunk down: the first is
    micro-batch 0's on chunk v - 1, the last micro-batch M - 1's on chunk 0."""
    chunks = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    chunk = mpu.get_virtual_pipeline_model_parallel_rank() or 0
    return micro_batch_index == 0 and chunk == chunks - 1, micro_batch_index == num_micro_batches - 1 and chunk == 0


def finishes_micro_batch():
    """Whether the backward now running is its micro-batch's last on this rank (chunk 0's; every backward when
    not interleaved): where the ZeRO engine counts a micro-step."""
    return not mpu.get_virtual_pipeline_model_parallel_rank()


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, backward_func, num_micro_batches,
                                   tensor_spec=None, forward_only=False, trace=None):
    """Forward and backward of each micro-batch in turn; torch DDP reduces only in the last backward.
    Returns the reduced-losses dict of every micro-batch."""
    losses = []
    for index in range(num_micro_batches):
        last = index == num_micro_batches - 1
        no_sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last \
            else contextlib.nullcontext()
        with no_sync:
            output, reduced = forward_step_func(data_iterator, model)
            _record(trace, "F", index)
            losses.append(reduced)
            if not forward_only:
                backward_func(output, None, index, lambda: None)
                _record(trace, "B", index)
    return losses


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model, backward_func,
                                                     num_micro_batches, tensor_spec, forward_only=False,
                                                     trace=None):
    """1F1B over the pipeline (see the module docstring); `tensor_spec` (p2p.TensorSpec) is the shape of the
    activations between stages. Returns the reduced-losses dicts on the last stage, [] elsewhere. `trace`: a
    list that gets ("F" | "B", micro-batch) in execution order. torch DDP runs under no_sync (its per-backward
    reduction cannot follow interleaved micro-batches): finish_deferred_ddp_reduction() averages afterwards."""
    no_sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else contextlib.nullcontext()
    with no_sync:
        return _one_forward_one_backward(forward_step_func, data_iterator, model, backward_func, num_micro_batches,
                                         tensor_spec, forward_only, trace)


def _one_forward_one_backward(forward_step_func, data_iterator, model, backward_func, num_micro_batches,
                              tensor_spec, forward_only, trace):
    stages, stage = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    warmup = num_micro_batches if forward_only else num_warmup_micro_batches(stages, stage, num_micro_batches)
    remaining = num_micro_batches - warmup
    inputs, outputs, losses, counts = [], [], [], {"F": 0, "B": 0}

    def forward(input_tensor):
        unwrap_model(model).set_input_tensor(input_tensor)
        output, reduced = forward_step_func(data_iterator, model)
        _record(trace, "F", counts["F"])
        counts["F"] += 1
        if mpu.is_pipeline_last_stage():
            losses.append(reduced)
        return output

    def backward(input_tensor, output, output_grad, communicate):
        """Backward of the oldest micro-batch in flight; `communicate(input grad)` is the p2p exchange that
        follows it (run as backward_func's after_backward). Returns what communicate received."""
        received = []

        def after_backward():
            received.append(communicate(None if input_tensor is None else input_tensor.grad))
        backward_func(output, output_grad, counts["B"], after_backward)
        assert len(received) == 1, "backward_func must call after_backward() once"
        _record(trace, "B", counts["B"])
        counts["B"] += 1
        return received[0]

    for _ in range(warmup):
        input_tensor = p2p.recv_forward(tensor_spec)
        output = forward(input_tensor)
        p2p.send_forward(output, tensor_spec)
        if not forward_only:
            inputs.append(input_tensor)
            outputs.append(output)
    input_tensor = p2p.recv_forward(tensor_spec) if remaining else None
    for i in range(remaining):
        output = forward(input_tensor)
        output_grad = p2p.send_forward_recv_backward(output, tensor_spec)
        inputs.append(input_tensor)
        outputs.append(output)
        if i == remaining - 1:
            backward(inputs.pop(0), outputs.pop(0), output_grad, lambda grad: p2p.send_backward(grad, tensor_spec))
        else:
            input_tensor = backward(inputs.pop(0), outputs.pop(0), output_grad,
                                    lambda grad: p2p.send_backward_recv_forward(grad, tensor_spec))
    for _ in range(0 if forward_only else warmup):
        output_grad = p2p.recv_backward(tensor_spec)
        backward(inputs.pop(0), outputs.pop(0), output_grad, lambda grad: p2p.send_backward(grad, tensor_spec))
    return losses


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator, model, backward_func,
                                                  num_micro_batches, tensor_spec, forward_only=False, trace=None):
    """Interleaved 1F1B over this stage's model chunks (see the module docstring); the arguments and the result
    are the non-interleaved schedule's; `trace` gets ("F" | "B", micro-batch, chunk)."""
    error = interleaving_error(num_micro_batches, mpu.get_pipeline_model_parallel_world_size())
    if error:
        raise RuntimeError(error)
    no_sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else contextlib.nullcontext()
    try:
        with no_sync:
            return _Interleaved(forward_step_func, data_iterator, model, backward_func, num_micro_batches,
                                tensor_spec, trace).run(forward_only)
    finally:
        mpu.set_virtual_pipeline_model_parallel_rank(0)


class _Interleaved:
    """One step of Megatron-LM's interleaved loop, its bookkeeping kept: per chunk, the inputs, outputs and output
    gradients of the micro-batches in flight, and where each received tensor goes (recv_prev / recv_next say
    whether one comes). The exchange after a backward runs as backward_func's after_backward, before any
    reduction."""

    def __init__(self, forward_step_func, data_iterator, model, backward_func, num_micro_batches, spec, trace):
        self.forward_step_func, self.model, self.backward_func, self.spec, self.trace = \
            forward_step_func, model, backward_func, spec, trace
        self.stages, stage = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
        self.chunks = mpu.get_virtual_pipeline_model_parallel_world_size()
        self.first_stage, self.last_stage = stage == 0, stage == self.stages - 1
        self.num_micro_batches, self.total = num_micro_batches, num_micro_batches * self.chunks
        self.inputs, self.outputs, self.output_grads = ([[] for _ in range(self.chunks)] for _ in range(3))
        self.data, self.losses = _chunk_iterators(data_iterator, self.chunks), []

    def chunk_of(self, k, forward):
        return model_chunk_id(k, self.stages, self.chunks, forward)

    def run(self, forward_only):
        stage = mpu.get_pipeline_model_parallel_rank()
        all_warmup = forward_only or self.num_micro_batches == self.stages
        warmup = self.total if forward_only else num_warmup_micro_batches(self.stages, stage,
                                                                          self.num_micro_batches, self.chunks)
        mpu.set_virtual_pipeline_model_parallel_rank(0)
        self.inputs[0].append(p2p.recv_forward(self.spec))
        for k in range(warmup):
            self.warmup_forward(k, first_backward_next=k == warmup - 1 and not all_warmup)
        for k in range(self.total - warmup):
            self.steady_forward_backward(k, warmup)
        if forward_only:
            return self.losses
        if all_warmup:   # the first output gradient did not come with the last warmup input
            mpu.set_virtual_pipeline_model_parallel_rank(self.chunks - 1)
            self.output_grads[self.chunks - 1].append(p2p.recv_backward(self.spec))
        for k in range(self.total - warmup, self.total):
            self.cooldown_backward(k)
        return self.losses

    def warmup_forward(self, k, first_backward_next):
        output = self.forward(k)
        next_chunk = self.chunk_of(k + 1, True)
        recv_prev = not (self.first_stage and next_chunk == 0) and k != self.total - 1
        if first_backward_next:   # the first output gradient comes with the last warmup input
            input_tensor, output_grad = p2p.send_forward_backward_recv_forward_backward(
                output, None, recv_prev, not self.last_stage, self.spec)
            self.output_grads[self.chunks - 1].append(output_grad)
        else:
            input_tensor = p2p.send_forward_recv_forward(output, recv_prev, self.spec)
        self.inputs[next_chunk].append(input_tensor)

    def steady_forward_backward(self, k, warmup):
        forward_k = k + warmup
        output = self.forward(forward_k)
        # The first stage runs P - 1 forwards ahead of the last (and the last P - 1 backwards ahead of the
        # first): what they receive next belongs to the chunk after (before) the one P - 1 steps back.
        recv_prev, recv_next = k != self.total - warmup - 1, True
        if self.first_stage:
            next_forward_chunk = self.chunk_of(forward_k - (self.stages - 1), True) + 1
            recv_prev = recv_prev and next_forward_chunk != self.chunks
        else:
            next_forward_chunk = self.chunk_of(forward_k + 1, True)
        if self.last_stage:
            next_backward_chunk = self.chunk_of(k - (self.stages - 1), False) - 1
            recv_next = next_backward_chunk != -1
        else:
            next_backward_chunk = self.chunk_of(k + 1, False)
        input_tensor, output_grad = self.backward(k, lambda grad: p2p.send_forward_backward_recv_forward_backward(
            output, grad, recv_prev, recv_next, self.spec))
        if recv_prev:
            self.inputs[next_forward_chunk].append(input_tensor)
        if recv_next:
            self.output_grads[next_backward_chunk].append(output_grad)

    def cooldown_backward(self, k):
        next_chunk = self.chunk_of(k + 1, False)
        recv_next = not (self.last_stage and next_chunk == self.chunks - 1) and k != self.total - 1
        self.output_grads[next_chunk].append(self.backward(k, lambda grad: p2p.send_backward_recv_backward(
            grad, recv_next, self.spec)))

    def forward(self, k):
        """The k-th chunk forward; returns what to send on (None after the model's last chunk)."""
        chunk = self.chunk_of(k, True)
        mpu.set_virtual_pipeline_model_parallel_rank(chunk)
        inputs, outputs = self.inputs[chunk], self.outputs[chunk]
        if mpu.is_pipeline_first_stage() and len(inputs) == len(outputs):
            inputs.append(None)                              # chunk 0 of stage 0 reads the data
        unwrap_model(self.model).set_input_tensor(inputs[-1])
        output, reduced = self.forward_step_func(self.data[chunk], self.model)
        _record(self.trace, "F", micro_batch_id(k, self.stages, self.chunks), chunk)
        outputs.append(output)
        if mpu.is_pipeline_last_stage():
            self.losses.append(reduced)
            return None
        return output

    def backward(self, k, communicate):
        """The k-th chunk backward; `communicate(input grad or None)` runs as after_backward; returns what it
        received."""
        chunk = self.chunk_of(k, False)
        mpu.set_virtual_pipeline_model_parallel_rank(chunk)
        if mpu.is_pipeline_last_stage() and not self.output_grads[chunk]:
            self.output_grads[chunk].append(None)            # the loss: no gradient from a next stage
        input_tensor, output = self.inputs[chunk].pop(0), self.outputs[chunk].pop(0)
        output_grad, received = self.output_grads[chunk].pop(0), []

        def after_backward():
            send = None if mpu.is_pipeline_first_stage() or input_tensor is None else input_tensor.grad
            received.append(communicate(send))
        index = micro_batch_id(k, self.stages, self.chunks)
        self.backward_func(output, output_grad, index, after_backward)
        assert len(received) == 1, "backward_func must call after_backward() once"
        _record(self.trace, "B", index, chunk)
        return received[0]


def _chunk_iterators(source, chunks):
    """One iterator per model chunk over the same micro-batches (Megatron-LM gives each chunk its own data
    iterator): each item is drawn from `source` once, by the first chunk to ask, and dropped once every chunk has
    read it. None (a rank without data) for every chunk when `source` is None."""
    if source is None:
        return [None] * chunks
    pending, drawn = {}, [0]        # micro-batch index -> [item, chunks yet to read it]

    def read(index):
        while drawn[0] <= index:
            pending[drawn[0]] = [next(source), chunks]
            drawn[0] += 1
        entry = pending[index]
        entry[1] -= 1
        if entry[1] == 0:
            del pending[index]
        return entry[0]
    return [(read(index) for index in itertools.count()) for _ in range(chunks)]


def _record(trace, kind, index, chunk=None):
    if trace is not None:
        trace.append((kind, index) if chunk is None else (kind, index, chunk))


# ---------------------------------------------------------------------------------------- after the backwards

def broadcast_losses_from_last_stage(losses):
    """The last stage's per-micro-batch loss dicts on every stage (rank 0 logs them)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return losses
    stages = mpu.get_pipeline_model_parallel_world_size()
    box = [losses if mpu.is_pipeline_last_stage(ignore_virtual=True) else None]
    dist.broadcast_object_list(box, group=mpu.get_pipeline_model_parallel_group(), group_src=stages - 1)
    return box[0]


def finish_deferred_ddp_reduction(model):
    """torch DDP under pipelining (the schedule ran it under no_sync): average the gradients over the
    data-parallel group now, in one flat buffer per dtype. A no-op at pipeline size 1 or without torch DDP."""
    if mpu.get_pipeline_model_parallel_world_size() == 1 or \
            not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    world = mpu.get_data_parallel_world_size(with_context_parallel=True)
    grads = {}
    for param in model.module.parameters():
        if param.grad is not None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        flat = _flatten_dense_tensors(same_dtype).div_(world)
        dist.all_reduce(flat, group=mpu.get_data_parallel_group(with_context_parallel=True))
        for grad, reduced in zip(same_dtype, _unflatten_dense_tensors(flat, same_dtype)):
            grad.copy_(reduced)


def allreduce_embedding_grads(module):
    """Sum the gradients of the word embedding (first stage) and its LM-head copy (last stage), so the two
    copies take the same step and stay identical (Megatron's embedding all-reduce)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1 or not mpu.is_rank_in_embedding_group():
        return
    for param in module.parameters():
        if getattr(param, "pipeline_tied", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=mpu.get_embedding_group())


def clip_grad_norm(optimizer, module, max_norm):
    """Clip the gradients the optimizer steps on (FP16_Optimizer's fp32 masters, else the parameters) to the
    global norm `max_norm` (<= 0: no clipping); returns that norm. Across pipeline stages the squares are summed
    over the pipeline group, the last stage's LM-head copy (`shared`) left out: the tied weight counts once. inf
    when FP16_Optimizer found an inf/nan gradient (the non-finite check in training.py reads this value)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        if hasattr(optimizer, "clip_master_grads"):
            return optimizer.clip_master_grads(max_norm)
        return mpu.clip_grad_norm(module.parameters(), max_norm if max_norm > 0 else math.inf)
    if getattr(optimizer, "overflow", False):   # FP16_Optimizer found inf/nan on some rank: the step is not taken
        return math.inf
    max_norm = max_norm if max_norm > 0 else math.inf
    model_params = list(getattr(optimizer, "model_params", None) or module.parameters())
    stepped = list(getattr(optimizer, "master_params", None) or model_params)
    counted = [s for m, s in zip(model_params, stepped, strict=True) if not getattr(m, "shared", False)]
    stage_norm = mpu.clip_grad_norm(counted, math.inf)       # over tensor-parallel ranks; clips nothing
    square = torch.tensor([stage_norm ** 2], dtype=torch.float64, device=mpu.get_device())
    dist.all_reduce(square, group=mpu.get_pipeline_model_parallel_group())
    total = math.sqrt(float(square))
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for param in stepped:
            if param.grad is not None:
                param.grad.mul_(coefficient)
    return total
