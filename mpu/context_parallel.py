"""Context parallelism (Megatron-LM's --context-parallel-size): the sequence split over C ranks, attention computed
ring-style.

Layout (load-balanced for the causal mask, Megatron-LM's): the sequence of s tokens is cut into 2C chunks of
s / 2C; context-parallel rank i holds chunks i and 2C - 1 - i, in that order, so every rank has the same amount
of causal work. Example, C = 2, s = 8 (chunks of 2):

    positions   0 1 | 2 3 | 4 5 | 6 7
    chunk         0     1     2     3
    rank 0 holds chunks 0, 3: positions 0 1 6 7
    rank 1 holds chunks 1, 2: positions 2 3 4 5

Everything outside attention (embeddings, MLP, norms, loss) is per token, so each rank runs it on its 2 chunks only;
positions (learned or rotary) are the held tokens' global ones (context_parallel_positions).

Ring attention (`ring_attention(q, k, v)`): each rank keeps its queries; the key/value blocks travel around the
ring (rank r sends to r + 1 and receives from r - 1, async p2p overlapping the block's compute), and the partial
results merge by their log-sum-exp (the online softmax). With the layout above, at step t rank r holds the
keys/values of rank j = r - t (mod C):

    t = 0:   its own: causal over its 2 chunks (their positions increase, so local causal = global causal)
    j < r:   all its queries see only j's first chunk (j < r <= 2C - 1 - r < 2C - 1 - j), unmasked
    j > r:   only its second chunk's queries (2C - 1 - r) see both of j's chunks, unmasked

Backward (a custom autograd.Function, as Megatron-LM's/torchtitan's): the key/value blocks go around again with
the gradients of their keys/values travelling with them; after C steps each gradient has visited every rank and
reaches its owner. The blocks' probabilities are recomputed from the saved log-sum-exp: memory per rank is O(s/C)
between forward and backward, plus one block's scores at a time.
"""
import math

import torch
import torch.distributed as dist

from .initialize import get_context_parallel_global_ranks, get_context_parallel_group, \
    get_context_parallel_rank, get_context_parallel_world_size


class SequenceLengthError(ValueError):
    """A sequence length the context-parallel layout cannot split (not a multiple of 2C)."""


def sequence_length_problem(seq_length, cp_size, names=("the sequence length", "context-parallel size")):
    """Why `seq_length` cannot be split over `cp_size` ranks, or None; `names` are how the caller calls the two (the
    command line: its flags): "--seq-length (126) is not divisible by 2C = 4 (--context-parallel-size 2): ..."."""
    if seq_length % (2 * cp_size) == 0:
        return None
    length, size = names
    return (f"{length} ({seq_length}) is not divisible by 2C = {2 * cp_size} ({size} {cp_size}): each rank holds "
            f"2 of the 2C chunks; use a multiple of {2 * cp_size}")


def check_sequence_length(seq_length, cp_size):
    problem = sequence_length_problem(seq_length, cp_size)
    if problem:
        raise SequenceLengthError(problem)


def held_positions(seq_length, cp_size, cp_rank, device=None):
    """Global positions of the tokens context-parallel rank `cp_rank` holds (chunks cp_rank and 2C-1-cp_rank),
    a long tensor [s / C]."""
    check_sequence_length(seq_length, cp_size)
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat((first, second))


def context_parallel_positions(local_length, batch_size, device):
    """Position ids [b, s / C] of this rank's tokens when it holds `local_length` = s / C of a sequence of s."""
    cp = get_context_parallel_world_size()
    positions = held_positions(local_length * cp, cp, get_context_parallel_rank(), device)
    return positions.unsqueeze(0).expand(batch_size, local_length)


def slice_for_context_parallel(tensor, seq_dim=1):
    """This context-parallel rank's chunks (i and 2C - 1 - i) of `tensor` along `seq_dim` (the whole sequence);
    `tensor` itself at C = 1."""
    cp = get_context_parallel_world_size()
    if tensor is None or cp == 1:
        return tensor
    index = held_positions(tensor.size(seq_dim), cp, get_context_parallel_rank(), tensor.device)
    return tensor.index_select(seq_dim, index)


# ------------------------------------------------------------------------------------------------------- blocks

def _expand_kv(t, group):
    """[b, n_kv, t, d] -> [b, n_kv * group, t, d] (key/value head j serves query heads j*group .. j*group+group-1)."""
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold_kv_grad(grad, group):
    """The gradient of _expand_kv: sum over each key/value head's query-head group."""
    if group == 1:
        return grad
    b, n, t, d = grad.shape
    return grad.view(b, n // group, group, t, d).sum(dim=2)


def accumulation_dtype(dtype):
    """Scores, softmax statistics and outputs in fp32 at least (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q, k, scale, causal, row_offset):
    """q k^T scale [b, n, sq, sk] in accumulation_dtype; causal: query row i (at row_offset + i of the block)
    sees keys 0 .. row_offset + i (the block's positions increase along both)."""
    acc = accumulation_dtype(q.dtype)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)).mul_(scale)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(row_offset + 1)
        scores.masked_fill_(future, float("-inf"))
    return scores


