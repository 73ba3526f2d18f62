"""What the training loop does for context parallelism (--context-parallel-size C; the attention itself is
mpu/context_parallel.py): each rank keeps its 2 chunks of every micro-batch, and the loss is the mean over the
whole sequence's tokens.

    tokens, labels, loss_mask, attention_mask, position_ids = batch_on_this_context_parallel_rank(
        tokens, labels, loss_mask, attention_mask, position_ids)       # [b, s] -> [b, s/C]
    loss, reported = masked_token_mean(losses, loss_mask)               # backward on loss, log reported

Both are the identity at C = 1 (the same operations as without context parallelism, so a C = 1 run is bitwise
the run before context parallelism existed).

The loss (Megatron-LM's): every rank of a context-parallel group sees the same samples, a different part of each.
Gradients are averaged over data x context parallel ranks (mpu.get_data_parallel_group(with_context_parallel=True),
which the engine and the data-parallel wrappers reduce over), so each rank backpropagates
    C x (its masked loss sum) / (the whole sequence's mask count)
whose average over the C ranks is the gradient of the whole sequence's masked mean. The count is summed over the
group first (no gradient flows through it).
"""
import torch

import mpu
from megatron.guards import breadcrumbs


def batch_on_this_context_parallel_rank(*tensors):
    """Each [b, s, ...] tensor cut to this rank's chunks i and 2C-1-i along the sequence ([b, s/C, ...]); None
    stays None (a causal attention mask). A 4-d attention mask [b, 1, s, s] is refused (ring attention is causal)."""
    if mpu.get_context_parallel_world_size() == 1:
        return tensors
    if any(t is not None and t.dim() == 4 for t in tensors):
        raise ValueError("context parallelism runs causal attention: no attention mask (--reset-attention-mask)")
    return tuple(mpu.slice_for_context_parallel(t, seq_dim=1) for t in tensors)


def masked_token_mean(losses, loss_mask):
    """(loss to backpropagate, the whole sequence's masked mean for logging) of per-token `losses` and
    `loss_mask` [b, s/C] (module docstring). At C = 1 both are sum(losses x mask) / sum(mask)."""
    local_sum = torch.sum(losses.float().view(-1) * loss_mask.view(-1))
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        loss = local_sum / loss_mask.sum()
        return loss, loss
    totals = torch.stack((local_sum.detach(), loss_mask.sum().float()))
    breadcrumbs.all_reduce(totals, "context-parallel loss sum and count", group=mpu.get_context_parallel_group())
    return local_sum * cp / totals[1], totals[0] / totals[1]
