"""Forward/backward schedules over the micro-batches of one step (Megatron's schedules.py).

`get_forward_backward_func()` is the plain loop at pipeline size 1 and the non-interleaved 1F1B schedule
(PipeDream-Flush, Narayanan et al. 2021) otherwise. Both take the same callbacks:

    forward_step_func(data_iterator, model) -> (output, reduced losses dict)   # pretrain_gpt.forward_step
    backward_func(output, output_grad, micro_batch_index)                       # training.py's backward

On the last stage `output` is the micro-batch's loss and `output_grad` is None; before it, `output` is the
stage's activations and `output_grad` the gradient the next stage sent back (already scaled like the loss).

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

import mpu
from megatron import p2p_communication as p2p
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
                backward_func(output, None, index)
                _record(trace, "B", index)
    return losses


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model, backward_func,
                                                     num_micro_batches, tensor_spec, forward_only=False,
                                                     trace=None):
    """1F1B over the pipeline (see the module docstring); `tensor_spec` (p2p.TensorSpec) is the shape of the
    activations between stages. Returns the reduced-losses dicts on the last stage, [] elsewhere. `trace`: a
    list that gets ("F" | "B", micro-batch) in execution order."""
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

    def backward(input_tensor, output, output_grad):
        backward_func(output, output_grad, counts["B"])
        _record(trace, "B", counts["B"])
        counts["B"] += 1
        return None if input_tensor is None else input_tensor.grad

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
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        if i == remaining - 1:
            p2p.send_backward(input_grad, tensor_spec)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, tensor_spec)
    for _ in range(0 if forward_only else warmup):
        output_grad = p2p.recv_backward(tensor_spec)
        input_grad = backward(inputs.pop(0), outputs.pop(0), output_grad)
        p2p.send_backward(input_grad, tensor_spec)
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
    over the pipeline group, the last stage's LM-head copy (`shared`) left out: the tied weight counts once."""
    max_norm = max_norm if max_norm > 0 else math.inf
    model_params = list(getattr(optimizer, "model_params", None) or module.parameters())
    stepped = list(getattr(optimizer, "master_params", None) or model_params)
    if mpu.get_pipeline_model_parallel_world_size() == 1:
        return mpu.clip_grad_norm(stepped, max_norm)
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
