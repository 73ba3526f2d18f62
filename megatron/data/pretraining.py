"""pretrain_gpt.py's data, given the parsed arguments (tools/print_batch.py reads the same rows):

    train, valid, test = pretraining_datasets(args, [n_train, n_valid, n_test])
    attention_mask, loss_mask, position_ids = pretraining_masks(tokens, args, tokenizer)   # tokens [b, s]
"""
import torch

from megatron import print_rank_0


def pretraining_datasets(args, train_val_test_num_samples):
    """--mock-data's seeded random tokens, raw shards streamed (megatron.data.stream: a --data-path directory, glob
    or .jsonl/.jsonl.gz/.json/.parquet file; --split by document), or GPTDataset over --data-path / --train-data
    (with --split)."""
    print_rank_0("> building train, validation, and test datasets for GPT2 ...")
    if args.mock_data:
        from megatron.data.mock_dataset import MockGPTDataset
        return tuple(MockGPTDataset(n, args.seq_length, args.vocab_size, args.seed + split)
                     for split, n in enumerate(train_val_test_num_samples))
    from megatron.data.stream import stream_sources, uses_streams
    if args.data_path and uses_streams(args.data_path):   # raw shards, tokenized while training
        return stream_sources(args, train_val_test_num_samples)
    from megatron.data.corpora import resolve_data_path
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    return build_train_valid_test_datasets(
        data_prefix=resolve_data_path(args.data_path, args.train_data), splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples, seq_length=args.seq_length, seed=args.seed,
        data_cache_path=args.data_cache_path)


def pretraining_masks(tokens, args, tokenizer):
    """(attention mask (None = plain causal), loss mask, position ids) of tokens [b, s]: Megatron's document
    resets at the tokenizer's end-of-text with --reset-position-ids / --reset-attention-mask / --eod-mask-loss,
    else all ones and 0..s-1 (the tokenizer is then not read: None with --mock-data)."""
    if args.reset_position_ids or args.reset_attention_mask or args.eod_mask_loss:
        from megatron.data.masks import get_ltor_masks_and_position_ids
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        if not args.reset_attention_mask:
            attention_mask = None  # causal: let SDPA use its fused path
        return attention_mask, loss_mask, position_ids
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return None, loss_mask, position_ids
