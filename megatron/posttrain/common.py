"""What every post-training method shares: rows -> model inputs, preference pairs, the group reductions of the
logged metrics, the eval-mode switch and the frozen reference policy.

    tokens, labels, loss_mask, attention_mask, position_ids = model_inputs(rows, pack=False)    # SFT's rows
    tokens, labels, loss_mask, attention_mask, position_ids = pair_batch(data_iterator)         # DPO's, reward's
    totals = sum_over_group([loss_sum, count], "sft lm loss", mpu.get_data_parallel_group())   # one all-reduce
    with eval_mode(model): ...                                                                  # dropout off
    reference = Reference()                 # DPO's reference, RLHF's KL reference
    ref = reference.log_probs(model, tokens, position_ids, attention_mask, labels, loss_mask)  # [rows]

Rows (sft_data.assemble_row): tokens = text[:, :-1], labels = text[:, 1:], the mask of labels[t] is
loss_mask[:, t + 1]. Unpacked rows are causal as they are (padding comes after every real token, so nothing real
attends to it: attention_mask None, SDPA's own causal path); packed rows get a [b, 1, s, s] mask that keeps every
token inside its example and position ids that restart at 0 at each example (megatron.data.masks). A micro-batch of
b preference pairs is 2b rows (chosen, rejected, chosen, ...), padded to the longest.

The reference policy (Reference) is a deterministic function of the starting weights, computed under no_grad and
with dropout off (its log-probs never change from step to step):
- with LoRA (--lora-rank): the same model with its adapters disabled (mpu.adapters_disabled): the base weights are
  frozen, so that is exactly the starting model, at no memory cost and at any ZeRO stage;
- without LoRA: a frozen copy of the model taken at the run's first forward (before any update; requires_grad
  off, no optimizer state); at ZeRO-3 a copy of this rank's partitions only (1/dp of the weights), swapped in for
  the reference's forward (Stage3Parameters.swapped_partitions), so it is partitioned like the model. A resumed
  run's first forward sees trained weights: it reads the reference from a checkpoint instead (--dpo-reference DIR,
  train_rlhf.py's --reference-load: the --load the run started from), at any topology.
"""
import contextlib
import copy

import torch

import mpu
from megatron.cli import UserError
from megatron.data.masks import document_masks_and_position_ids
from megatron.guards import breadcrumbs

ROW_KEYS = ("text", "loss_mask", "segments")


def trim_to_longest(rows):
    """The rows cut after the last non-padding token of the longest one (padding to the longest in the batch).
    Called on the host rows, before they go to the device: the new length is read on the host (on device rows it
    would be a stream sync)."""
    used = rows["segments"].gt(0).any(dim=0).nonzero()
    length = int(used.max()) + 1 if used.numel() else 2
    return {key: value[:, :max(length, 2)].contiguous() for key, value in rows.items()}


def model_inputs(rows, pack):
    """tokens, labels [b, s] long; loss_mask [b, s] float; attention_mask None (causal) or bool [b, 1, s, s] (True
    = hidden); position_ids [b, s] long."""
    text, segments = rows["text"], rows["segments"]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()          # [b, s] each
    loss_mask = rows["loss_mask"][:, 1:].float()                                  # [b, s], aligned with labels
    if pack:
        inputs = segments[:, :-1]                                                 # [b, s]
        starts = torch.zeros_like(inputs, dtype=torch.bool)
        starts[:, 1:] = inputs[:, 1:] != inputs[:, :-1]
        attention_mask, position_ids = document_masks_and_position_ids(starts)
    else:
        attention_mask = None
        position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, attention_mask, position_ids


def pair_batch(data_iterator):
    """One micro-batch of pairs from the model-parallel group's rank 0 -> model inputs of its 2b rows (chosen,
    rejected interleaved), trimmed to the longest row: (tokens, labels, loss_mask, attention_mask, position_ids)."""
    data = next(data_iterator) if data_iterator is not None else None
    if data is not None:     # trimmed on the host, before the rows go to the device
        rows = {key: data[key].reshape(-1, data[key].size(-1)) for key in ROW_KEYS}   # [b, 2, S + 1] -> [2b, S + 1]
        data = trim_to_longest(rows)
    rows = mpu.broadcast_data(list(ROW_KEYS), data, torch.int64)                  # [2b, s + 1] each
    return model_inputs(rows, pack=False)


