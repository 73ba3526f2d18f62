"""Point-to-point communication between neighbouring pipeline stages (Megatron's p2p_communication.py).

Forward sends carry a stage's output activations [b, s, h] to the next stage; backward sends carry the gradient
of those activations back. Pairs (one stage's call <-> its neighbour's):

    send_forward                <-> recv_forward
    send_backward               <-> recv_backward
    send_forward_recv_backward  <-> send_backward_recv_forward     (1F1B steady state)
    send_forward_backward_recv_forward_backward (both sides; the interleaved schedule's steady state), and its
    halves send_forward_recv_forward, send_backward_recv_backward

Every call posts all its sends and receives at once (torch.distributed.batch_isend_irecv) and only then waits, so
the steady state's simultaneous exchanges cannot deadlock on gloo or NCCL however the buffers are sized. Each
tensor-parallel rank talks to the rank with the same tensor- and data-parallel position in the next stage
(global ranks from mpu.get_pipeline_model_parallel_ranks()). The stages form a ring: the interleaved schedule
sends the last stage's chunk-c output to stage 0's chunk c + 1 (and gradients back the other way). The first four
calls return None for a receive at the pipeline's ends (mpu.is_pipeline_first_stage / last_stage, which under
interleaving mean the first chunk of stage 0 / last chunk of stage P - 1) and skip sends past them; the
interleaved ones take explicit recv_prev / recv_next flags (the schedule knows what comes). Activations and
gradients carry different tags, so at P = 2, where the previous and the next stage are one rank, a forward and
a backward exchanged in one call cannot be matched crosswise.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

import mpu


@dataclass(frozen=True)
class TensorSpec:
    """What crosses a stage boundary: one micro-batch's activations."""
    shape: tuple
    """[micro batch, sequence, hidden]."""
    dtype: torch.dtype
    device: torch.device


_ACTIVATION_TAG, _GRADIENT_TAG = 1, 2


def _neighbours():
    """(global rank of the previous stage, of the next stage), around the ring."""
    ranks, stage = mpu.get_pipeline_model_parallel_ranks(), mpu.get_pipeline_model_parallel_rank()
    return ranks[(stage - 1) % len(ranks)], ranks[(stage + 1) % len(ranks)]


def _communicate(spec, send_next=None, send_previous=None, recv_previous=False, recv_next=False):
    """Post the sends and receives asked for, wait for all; returns (from previous, from next) (None if not
    asked). Received tensors require grad when they are activations (from previous)."""
    previous, following = _neighbours()
    group = mpu.get_pipeline_model_parallel_group()   # its timeout bounds a wait on a stage that died
    ops, from_previous, from_next = [], None, None
    if recv_previous:
        from_previous = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_previous, previous, group, _ACTIVATION_TAG))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), following, group, _ACTIVATION_TAG))
    if recv_next:
        from_next = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_next, following, group, _GRADIENT_TAG))
    if send_previous is not None:
        ops.append(dist.P2POp(dist.isend, send_previous.contiguous(), previous, group, _GRADIENT_TAG))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    if from_previous is not None:
        from_previous.requires_grad_(True)
    return from_previous, from_next


def _unless(at_end, tensor):
    return None if at_end else tensor


def recv_forward(spec):
    """The previous stage's activations (None on the first stage)."""
    return _communicate(spec, recv_previous=not mpu.is_pipeline_first_stage())[0]


def send_forward(output, spec):
    """This stage's activations to the next stage (nothing on the last)."""
    _communicate(spec, send_next=_unless(mpu.is_pipeline_last_stage(), output))


def recv_backward(spec):
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    return _communicate(spec, recv_next=not mpu.is_pipeline_last_stage())[1]


def send_backward(input_grad, spec):
    """The gradient of this stage's input to the previous stage (nothing on the first)."""
    _communicate(spec, send_previous=_unless(mpu.is_pipeline_first_stage(), input_grad))


def send_forward_recv_backward(output, spec):
    """Send this micro-batch's output forward and receive the gradient of an earlier one's output."""
    last = mpu.is_pipeline_last_stage()
    return _communicate(spec, send_next=_unless(last, output), recv_next=not last)[1]


def send_backward_recv_forward(input_grad, spec):
    """Send an input gradient back and receive the next micro-batch's input."""
    first = mpu.is_pipeline_first_stage()
    return _communicate(spec, send_previous=_unless(first, input_grad), recv_previous=not first)[0]


def send_forward_recv_forward(output, recv_prev, spec):
    """Interleaved warmup: send `output` (None: nothing) on, receive the next input when `recv_prev`."""
    return _communicate(spec, send_next=output, recv_previous=recv_prev)[0]


def send_backward_recv_backward(input_grad, recv_next, spec):
    """Interleaved cooldown: send `input_grad` (None: nothing) back, receive an output gradient when
    `recv_next`."""
    return _communicate(spec, send_previous=input_grad, recv_next=recv_next)[1]


def send_forward_backward_recv_forward_backward(output, input_grad, recv_prev, recv_next, spec):
    """Interleaved steady state: both sends and both receives in one exchange; returns (input, output grad)."""
    return _communicate(spec, send_next=output, send_previous=input_grad, recv_previous=recv_prev,
                        recv_next=recv_next)
