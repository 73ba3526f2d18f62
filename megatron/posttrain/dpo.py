"""Direct Preference Optimization (Rafailov et al. 2023), the sigmoid loss, on preference pairs
(tools/preprocess_sft_data.py --preference; sft_dataset.PreferenceDataset) for finetune_gpt.py --objective dpo.

    loss = -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r)))        mean over the pairs of the global batch

logp = the sum of the response tokens' log-probabilities (mask 1: the answer and its end-of-text) under the policy
being trained; ref = the same under the reference policy, the starting weights, frozen. Metrics (TRL's names):
rewards/chosen = beta (logp_c - ref_c) and rewards/rejected = beta (logp_r - ref_r) (means over the pairs),
rewards/margins = their difference's mean, rewards/accuracies = the fraction of pairs with rewards/chosen >
rewards/rejected.

The reference is computed in the same step as the policy, under no_grad and with dropout off: common.Reference
(the model with its LoRA adapters off, or a frozen copy of the starting weights; a resumed run reads them from
--dpo-reference DIR, which finetune_gpt.py fills with the --load the run started from). Rows: common.pair_batch (a
micro-batch of b pairs is 2b rows); no packing, no pipeline parallelism (the frozen copy and the per-row sums need the
whole model on one stage).
"""
import torch.nn.functional as F

import mpu

from .common import Reference, pair_batch, sequence_log_probs, sum_over_group  # noqa: F401  (dpo.Reference: DPO's)

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
    """(per-pair losses [n], chosen rewards [n], rejected rewards [n]) from per-pair summed log-probs [n]."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


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