def sum_over_group(values, name, group):
    """[number or 0-d tensor, ...] summed over `group`: a float64 tensor on the model's device, one element per value
    (left on the device: the training loop reads a step's losses on the host once, training.losses_to_host). A
    Python number is filled in on the device (torch.as_tensor would copy it from the host and wait for the stream)."""
    device = mpu.get_device()
    tensor = torch.stack([v.to(device, torch.float64).reshape(()) if torch.is_tensor(v) else
                          torch.full((), v, dtype=torch.float64, device=device) for v in values])
    breadcrumbs.all_reduce(tensor, name, group=group)
    return tensor


def sequence_log_probs(per_token_losses, loss_mask):
    """[rows] the sum of log p(label) over the mask-1 positions, from the model's per-token losses (-log p)."""
    return -(per_token_losses.float() * loss_mask).sum(dim=-1)


@contextlib.contextmanager
def eval_mode(module):
    """`module` (and every submodule) in eval mode for the body (dropout off); its training flag as it was, after."""
    was_training = module.training
    module.train(False)
    try:
        yield
    finally:
        module.train(was_training)


class ReferencePolicyError(UserError, RuntimeError):
    """A reference policy that cannot be built; the message names the flags to change."""


class Reference:
    """The frozen reference policy's summed log-probs (the module docstring says which one)."""

    def __init__(self, resuming=False, checkpoint=None, flag="--dpo-reference"):
        self.resuming = resuming
        self.checkpoint = checkpoint   # --dpo-reference: where a resumed run reads the reference weights
        self.flag = flag               # that flag's name, for the message when it is missing
        self.frozen = None             # the copy without LoRA, taken at the first call
        self.partitions = None         # at ZeRO-3 without LoRA: this rank's partitions of the reference weights

    def log_probs(self, model, tokens, position_ids, attention_mask, labels, loss_mask):
        """[rows] the reference's summed log-probs of the mask-1 labels."""
        return sequence_log_probs(self.per_token_losses(model, tokens, position_ids, attention_mask, labels),
                                  loss_mask)

    def per_token_losses(self, model, tokens, position_ids, attention_mask, labels):
        """[rows, s] the reference's -log p(label) per token (train_rlhf.py's reference log-probs negate them)."""
        from megatron.utils import unwrap_model
        module = unwrap_model(model)
        with torch.no_grad():
            if mpu.has_adapters(module):
                with mpu.adapters_disabled(module), eval_mode(model):
                    losses = model(tokens, position_ids, attention_mask, labels=labels)
            elif getattr(model, "stage3", None) is not None:     # ZeRO-3: the reference partitioned too
                if self.partitions is None:
                    self.partitions = self._reference_partitions(model, module)
                with model.stage3.swapped_partitions(self.partitions), eval_mode(model):
                    losses = model(tokens, position_ids, attention_mask, labels=labels)
            else:
                if self.frozen is None:
                    self.frozen = self._copy(module)
                losses = self.frozen(tokens, position_ids, attention_mask, labels=labels)
        return losses

    def _starting_weights(self, module):
        """{name: this rank's tensor} of the reference checkpoint (a resumed run), or None (the model's own weights
        are the starting ones)."""
        if not self.resuming:
            return None
        if self.checkpoint is None:
            raise ReferencePolicyError("a reference policy without LoRA is the starting weights, "
                                    f"which a resumed run no longer has: pass {self.flag} DIR (the checkpoint "
                                    "it started from), or train with --lora-rank (the reference is then the base)")
        from megatron.checkpoint import reshard
        saved = reshard.SavedCheckpoint(self.checkpoint)
        world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        weights = {}
        for name, param in module.named_parameters():
            rows = mpu.full_shape(param)[0] * world if reshard.partitioning(name)[2] else None
            weights[name] = saved.shard(name, "weight", world, rank, rows)
        return weights

    def _reference_partitions(self, model, module):
        """This rank's partitions of the reference weights: a copy of the engine's at the first forward (the
        starting weights), or, resumed, read from the reference checkpoint into the same layout."""
        partitions = [group.partition.clone() for group in model.stage3.groups]
        weights = self._starting_weights(module)
        if weights is not None:
            name_of = {id(p): n for n, p in module.named_parameters()}
            for group, partition in zip(model.stage3.groups, partitions):
                start, end = group.own_range
                for index, lo, hi in group.segments(start, end):
                    p_start = group.offsets[index][0]
                    value = weights[name_of[id(group.params[index])]].reshape(-1).to(partition.dtype)
                    partition[lo - start:hi - start].copy_(value[lo - p_start:hi - p_start])
        return partitions

    def _copy(self, module):
        weights = self._starting_weights(module)
        frozen = copy.deepcopy(module)
        for name, param in frozen.named_parameters():
            param.requires_grad_(False)
            param.grad = None
            if weights is not None:
                param.data.copy_(weights[name])
        return frozen.train(False)
