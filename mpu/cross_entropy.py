"""Cross entropy over logits whose vocabulary dimension is split across model-parallel ranks.

Each rank holds logits for a contiguous vocabulary range (ranges may be uneven: rank r's range starts at the
sum of the lower ranks' widths). Three all-reduces (max, target logit, sum of exponentials) give the exact
loss without ever gathering the full [.., V] logits. The input is never modified.

Padding: with `real_vocab_size` given, vocabulary ids from it on (the rows that pad the word embedding to a
multiple of make-vocab-size-divisible-by x mp) are out of the softmax: their logits count as -inf, whatever they
hold, so the loss is the one over the real vocabulary only and their gradient is exactly 0. Real 37 padded to 48
at mp2: rank 0 holds ids 0..23 (all real), rank 1 ids 24..47 of which its first 13 columns (24..36) are real.
`fused=True` computes the same loss with mpu/fused.py's compiled passes (the --torch-compile path); its backward
overwrites the logits with their gradient, so it is for logits nothing else uses (GPT2Model's).
"""
import torch
import torch.distributed as dist

from . import fused as compiled_ops
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size


def _vocab_range(partition_vocab_size, device, vocab_size=None):
    """(first vocabulary id of this rank's logits: an exclusive prefix sum of the partition widths, the whole
    vocabulary: their sum). An even split the caller names (`vocab_size` = width x ranks: the model's padded
    vocabulary) is rank x width: no all-reduce, no host sync; an uneven one is summed across the ranks."""
    world_size = get_model_parallel_world_size()
    if world_size == 1:
        return 0, partition_vocab_size
    if vocab_size is not None and vocab_size == partition_vocab_size * world_size:
        return get_model_parallel_rank() * partition_vocab_size, vocab_size
    widths = torch.zeros(world_size, dtype=torch.int64, device=device)
    widths[get_model_parallel_rank()] = partition_vocab_size
    dist.all_reduce(widths, group=get_model_parallel_group())
    return int(widths[:get_model_parallel_rank()].sum()), int(widths.sum())


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, real_vocab_size, vocab_size):
        group = get_model_parallel_group()
        local_target, outside, real = _local_target(target, vocab_parallel_logits, real_vocab_size, vocab_size)
        logits = vocab_parallel_logits.float()
        if real > 0:
            logits_max = logits[..., :real].amax(dim=-1)
        else:      # only padding here: another rank holds the maximum
            logits_max = logits.new_full(logits.shape[:-1], float("-inf"))
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)  # a new tensor: the caller's logits are untouched
        shifted[..., real:] = float("-inf")          # padded ids: exp 0, out of the sum and the gradient

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
        return grad_input.to(ctx.input_dtype), None, None, None


def _local_target(target, vocab_parallel_logits, real_vocab_size, vocab_size=None):
    """(target - this rank's first vocabulary id, 0 where outside; the mask of targets another rank holds; how
    many of this rank's columns are real ids, the rest being padding)."""
    width = vocab_parallel_logits.size(-1)
    vocab_start, vocab = _vocab_range(width, vocab_parallel_logits.device, vocab_size)
    if real_vocab_size is None:
        real_vocab_size = vocab
    elif not 0 < real_vocab_size <= vocab:
        raise ValueError(f"real_vocab_size {real_vocab_size} is larger than the vocabulary of the logits ({vocab})"
                         if real_vocab_size > 0 else f"real_vocab_size must be positive, got {real_vocab_size}")
    outside = (target < vocab_start) | (target >= vocab_start + width)
    real = min(width, max(0, real_vocab_size - vocab_start))
    return (target - vocab_start).masked_fill(outside, 0), outside, real


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss as _VocabParallelCrossEntropy: two compiled passes over the logits forward, one backward
    that writes the gradient into the saved logits."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, real_vocab_size, vocab_size):
        group = get_model_parallel_group()
        local_target, outside, real = _local_target(target, vocab_parallel_logits, real_vocab_size, vocab_size)
        logits_max = compiled_ops.logits_max(vocab_parallel_logits, real)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        predicted, sum_exp = compiled_ops.target_logit_and_sum_exp(vocab_parallel_logits, logits_max, local_target,
                                                                   outside, real)
        dist.all_reduce(predicted, group=group)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(vocab_parallel_logits, logits_max, sum_exp, local_target, outside)
        ctx.real = real
        return torch.log(sum_exp) - predicted

    @staticmethod
    def backward(ctx, grad_output):
        logits = ctx.saved_tensors[0]
        compiled_ops.cross_entropy_grad_(*ctx.saved_tensors, grad_output.contiguous(), ctx.real)
        return logits, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, fused=False, real_vocab_size=None, vocab_size=None):
    """Per-token loss [..] from logits [.., V/p] (this rank's vocabulary slice) and global target ids [..].
    fused: the compiled passes of mpu/fused.py (the same loss, fewer passes over the logits); backward then
    overwrites the logits with their gradient. real_vocab_size: ids from it on are padding, out of the softmax
    (None: every id is real). vocab_size: the whole (padded) vocabulary when it is split evenly, as the model's
    is: each rank's range follows without a collective (None: found by an all-reduce of the widths)."""
    function = _FusedVocabParallelCrossEntropy if fused else _VocabParallelCrossEntropy
    return function.apply(vocab_parallel_logits, target, real_vocab_size, vocab_size)
