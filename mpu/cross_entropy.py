"""Cross entropy over logits whose vocabulary dimension is split across model-parallel ranks.

Each rank holds logits for a contiguous vocabulary range (ranges may be uneven: rank r's range starts at the
sum of the lower ranks' widths). The exact loss comes without ever gathering the full [.., V] logits, from two
all-reduces over all tokens at once (not per chunk): the max, then the sum of exponentials and the target logit
together (one [2, tokens] tensor). The input is never modified.

Chunked over tokens: forward and backward each walk the tokens in chunks of `chunk_tokens` rows, compute in fp32
on that chunk only, and keep per token only fp32 statistics (the max, the sum of exponentials). Per chunk, the
forward takes this rank's max and the target logit, then sums exp(logits - local max); the backward recomputes
softmax - one_hot from the saved logits and the two statistics and writes it, in the logits' dtype, into the
gradient. With tokens T, this rank's width W and logits of e bytes an element (2 in bf16):

    held from forward to backward   the logits themselves (e T W: saved, not copied) + per token 2 fp32 numbers
                                    and the target
    peak, backward                  e T W (logits) + e T W (their gradient) + 4 x chunk_tokens x W (fp32 scratch)

so at bf16 no fp32 tensor of the logits' size is ever written (the unchunked loss wrote six, and held 10 bytes
per logit at its peak against 4 here: tests/model/test_chunked_cross_entropy.py counts them). The default chunk
holds CHUNK_ELEMENTS[device type] logits: on a GPU 2^24 (64 MiB of fp32 scratch, 333 tokens at W = 50304; fewer,
larger chunks keep kernel launches few). On the CPU the default is the unchunked loss (_VocabParallelCrossEntropy):
at two threads on a loaded machine every op of the chunked one waits at OpenMP's barrier for a descheduled thread
(1.1-1.6x slower at its best chunk, 2^21 logits: tools/bench/bench_loss.py; docs/benchmarks.md), and the default
data's published numbers come from the unchunked loss; chunk_tokens= asks for the chunked one there.

Across ranks each rank sums exp(logit - its own max) and scales the sum by exp(own max - global max) before the
all-reduce: the same sum as exp(logit - global max) up to fp32 rounding (at mp 1 the scale is exactly 1).

Padding: with `real_vocab_size` given, vocabulary ids from it on (the rows that pad the word embedding to a
multiple of make-vocab-size-divisible-by x mp) are out of the softmax: their logits are never read, whatever they
hold, so the loss is the one over the real vocabulary only and their gradient is exactly 0. Real 37 padded to 48
at mp2: rank 0 holds ids 0..23 (all real), rank 1 ids 24..47 of which its first 13 columns (24..36) are real.
`fused=True` computes the same loss with mpu/fused.py's compiled passes (the --torch-compile path); its backward
overwrites the logits with their gradient, so it is for logits nothing else uses (GPT2Model's).
"""
import torch
import torch.distributed as dist

from . import fused as compiled_ops
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size

CHUNK_ELEMENTS = {"cpu": 2 ** 21, "cuda": 2 ** 24}   # logits per chunk by default, by device type


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


