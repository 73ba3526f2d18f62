"""Left-to-right (causal) masks and position ids for GPT batches, with Megatron's document resets.

    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss)
    attention_mask, position_ids = document_masks_and_position_ids(document_starts)   # explicit boundaries

tokens: [b, s] ids. Returns attention_mask [b or 1, 1, s, s] bool (True = masked out, i.e. query i may not see
key j), loss_mask [b, s] float (0 at eod tokens with eod_mask_loss), position_ids [b, s] long.
A document ends at (and includes) each eod token. Example, s=5, eod at position 1, both resets:
position_ids = [0, 1, 0, 1, 2]; query 2 sees keys {2} (not 0, 1), query 4 sees {2, 3, 4}.
Without reset_attention_mask the mask is the plain causal mask, shared by the batch ([1, 1, s, s]).
document_masks_and_position_ids takes the boundaries themselves (document_starts [b, s] bool, True at the first
token of each document; position 0 always starts one): packed fine-tuning examples, whose end-of-text tokens
also sit inside an example (after every assistant turn), are delimited that way (megatron/posttrain).
"""
import torch


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    is_eod = data == eod_token                                            # [b, s]
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    # a new document starts at 0 and right after every eod
    starts_here = torch.zeros_like(is_eod)
    starts_here[:, 1:] = is_eod[:, :-1]
    attention_mask, position_ids = document_masks_and_position_ids(starts_here, reset_position_ids,
                                                                   reset_attention_mask)
    return attention_mask, loss_mask, position_ids


def document_masks_and_position_ids(document_starts, reset_position_ids=True, reset_attention_mask=True):
    """(attention_mask, position_ids) for documents beginning where document_starts [b, s] is True (and at 0)."""
    batch_size, seq_length = document_starts.shape
    device = document_starts.device
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).tril_()   # [s, s] True = visible
    positions = torch.arange(seq_length, dtype=torch.long, device=device)
    if reset_position_ids or reset_attention_mask:
        starts_here = document_starts.clone()
        starts_here[:, 0] = True
        # doc_start[b, t] = start of t's document
        doc_start = torch.where(starts_here, positions, torch.zeros_like(positions)).cummax(dim=1).values  # [b, s]

    if reset_position_ids:
        position_ids = positions - doc_start                              # [b, s]
    else:
        position_ids = positions.unsqueeze(0).expand(batch_size, seq_length)

    if reset_attention_mask:
        same_doc = doc_start.unsqueeze(2) == doc_start.unsqueeze(1)       # [b, s(query), s(key)]
        visible = same_doc & causal
        attention_mask = ~visible.unsqueeze(1)                            # [b, 1, s, s]
    else:
        attention_mask = ~causal.view(1, 1, seq_length, seq_length)       # [1, 1, s, s]
    return attention_mask, position_ids