def _block_forward(q, k, v, scale, causal, row_offset=0):
    """One block: (out [b, n, sq, d], lse [b, n, sq], both in accumulation_dtype) of softmax(q k^T scale) v."""
    scores = _scores(q, k, scale, causal, row_offset)                               # [b, n, sq, sk]
    lse = torch.logsumexp(scores, dim=-1)                                            # [b, n, sq]
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()                                   # in place: one s x s buffer
    return torch.matmul(probs, v.to(probs.dtype)), lse                              # [b, n, sq, d]


def _block_backward(q, k, v, out, lse, grad_out, scale, causal, row_offset=0):
    """Gradients (dq, dk, dv) in accumulation_dtype of one block given the *final* out and lse of these query rows
    (the flash attention backward: P = exp(q k^T scale - lse), dS = P (dO V^T - rowsum(dO O)))."""
    probs = _scores(q, k, scale, causal, row_offset).sub_(lse.unsqueeze(-1)).exp_()  # [b, n, sq, sk]
    acc = probs.dtype
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    grad_v = torch.matmul(probs.transpose(-1, -2), grad_out)                         # [b, n, sk, d]
    delta = (grad_out * out).sum(dim=-1, keepdim=True)                               # [b, n, sq, 1]
    grad_scores = torch.matmul(grad_out, vf.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
    del probs
    return torch.matmul(grad_scores, kf), torch.matmul(grad_scores.transpose(-1, -2), qf), grad_v


SCORE_ELEMENTS = 2 ** 22    # a block's scores are computed a few query rows at a time, at most this many (16 MiB)


def _rows_per_piece(q, k):
    b, n, _, _ = q.shape
    return max(1, SCORE_ELEMENTS // max(1, b * n * k.size(2)))


def _forward_by_rows(q, k, v, scale, causal):
    """_block_forward over pieces of the query rows, so one block's transient scores stay under SCORE_ELEMENTS
    however long the sequence (rows are independent in forward)."""
    rows = _rows_per_piece(q, k)
    pieces = [_block_forward(q[:, :, start:start + rows], k, v, scale, causal, start)
              for start in range(0, q.size(2), rows)]
    return tuple(torch.cat(parts, dim=2) for parts in zip(*pieces))


def _backward_by_rows(q, k, v, out, lse, grad_out, scale, causal):
    """_block_backward over pieces of the query rows: dq by rows, dk and dv summed over the pieces."""
    rows = _rows_per_piece(q, k)
    grad_q, grad_k, grad_v = [], None, None
    for start in range(0, q.size(2), rows):
        piece = slice(start, start + rows)
        dq, dk, dv = _block_backward(q[:, :, piece], k, v, out[:, :, piece], lse[:, :, piece],
                                     grad_out[:, :, piece], scale, causal, start)
        grad_q.append(dq)
        grad_k, grad_v = (dk, dv) if grad_k is None else (grad_k.add_(dk), grad_v.add_(dv))
    return torch.cat(grad_q, dim=2), grad_k, grad_v


def _cpu_kernel_forward(q, k, v, scale, causal):
    """One block through SDPA's fused CPU flash kernel, which returns the log-sum-exp too (no s x s scores)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    acc = accumulation_dtype(q.dtype)
    return out.to(acc), lse.to(acc)


def _cpu_kernel_backward(q, k, v, out, lse, grad_out, scale, causal):
    """The fused CPU kernel's backward of one block, given the final out and lse of these rows (as the math path)."""
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), 0.0, causal, scale=scale)
    return tuple(grad.to(accumulation_dtype(q.dtype)) for grad in grads)


def _flash_kernel_forward(q, k, v, scale, causal):
    """One block through SDPA's CUDA flash kernel (16-bit in, the log-sum-exp out in fp32): no s x s scores, no fp32
    copies of q, k, v. The merge of the blocks stays in fp32 (accumulation_dtype)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out.float(), lse.float()


def _flash_kernel_backward(q, k, v, out, lse, grad_out, scale, causal):
    """The CUDA flash kernel's backward of one block given the *final* out and lse of these rows (as the math path:
    P = exp(q k^T scale - lse), delta = rowsum(dO O)); dropout 0, so its RNG state arguments are never read."""
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)      # the forward's shapes (torch's meta registration)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(   # None: not variable-length (as forward)
        grad_out.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.float().contiguous(),
        None, None, q.size(2), k.size(2), 0.0, causal, seed, offset, scale=scale)
    return tuple(grad.float() for grad in grads)


CPU_FUSED_KERNEL = True     # False: the math path on the CPU too (the tests run both)


def flash_kernel_fits(q):
    """SDPA's CUDA flash kernel takes q: fp16/bf16, a head size that is a multiple of 8 up to 256, sm80 or newer."""
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0
            and q.size(-1) <= 256 and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _block_kernels(q):
    """(forward, backward) of one block for query tensor `q`: SDPA's fused flash kernel on the CPU (where torch has
    it) and on CUDA for 16-bit q (flash_kernel_fits); otherwise (fp32 on CUDA, other devices) the math path in
    pieces of query rows."""
    if CPU_FUSED_KERNEL and q.device.type == "cpu" and \
            hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return _cpu_kernel_forward, _cpu_kernel_backward
    if flash_kernel_fits(q):
        return _flash_kernel_forward, _flash_kernel_backward
    return _forward_by_rows, _backward_by_rows


