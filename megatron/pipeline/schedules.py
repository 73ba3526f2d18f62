"""Forward/backward schedules over the micro-batches of one step (Megatron's schedules.py).

`get_forward_backward_func()` is the plain loop at pipeline size 1 and the non-interleaved 1F1B schedule
(PipeDream-Flush, Narayanan et al. 2021) otherwise. Both take the same callbacks:

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

The helpers at the end are what a pipelined step needs after the backwards: the tied word-embedding gradient
summed over the embedding group, the global gradient norm over every stage, the losses from the last stage.
"""
import contextlib
import math

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import mpu
from megatron.pipeline import p2p_communication as p2p
from megatron.utils import unwrap_model


def num_warmup_micro_batches(num_stages, stage, num_micro_batches):
    """Forwards stage `stage` runs before its first backward."""
    return min(num_stages - stage - 1, num_micro_batches)


def pipeline_order(num_stages, stage, num_micro_batches):
    """The 1F1B sequence of stage `stage`: [("F", micro-batch), ("B", micro-batch), ...]."""
    warmup = num_warmup_micro_batches(num_stages, stage, num_micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]


def get_forward_backward_func():
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


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


def _record(trace, kind, index):
    if trace is not None:
        trace.append((kind, index))


# ---------------------------------------------------------------------------------------- after the backwards

def broadcast_losses_from_last_stage(losses):
    """The last stage's per-micro-batch loss dicts on every stage (rank 0 logs them)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return losses
    stages = mpu.get_pipeline_model_parallel_world_size()
    box = [losses if mpu.is_pipeline_last_stage() else None]
    dist.broadcast_object_list(box, group=mpu.get_pipeline_model_parallel_group(), group_src=stages - 1)
    return box[0]


def finish_deferred_ddp_reduction(model):
    """torch DDP under pipelining (the schedule ran it under no_sync): average the gradients over the
    data-parallel group now, in one flat buffer per dtype. A no-op at pipeline size 1 or without torch DDP."""
    if mpu.get_pipeline_model_parallel_world_size() == 1 or \
            not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    world = mpu.get_data_parallel_world_size()
    grads = {}
    for param in model.module.parameters():
        if param.grad is not None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        flat = _flatten_dense_tensors(same_dtype).div_(world)
        dist.all_reduce(flat, group=mpu.get_data_parallel_group())
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
