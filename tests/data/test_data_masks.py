"""get_ltor_masks_and_position_ids equals Megatron's loop implementation for every flag combination."""
import itertools

import pytest
import torch

from megatron.data.masks import get_ltor_masks_and_position_ids


def megatron_loop_reference(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron-LM v2.6 megatron/utils.py, as written there."""
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(
        att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token].clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_equals_megatron_loop(flags):
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 6, (4, 33), generator=generator)   # eod = 0 appears often, also at the ends
    data[0, 0] = 0
    data[1, -1] = 0
    data[2] = 3                                                 # a row without eod
    got = get_ltor_masks_and_position_ids(data, 0, *flags)
    want = megatron_loop_reference(data, 0, *flags)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w)


def test_worked_example():
    data = torch.tensor([[5, 0, 7, 8, 9]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(data, 0, True, True, True)
    assert position_ids.tolist() == [[0, 1, 0, 1, 2]]
    assert loss_mask.tolist() == [[1, 0, 1, 1, 1]]
    assert (~attention_mask[0, 0, 4]).nonzero().flatten().tolist() == [2, 3, 4]
    assert (~attention_mask[0, 0, 1]).nonzero().flatten().tolist() == [0, 1]
