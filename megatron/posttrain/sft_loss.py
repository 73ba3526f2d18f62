"""SFT's loss: the masked loss normalized over the whole global batch (rows -> model inputs: common.model_inputs).

    batches = StepBatches()                                   # one per training run
    rows, step_tokens = batches.next(data_iterator, num_micro_batches, data_parallel_group)
    # rows: {"text", "loss_mask", "segments"} [b, S + 1]; step_tokens: mask tokens of the whole global batch
    tokens, labels, loss_mask, attention_mask, position_ids = model_inputs(rows, pack=False)
    losses = model(tokens, position_ids, attention_mask, labels=labels)      # per-token [b, s]
    loss_sum, count = masked_sum(losses, loss_mask)
    loss = loss_sum * (data_parallel_size * num_micro_batches) / step_tokens   # what backward sees

The loss of one optimizer step is sum(per-token loss x mask) / sum(mask) over the whole global batch: every
micro-batch of every data-parallel rank (Hugging Face's loss with labels = -100 off the answers, had the global
batch been one batch). The training loop averages gradients over data-parallel ranks and micro-batches, so each
micro-batch's loss is its masked sum scaled by (dp x micro-batches) / (the step's mask tokens). Knowing that count
before the first backward takes the step's micro-batches up front: StepBatches reads them all at the step's first
forward, counts their mask tokens and sums the counts over the data-parallel group. The choice is exact for any
split of a batch over ranks and micro-batches (a mean of per-rank means would weight a short answer's tokens
more); logged and validation losses are (sum, count) pairs, summed over everything and divided once.
"""
import torch

import mpu

from .common import ROW_KEYS, sum_over_group, trim_to_longest


def masked_sum(per_token_losses, loss_mask):
    """(sum of per-token losses where the mask is 1, number of such tokens) of one micro-batch, as tensors."""
    mask = loss_mask.view(-1)
    return torch.sum(per_token_losses.float().view(-1) * mask), mask.sum()


class StepBatches:
    """One optimizer step's micro-batches, read up front so that the step's mask-token count over the whole global
    batch is known at its first forward. next() is called once per micro-batch by every rank of a model-parallel
    group (the rows come from its rank 0's iterator, broadcast to the others); the pipeline schedules and the
    evaluation loop run exactly num_micro_batches forwards per step, so the buffer is empty between steps."""

    def __init__(self):
        self.pending = []

    def next(self, data_iterator, num_micro_batches, data_parallel_group, trim=False):
        """(rows {key: int64 [b, S + 1]}, mask tokens of this step over all data-parallel ranks: a 0-d tensor);
        `trim`: each micro-batch cut to its longest row (trim_to_longest) before it goes to the device."""
        if not self.pending:
            rows = [_broadcast_rows(data_iterator, trim) for _ in range(num_micro_batches)]
            local = sum(r["loss_mask"][:, 1:].sum() for r in rows)
            step_tokens = sum_over_group([local], "sft step mask tokens", data_parallel_group)[0]
            self.pending = [(r, step_tokens) for r in rows]
        return self.pending.pop(0)


def _broadcast_rows(data_iterator, trim=False):
    data = next(data_iterator) if data_iterator is not None else None
    if data is not None and trim:
        data = trim_to_longest({key: data[key] for key in ROW_KEYS})
    return mpu.broadcast_data(list(ROW_KEYS), data, torch.int64)
