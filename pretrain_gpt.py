"""Pretrain GPT-2: the three providers Megatron's training loop needs, and nothing else.

    torchrun --nproc_per_node 1 pretrain_gpt.py --mock-data --train-iters 20        # smoke test
    bash scripts/pretrain_gpt.sh                                                    # Megatron path
    bash scripts/ds_pretrain_gpt.sh                                                 # ZeRO-2 (--deepspeed)
"""
import torch

import mpu
from megatron.data.corpora import DataPathError
from megatron.data.indexed_dataset import IndexedDatasetError
from megatron.initialize import run_main
from megatron.global_vars import get_args, get_timers, get_tokenizer
from megatron.model import GPT2Model
from megatron.guards.operations import NonFiniteError
from megatron.guards.preflight import PreflightError
from megatron.training import pretrain
from megatron.utils import print_rank_0, reduce_losses
from megatron import zero
from megatron.zero import ConfigError
from megatron.checkpoint.layout import CheckpointError
from megatron.tokenizer.gpt2_tokenization import TokenizerFileError


def model_provider():
    args = get_args()
    set_deepspeed_activation_checkpointing(args)
    print_rank_0("building GPT2 model ...")
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(), remote_device=args.remote_device,
                   enabled=args.zero_stage == 3 and args.expert_model_parallel_size == 1):
        # ZeRO-3: each parameter partitioned as its module is built (under expert parallelism built whole: the
        # engine partitions the experts over their own group)
        model = GPT2Model(num_tokentypes=0, parallel_output=True)  # its GPT2ModelConfig comes from the arguments
    return model


def set_deepspeed_activation_checkpointing(args):
    """--deepspeed_activation_checkpointing: zero.checkpointing partitions the checkpointed activations across
    model-parallel ranks (configured before the model is built: the model asks is_configured() once)."""
    if args.deepspeed and args.deepspeed_activation_checkpointing:
        from megatron.zero import checkpointing
        checkpointing.configure(mpu, deepspeed_config=args.zero_config, partition_activations=True)


def get_batch(data_iterator):
    """Tokens, labels, loss mask, attention mask (None = plain causal) and position ids for one micro-batch,
    read on model-parallel rank 0 and broadcast to the rest of its group."""
    args = get_args()
    data = next(data_iterator) if data_iterator is not None else None
    text = mpu.broadcast_data(["text"], data, torch.int64)["text"]      # [b, s+1]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [b, s] each
    if args.reset_position_ids or args.reset_attention_mask or args.eod_mask_loss:
        from megatron.data.masks import get_ltor_masks_and_position_ids
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, get_tokenizer().eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
        if not args.reset_attention_mask:
            attention_mask = None  # causal: let SDPA use its fused path
    else:
        attention_mask = None
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
        position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, attention_mask, position_ids


def forward_step(data_iterator, model):
    """Loss = mean of per-token losses under the loss mask; also the data-parallel average for logging. Before the
    last pipeline stage: the stage's output and no losses."""
    timers = get_timers()
    timers("batch generator").start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch generator").stop()
    losses = model(tokens, position_ids, attention_mask, labels=labels)   # [b, s]
    if not mpu.is_pipeline_last_stage():
        return losses, {}   # this stage's hidden states [b, s, h], for the next pipeline stage
    loss = torch.sum(losses.float().view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    reduced = reduce_losses([loss])
    return loss, {"lm loss": reduced[0]}    # read on the host once per step (training.losses_to_host)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    print_rank_0("> building train, validation, and test datasets for GPT2 ...")
    if args.mock_data:
        from megatron.data.mock_dataset import MockGPTDataset
        return tuple(MockGPTDataset(n, args.seq_length, args.vocab_size, args.seed + split)
                     for split, n in enumerate(train_val_test_num_samples))
    from megatron.data.corpora import resolve_data_path
    from megatron.data.gpt_dataset import build_train_valid_test_datasets
    return build_train_valid_test_datasets(
        data_prefix=resolve_data_path(args.data_path, args.train_data), splits_string=args.split,
        train_valid_test_num_samples=train_val_test_num_samples, seq_length=args.seq_length, seed=args.seed,
        data_cache_path=args.data_cache_path)


def main(args_list=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, args_list=args_list)


if __name__ == "__main__":
    run_main(main, (CheckpointError, ConfigError, NonFiniteError, PreflightError, DataPathError, IndexedDatasetError,
                    TokenizerFileError))  # one line naming the problem