def _merge(out, lse, block_out, block_lse, rows=None):
    """Online-softmax merge of a block's (out, lse) into the running (out, lse), in place, for query rows `rows`
    (a slice; None: all)."""
    rows = slice(None) if rows is None else rows
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[:, :, rows] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + \
        block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    lse[:, :, rows] = new_lse


def _step_plan(step, rank, cp, chunk):
    """(query rows, key/value rows, causal) of ring step `step` on rank `rank` (see the module docstring)."""
    source = (rank - step) % cp
    if step == 0:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, 2 * chunk), slice(None), False


# --------------------------------------------------------------------------------------------------------- ring

class _Ring:
    """Async p2p to the next rank and from the previous one of the context-parallel ring."""

    def __init__(self):
        ranks, rank = get_context_parallel_global_ranks(), get_context_parallel_rank()
        self.group = get_context_parallel_group()
        self.next, self.prev = ranks[(rank + 1) % len(ranks)], ranks[(rank - 1) % len(ranks)]

    def start(self, send, tag):
        """Send `send` on and receive a tensor of its shape from behind; returns (received, handles). One batch
        (batch_isend_irecv, as Megatron-LM's ring): at C = 2 next and previous are the same rank, and NCCL
        deadlocks on a send and a receive to one peer posted one after the other on both sides."""
        received = torch.empty_like(send)
        handles = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group, tag),
                                          dist.P2POp(dist.irecv, received, self.prev, self.group, tag)])
        return received, handles


def _wait(handles):
    for handle in handles:
        handle.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys/values (module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        # q: [b, n, 2T, d]; k, v: [b, n_kv, 2T, d] (this rank's two chunks of T tokens)
        cp, rank, ring = get_context_parallel_world_size(), get_context_parallel_rank(), _Ring()
        chunk, group = q.size(2) // 2, q.size(1) // k.size(1)
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()                                        # [2, b, n_kv, 2T, d]
        block_forward, _ = _block_kernels(q)
        for step in range(cp):
            handles = []
            if step < cp - 1:
                next_kv, handles = ring.start(kv, tag=0)
            rows, cols, causal = _step_plan(step, rank, cp, chunk)
            block_out, block_lse = block_forward(q[:, :, rows], _expand_kv(kv[0][:, :, cols], group),
                                                 _expand_kv(kv[1][:, :, cols], group), scale, causal)
            _merge(out, lse, block_out, block_lse, rows)
            _wait(handles)
            if step < cp - 1:
                kv = next_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse = ctx.saved_tensors
        cp, rank, ring = get_context_parallel_world_size(), get_context_parallel_rank(), _Ring()
        chunk, group = q.size(2) // 2, q.size(1) // k.size(1)
        acc = accumulation_dtype(q.dtype)
        grad_output = grad_output.to(acc)
        grad_q = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        grad_kv = torch.zeros(kv.shape, dtype=acc, device=q.device)                # of the block held now
        _, block_backward = _block_kernels(q)
        for step in range(cp):
            handles = []
            if step < cp - 1:
                next_kv, handles = ring.start(kv, tag=1)
            rows, cols, causal = _step_plan(step, rank, cp, chunk)
            dq, dk, dv = block_backward(q[:, :, rows], _expand_kv(kv[0][:, :, cols], group),
                                        _expand_kv(kv[1][:, :, cols], group), out[:, :, rows], lse[:, :, rows],
                                        grad_output[:, :, rows], ctx.scale, causal)
            grad_q[:, :, rows] += dq
            grad_kv[0][:, :, cols] += _fold_kv_grad(dk, group)
            grad_kv[1][:, :, cols] += _fold_kv_grad(dv, group)
            if cp > 1:   # on with its block: after C sends each block's gradient is home, whole
                next_grad_kv, grad_handles = ring.start(grad_kv, tag=2)
                _wait(handles + grad_handles)
                grad_kv = next_grad_kv
            if step < cp - 1:
                kv = next_kv
        grad_k, grad_v = grad_kv.to(k.dtype).unbind(0)
        return grad_q.to(q.dtype), grad_k, grad_v, None


def ring_attention(q, k, v, scale=None):
    """Causal attention over the whole sequence for this context-parallel rank's queries: q [b, n, s/C, d] and
    k, v [b, n_kv, s/C, d] (n a multiple of n_kv: grouped-query attention) hold the rank's chunks i and 2C-1-i.
    Returns [b, n, s/C, d] in q's dtype (accumulated in fp32). Every rank of the group calls it (p2p inside)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return RingAttention.apply(q, k, v, scale)
