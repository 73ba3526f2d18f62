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


def group_batches(iteration, group):
    """The micro batches (global sample indices) `group` reads in `iteration`: its sampler's (data-parallel rank
    `group` of GROUPS) first ACCUMULATION batches from the step's start."""
    sampler = MegatronPretrainingSampler(ITERS * GLOBAL, (iteration - 1) * GLOBAL, MICRO, group, GROUPS)
    return list(sampler)[:ACCUMULATION]


def reference(argv, quorums):
    """{iteration: [groups in the quorum]} -> ({iteration: {group: that group's mean loss}} for every group, in
    the quorum or not, the final parameters)."""
    import pretrain_gpt
    from megatron.data.mock_dataset import MockGPTDataset
    from megatron.initialize import initialize_megatron
    from megatron.trainer.builders import param_groups_for_weight_decay
    args = initialize_megatron(None, argv)
    model = pretrain_gpt.model_provider()
    optimizer = torch.optim.AdamW(param_groups_for_weight_decay(model), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
    data = MockGPTDataset(ITERS * GLOBAL, args.seq_length, args.vocab_size, args.seed)
    losses = {}
    for iteration in range(1, ITERS + 1):
        losses[iteration] = {}
        optimizer.zero_grad()
        for group in range(GROUPS):
            group_losses = []
            for indices in group_batches(iteration, group):
                text = torch.tensor(np.stack([data[i]["text"] for i in indices]))
                tokens, labels = text[:, :-1], text[:, 1:]
                positions = torch.arange(tokens.shape[1]).expand_as(tokens)
                loss = model(tokens, positions, None, labels=labels).float().mean()
                if group in quorums[iteration]:
                    (loss / (len(quorums[iteration]) * ACCUMULATION)).backward()
                group_losses.append(loss.item())
            losses[iteration][group] = sum(group_losses) / ACCUMULATION
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
