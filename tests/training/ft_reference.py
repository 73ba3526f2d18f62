"""The fault-injection run's settings (tests/training/test_ft_heal.py) and its single-process reference: plain
torch AdamW and clip_grad_norm_ on the same GPT2Model, each iteration trained on the samples (MockGPTDataset, by
global index) of the groups in that iteration's quorum."""
import numpy as np
import torch

from megatron.data.samplers import MegatronPretrainingSampler
from tests.helpers import MOCK_VOCAB, NO_DROPOUT, TINY_SHAPE

ITERS = 26
MICRO, ACCUMULATION, GROUPS = 2, 2, 2
GLOBAL = MICRO * ACCUMULATION * GROUPS
CLIP = 0.05      # below the gradient norm: the clip coefficient needs the norm of the groups' averaged gradients
MODEL = MOCK_VOCAB + TINY_SHAPE + NO_DROPOUT + [
    "--batch-size", str(MICRO), "--train-iters", str(ITERS), "--log-interval", "1", "--eval-iters", "0",
    "--lr", "1e-3", "--warmup", "0", "--lr-decay-style", "constant", "--seed", "7", "--clip-grad", str(CLIP),
    "--global-batch-size", str(MICRO * ACCUMULATION)]


def replayed_shares(quorums):
    """--ft-replay-dropped's order, from the quorums: {iteration: [group g's share (global sample indices, in the
    order its micro batches read them)]}, {iteration: how many of them were replayed} and what is left queued. Each step takes up to GROUPS shares dropped
    before (oldest first), then fresh ones: a group sampler's (data-parallel rank j of the fresh shares' count)
    first ACCUMULATION batches from the fresh position, which advances by the fresh shares only."""
    queue, consumed, shares, replayed = [], 0, {}, {}
    for iteration in range(1, ITERS + 1):
        replayed[iteration] = min(len(queue), GROUPS)
        fresh = GROUPS - replayed[iteration]
        shares[iteration] = queue[:replayed[iteration]] + [
            [i for batch in list(MegatronPretrainingSampler(ITERS * GLOBAL, consumed, MICRO, j, fresh))[:ACCUMULATION]
             for i in batch] for j in range(fresh)]
        consumed += fresh * MICRO * ACCUMULATION
        queue = queue[replayed[iteration]:] + [shares[iteration][g] for g in range(GROUPS)
                                               if g not in quorums[iteration]]
    return shares, replayed, queue


def reference(argv, quorums, shares):
    """{iteration: [groups in the quorum]}, {iteration: [each group's share]} -> ({iteration: {group: that group's
    mean loss}} for every group, in the quorum or not; {iteration: the gradient norm before clipping}, which Adam
    and clipping would hide a wrong scale of; the final parameters)."""
    import pretrain_gpt
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.initialize import initialize_megatron
    from megatron.trainer.builders import param_groups_for_weight_decay
    args = initialize_megatron(None, argv)
    model = pretrain_gpt.model_provider()
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    data = MockGPTDataset(ITERS * GLOBAL, args.seq_length, args.vocab_size, args.seed)
    losses, norms = {}, {}
    for iteration in range(1, ITERS + 1):
        losses[iteration] = {}
        optimizer.zero_grad()
        for group in range(GROUPS):
            group_losses = []
            share = shares[iteration][group]
            for indices in (share[k * MICRO:(k + 1) * MICRO] for k in range(ACCUMULATION)):
                text = torch.tensor(np.stack([data[i]["text"] for i in indices]))
                tokens, labels = text[:, :-1], text[:, 1:]
                positions = torch.arange(tokens.shape[1]).expand_as(tokens)
                loss = model(tokens, positions, None, labels=labels).float().mean()
                if group in quorums[iteration]:
                    (loss / (len(quorums[iteration]) * ACCUMULATION)).backward()
                group_losses.append(loss.item())
            losses[iteration][group] = sum(group_losses) / ACCUMULATION
        norms[iteration] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}
