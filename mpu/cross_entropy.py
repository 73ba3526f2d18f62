"""Cross entropy over logits whose vocabulary dimension is split across model-parallel ranks.

Each rank holds logits for a contiguous vocabulary range (ranges may be uneven: rank r's range starts at the
sum of the lower ranks' widths). Three all-reduces (max, target logit, sum of exponentials) give the exact
loss without ever gathering the full [.., V] logits. The input is never modified.
`fused=True` computes the same loss with mpu/fused.py's compiled passes (the --torch-compile path); its backward
overwrites the logits with their gradient, so it is for logits nothing else uses (GPT2Model's).
"""
import torch
import torch.distributed as dist

from . import fused as compiled_ops
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size


def _vocab_start_index(partition_vocab_size, device):
    """First vocabulary id of this rank's logits (an exclusive prefix sum of the partition widths)."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return 0
    widths = torch.zeros(world_size, dtype=torch.int64, device=device)
    widths[get_model_parallel_rank()] = partition_vocab_size
    dist.all_reduce(widths, group=get_model_parallel_group())
    return int(widths[:get_model_parallel_rank()].sum())


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        group = get_model_parallel_group()
        logits = vocab_parallel_logits.float()
        logits_max = logits.max(dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: the caller's logits are untouched

        local_target, outside = _local_target(target, shifted.size(-1), shifted.device)
        predicted = torch.gather(shifted, -1, local_target.unsqueeze(-1)).squeeze(-1)
        predicted = predicted.masked_fill(outside, 0.0)
        dist.all_reduce(predicted, group=group)

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = torch.log(sum_exp) - predicted

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad_input = softmax.clone()
        inside = (~outside).to(grad_input.dtype)
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input.to(ctx.input_dtype), None


def _local_target(target, partition_vocab_size, device):
    """(target - this rank's first vocabulary id, 0 where outside; the mask of targets another rank holds)."""
    vocab_start = _vocab_start_index(partition_vocab_size, device)
    outside = (target < vocab_start) | (target >= vocab_start + partition_vocab_size)
    return (target - vocab_start).masked_fill(outside, 0), outside


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss as _VocabParallelCrossEntropy: two compiled passes over the logits forward, one backward
    that writes the gradient into the saved logits."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        group = get_model_parallel_group()
        logits_max = compiled_ops.logits_max(vocab_parallel_logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        local_target, outside = _local_target(target, vocab_parallel_logits.size(-1), vocab_parallel_logits.device)
        predicted, sum_exp = compiled_ops.target_logit_and_sum_exp(vocab_parallel_logits, logits_max, local_target,
                                                                   outside)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(vocab_parallel_logits, logits_max, sum_exp, local_target, outside)
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_output):
        logits = ctx.saved_tensors[0]
        compiled_ops.cross_entropy_grad_(*ctx.saved_tensors, grad_output.contiguous())
        return logits, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, fused=False):
    """Per-token loss [..] from logits [.., V/p] (this rank's vocabulary slice) and global target ids [..].
    fused: the compiled passes of mpu/fused.py (the same loss, fewer passes over the logits); backward then
    overwrites the logits with their gradient."""
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(vocab_parallel_logits, target)
