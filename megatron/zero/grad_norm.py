"""The global gradient norm over all partitions and model-parallel ranks, and the overflow flag with it.

Each rank sums the squares of its own partition's gradients. Parameters split across model-parallel ranks
(`model_parallel=True`) count on every rank; duplicated ones only on model-parallel rank 0, so they are counted
once. Elements that do not count for the norm still count for overflow detection. Both sums are all-reduced over
the data-, the model-parallel and (under pipelining) the pipeline group, so every rank sees the same norm and the
same overflow decision; a pipeline's second copy of the tied word embedding (`shared`) is left out of the norm.
"""
import math

import torch
import torch.distributed as dist


def local_square_sums(partition_grads, ranges, device):
    """[counted, not counted] sums of squares (fp32) over this rank's partitions, on `device` (the collective
    device: the sums go into NCCL, which takes device tensors only; offloaded gradients sum where they live and
    only the two totals move).

    `ranges[i]` is (counted, not_counted) lists of (lo, hi) ranges into `partition_grads[i]`.
    """
    sums = torch.zeros(2, dtype=torch.float32, device=device)
    for grad, (counted, other) in zip(partition_grads, ranges):
        for slot, pieces in enumerate((counted, other)):
            for lo, hi in pieces:
                sums[slot] += _square_sum(grad[lo:hi]).to(device)
    return sums


def _square_sum(piece):
    """Sum of squares in fp32. A 16-bit piece is reduced with fp32 accumulation as it is read (vector_norm's dtype):
    `.float()` would write an fp32 copy of every gradient once more per step, beside the one the masters take."""
    if piece.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.vector_norm(piece, dtype=torch.float32).square()
    piece = piece.float()
    return torch.dot(piece, piece)


def global_norm_and_overflow(partition_grads, ranges, ctx, device, scale=1.0, partitioned=True, experts=()):
    """(norm of the unscaled gradients, overflow) identical on every rank; norm is inf on overflow. `device`: where
    the sums are reduced (the compute device).

    `partitioned=False` (stage 0): every data-parallel rank holds all gradients, so nothing is summed over them,
    except the expert groups' (`experts[i]` True: group i holds this rank's experts), summed over the
    expert-model-parallel group, whose ranks hold different experts. Partitioned, the sum over the data-parallel
    group counts each expert element once (each expert-data-parallel rank holds a different piece of it).
    """
    if not partitioned and ctx.expert_model_parallel_size > 1 and any(experts):
        dense = [i for i in range(len(partition_grads)) if not experts[i]]
        sums = local_square_sums([partition_grads[i] for i in dense], [ranges[i] for i in dense], device)
        expert = [i for i in range(len(partition_grads)) if experts[i]]
        expert_sums = local_square_sums([partition_grads[i] for i in expert], [ranges[i] for i in expert], device)
        dist.all_reduce(expert_sums, group=ctx.expert_model_parallel_group)
        sums += expert_sums
    else:
        sums = local_square_sums(partition_grads, ranges, device)
    for group, size in ((ctx.data_parallel_group, ctx.data_parallel_size if partitioned else 1),
                        (ctx.model_parallel_group, ctx.model_parallel_size),
                        (ctx.pipeline_parallel_group, ctx.pipeline_parallel_size)):
        if size > 1:
            dist.all_reduce(sums, group=group)
    counted, other = sums.tolist()      # the step's one host sync for the norm
    overflow = not math.isfinite(counted + other)
    norm = math.inf if overflow else math.sqrt(counted) / scale
    return norm, overflow


def clip_coefficient(norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
