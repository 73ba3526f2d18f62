"""Point-to-point communication between neighbouring pipeline stages (Megatron's p2p_communication.py).

Forward sends carry a stage's output activations [b, s, h] to the next stage; backward sends carry the gradient
of those activations back. Pairs (one stage's call <-> its neighbour's):

    send_forward                <-> recv_forward
    send_backward               <-> recv_backward
    send_forward_recv_backward  <-> send_backward_recv_forward     (1F1B steady state)

Every call posts all its sends and receives at once (torch.distributed.batch_isend_irecv) and only then waits, so
the steady state's simultaneous exchanges cannot deadlock on gloo or NCCL however the buffers are sized. Each
tensor-parallel rank talks to the rank with the same tensor- and data-parallel position in the next stage
(global ranks from mpu.get_pipeline_model_parallel_ranks()). On the first stage the receives from the previous
stage return None; on the last, the receives from the next stage do (and sends to them are skipped).
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


def _neighbours():
    """(global rank of the previous stage or None, of the next stage or None)."""
    ranks, stage = mpu.get_pipeline_model_parallel_ranks(), mpu.get_pipeline_model_parallel_rank()
    previous = ranks[stage - 1] if stage > 0 else None
    following = ranks[stage + 1] if stage < len(ranks) - 1 else None
    return previous, following


def _communicate(spec, send_next=None, send_previous=None, recv_previous=False, recv_next=False):
    """Post the sends and receives asked for, wait for all; returns (from previous, from next) (None if not
    asked or no such neighbour). Received tensors require grad when they are activations (from previous)."""
    previous, following = _neighbours()
    group = mpu.get_pipeline_model_parallel_group()   # its timeout bounds a wait on a stage that died
    ops, from_previous, from_next = [], None, None
    if recv_previous and previous is not None:
        from_previous = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_previous, previous, group))
    if send_next is not None and following is not None:
        ops.append(dist.P2POp(dist.isend, send_next.contiguous(), following, group))
    if recv_next and following is not None:
        from_next = torch.empty(spec.shape, dtype=spec.dtype, device=spec.device)
        ops.append(dist.P2POp(dist.irecv, from_next, following, group))
    if send_previous is not None and previous is not None:
        ops.append(dist.P2POp(dist.isend, send_previous.contiguous(), previous, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    if from_previous is not None:
        from_previous.requires_grad_(True)
    return from_previous, from_next


def recv_forward(spec):
    """The previous stage's activations (None on the first stage)."""
    return _communicate(spec, recv_previous=True)[0]


def send_forward(output, spec):
    """This stage's activations to the next stage (nothing on the last)."""
    _communicate(spec, send_next=None if output is None else output.detach())


def recv_backward(spec):
    """The gradient of this stage's output from the next stage (None on the last stage)."""
    return _communicate(spec, recv_next=True)[1]


def send_backward(input_grad, spec):
    """The gradient of this stage's input to the previous stage (nothing on the first)."""
    _communicate(spec, send_previous=input_grad)


def send_forward_recv_backward(output, spec):
    """Send this micro-batch's output forward and receive the gradient of an earlier one's output."""
    return _communicate(spec, send_next=None if output is None else output.detach(), recv_next=True)[1]


def send_backward_recv_forward(input_grad, spec):
    """Send an input gradient back and receive the next micro-batch's input."""
    return _communicate(spec, send_previous=input_grad, recv_previous=True)[0]