def default_chunk_tokens(width, device_type="cuda"):
    """Tokens per chunk for a rank's vocabulary width on a device type: CHUNK_ELEMENTS logits (a GPU's for any
    device type not named there), at least one token."""
    return max(1, CHUNK_ELEMENTS.get(device_type, CHUNK_ELEMENTS["cuda"]) // width)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The unchunked loss (three all-reduces, an fp32 softmax kept for backward): the CPU default, whose numbers
    the README's runs print; the chunked one equals it to fp32 rounding, not bit for bit."""

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


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, real_vocab_size, vocab_size, chunk_tokens):
        local_target, outside, real = _local_target(target, vocab_parallel_logits, real_vocab_size, vocab_size)
        width = vocab_parallel_logits.size(-1)
        logits = vocab_parallel_logits.reshape(-1, width)                   # [T, W], a view when contiguous
        local_target, outside = local_target.reshape(-1), outside.reshape(-1)   # [T]
        tokens = logits.size(0)
        local_max = logits.new_full((tokens,), float("-inf"), dtype=torch.float32)  # -inf: only padding here
        sums = logits.new_zeros((2, tokens), dtype=torch.float32)           # [sum of exp, target logit] per token
        sum_exp, predicted = sums[0], sums[1]
        if real > 0:
            for start in range(0, tokens, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                chunk = logits[rows, :real]                                  # [c, real] in the logits' dtype
                chunk_max = chunk.amax(dim=-1).float()                       # exact: a max needs no upcast
                local_max[rows] = chunk_max
                shifted = chunk - chunk_max.unsqueeze(-1)                    # fp32 [c, real]: the only scratch
                sum_exp[rows] = shifted.exp_().sum(dim=-1)
                predicted[rows] = logits[rows].gather(-1, local_target[rows].unsqueeze(-1)).squeeze(-1).float()
        # A target in this rank's padding (never in real data) has no probability: loss +inf.
        predicted.masked_fill_(~outside & (local_target >= real), float("-inf"))
        predicted.masked_fill_(outside, 0.0)

        global_max = local_max.clone()
        if get_model_parallel_world_size() > 1:
            group = get_model_parallel_group()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sum_exp.mul_((local_max - global_max).exp_())                    # exp(l - own max) -> exp(l - max)
            dist.all_reduce(sums, group=group)
        loss = torch.log(sum_exp) - (predicted - global_max)
        ctx.save_for_backward(vocab_parallel_logits, global_max, sum_exp, local_target, outside)
        ctx.real, ctx.chunk_tokens = real, chunk_tokens
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        saved_logits, global_max, sum_exp, local_target, outside = ctx.saved_tensors
        real, chunk_tokens = ctx.real, ctx.chunk_tokens
        width = saved_logits.size(-1)
        logits = saved_logits.reshape(-1, width)                            # [T, W]
        grad_output = grad_output.reshape(-1)                               # [T]
        grad = torch.empty_like(logits)                                     # [T, W] in the logits' dtype
        grad[:, real:] = 0.0                                                # padding: exactly 0
        # d loss / d logit = (softmax - one_hot(target)) x grad_output; the one-hot is 0 where another rank (or
        # this rank's padding) holds the target.
        # exp(logit - max) is exact to an ulp or two (exp of a difference, never of a large logit), then one
        # multiply by grad_output / sum_exp per token.
        global_max = global_max.unsqueeze(-1)                               # [T, 1]
        scale = (grad_output.float() / sum_exp).unsqueeze(-1)               # [T, 1]
        hit = ~outside.unsqueeze(-1) & (local_target < real).unsqueeze(-1)
        target_grad = -grad_output.float().unsqueeze(-1) * hit             # [T, 1]
        index = local_target.clamp(max=max(real - 1, 0)).unsqueeze(-1)     # [T, 1]
        for start in range(0, logits.size(0) if real > 0 else 0, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk_grad = (logits[rows, :real] - global_max[rows]).exp_()    # fp32 [c, real]
            chunk_grad.mul_(scale[rows])                                    # softmax x grad_output
            chunk_grad.scatter_add_(-1, index[rows], target_grad[rows])
            grad[rows, :real] = chunk_grad                                  # cast to the logits' dtype
        return grad.view(saved_logits.shape), None, None, None, None


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


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, fused=False, real_vocab_size=None, vocab_size=None,
                                 chunk_tokens=None):
    """Per-token fp32 loss [..] from logits [.., V/p] (this rank's vocabulary slice, any float dtype) and global
    target ids [..]. fused: the compiled passes of mpu/fused.py (the same loss, fewer passes over the logits);
    backward then overwrites the logits with their gradient. real_vocab_size: ids from it on are padding, out of the
    softmax (None: every id is real). vocab_size: the whole (padded) vocabulary when it is split evenly, as the
    model's is: each rank's range follows without a collective (None: found by an all-reduce of the widths).
    chunk_tokens: tokens per chunk of the eager loss (None: default_chunk_tokens for V/p and the logits' device,
    except on the CPU, where None is the unchunked loss); the loss is the same for any value, to fp32 rounding."""
    if fused:
        return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, real_vocab_size, vocab_size)
    if chunk_tokens is None and vocab_parallel_logits.device.type == "cpu":
        # The CPU default stays the unchunked loss: at two threads on a loaded machine the chunked one measured
        # 1.1-1.6x slower (docs/benchmarks.md), and the default data's published numbers come from it.
        return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, real_vocab_size, vocab_size)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab_parallel_logits.size(-1), vocab_parallel_logits.device.type)
    elif chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return _ChunkedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, real_vocab_size, vocab_size,
                                                   chunk_tokens)
