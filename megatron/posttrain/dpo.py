"""Direct Preference Optimization (Rafailov et al. 2023), the sigmoid loss, on preference pairs
(tools/preprocess_sft_data.py --preference; sft_dataset.PreferenceDataset) for finetune_gpt.py --objective dpo.

    loss = -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))        mean over the pairs of the global batch

logp = the sum of the response tokens' log-probabilities (mask 1: the answer and its end-of-text) under the policy
being trained; ref = the same under the reference policy, the starting weights, frozen. Metrics (TRL's names):
rewards/chosen = beta (logp_c - ref_c) and rewards/rejected = beta (logp_r - ref_r) (means over the pairs),
rewards/margins = their difference's mean, rewards/accuracies = the fraction of pairs with rewards/chosen >
rewards/rejected.

The reference is computed in the same step as the policy, under no_grad and with dropout off (a deterministic
function of the starting weights: its log-probs never change from step to step):
- with LoRA (--lora-rank): the same model with its adapters disabled (mpu.adapters_disabled): the base weights are
  frozen, so that is exactly the starting model, at no memory cost and at any ZeRO stage;
- without LoRA: a frozen copy of the model taken at the run's first forward (before any update; requires_grad
  off, no optimizer state); at ZeRO-3 a copy of this rank's partitions only (1/dp of the weights), swapped in for
  the reference's forward (Stage3Parameters.swapped_partitions), so it is partitioned like the model. A resumed
  run's first forward sees trained weights: it reads the reference from --dpo-reference DIR instead (finetune_gpt.py
  passes the --load the run started from), at any topology.
Rows: a micro-batch of b pairs is 2b rows (chosen, rejected, chosen, ...), padded to the longest; no packing, no
pipeline parallelism (the frozen copy and the per-row sums need the whole model on one stage).
"""
import contextlib
import copy

import torch
import torch.nn.functional as F

import mpu
from megatron.cli import UserError

from .sft_loss import ROW_KEYS, model_inputs, sum_over_group, trim_to_longest

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class DPOReferenceError(UserError, RuntimeError):
    """A reference policy that cannot be built; the message names the flags to change."""


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    """(per-pair losses [n], chosen rewards [n], rejected rewards [n]) from per-pair summed log-probs [n]."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def sequence_log_probs(per_token_losses, loss_mask):
    """[rows] the sum of log p(label) over the mask-1 positions, from the model's per-token losses (-log p)."""
    return -(per_token_losses.float() * loss_mask).sum(dim=-1)


def pair_batch(data_iterator):
    """One micro-batch of pairs from the model-parallel group's rank 0 -> model inputs of its 2b rows (chosen,
    rejected interleaved), trimmed to the longest row: (tokens, labels, loss_mask, attention_mask, position_ids)."""
    data = next(data_iterator) if data_iterator is not None else None
    if data is not None:     # trimmed on the host, before the rows go to the device
        rows = {key: data[key].reshape(-1, data[key].size(-1)) for key in ROW_KEYS}   # [b, 2, S + 1] -> [2b, S + 1]
        data = trim_to_longest(rows)
    rows = mpu.broadcast_data(list(ROW_KEYS), data, torch.int64)                  # [2b, s + 1] each
    return model_inputs(rows, pack=False)


@contextlib.contextmanager
def _eval_mode(module):
    was_training = module.training
    module.train(False)
    try:
        yield
    finally:
        module.train(was_training)


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
                with mpu.adapters_disabled(module), _eval_mode(model):
                    losses = model(tokens, position_ids, attention_mask, labels=labels)
            elif getattr(model, "stage3", None) is not None:     # ZeRO-3: the reference partitioned too
                if self.partitions is None:
                    self.partitions = self._reference_partitions(model, module)
                with model.stage3.swapped_partitions(self.partitions), _eval_mode(model):
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
            raise DPOReferenceError("a reference policy without LoRA is the starting weights, "
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


def dpo_forward_step(reference, beta, data_iterator, model):
    """finetune_gpt.py's forward step for --objective dpo: (the micro-batch's mean pair loss, for the backward;
    {"lm loss": the DPO loss, TRL's rewards/*} as (sum, count) pairs summed over the data-parallel group). Every
    micro-batch holds the same number of pairs, so the loop's averaging gives the global batch's pair mean."""
    tokens, labels, loss_mask, attention_mask, position_ids = pair_batch(data_iterator)
    ref = reference.log_probs(model, tokens, position_ids, attention_mask, labels, loss_mask).view(-1, 2)
    policy = sequence_log_probs(model(tokens, position_ids, attention_mask, labels=labels), loss_mask).view(-1, 2)
    losses, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta)
    sums = [losses.detach().sum(), chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
            (chosen > rejected).float().sum(), losses.numel()]     # tensors: read on the host once a step
    totals = sum_over_group(sums, "dpo metrics", mpu.get_data_parallel_group())
    count = totals[-1]
    reported = {"lm loss": (totals[0], count)}
    reported.update({name: (value, count) for name, value in zip(METRICS, totals[1:5])})
    return losses.mean(), reported
