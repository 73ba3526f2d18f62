"""Pretrain GPT-2: the three providers Megatron's training loop needs, and nothing else.

    torchrun --nproc_per_node 1 pretrain_gpt.py --mock-data --train-iters 20        # smoke test
    bash scripts/pretrain_gpt.sh                                                    # Megatron path
    bash scripts/ds_pretrain_gpt.sh                                                 # ZeRO-2 (--deepspeed)
"""
import torch

import mpu
from megatron import zero
from megatron.data.context_parallel import batch_on_this_context_parallel_rank, masked_token_mean
from megatron.data.pretraining import pretraining_datasets, pretraining_masks
from megatron.global_vars import get_args, get_timers, get_tokenizer
from megatron.initialize import run_main
from megatron.model import GPT2Model, GPT2ModelConfig
from megatron.model.providers import partitioned_while_built, set_deepspeed_activation_checkpointing
from megatron.training import pretrain
from megatron.utils import print_rank_0, reduce_losses


def model_provider():
    """Build the model: GPT2Model of the arguments under zero.Init (at ZeRO-3 each parameter is partitioned over the
    data-parallel group as its module is built)."""
    args = get_args()
    set_deepspeed_activation_checkpointing(args)
    print_rank_0("building GPT2 model ...")
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(with_context_parallel=True),
                   remote_device=args.remote_device, enabled=partitioned_while_built(args)):
        model = GPT2Model(GPT2ModelConfig.from_args(args), num_tokentypes=0, parallel_output=True)
    return model


def get_batch(data_iterator):
    """Tokens, labels, loss mask, attention mask (None = plain causal) and position ids for one micro-batch,
    read on model-parallel rank 0 and broadcast to the rest of its group; this rank's chunks of the sequence with
    context parallelism."""
    data = next(data_iterator) if data_iterator is not None else None
    text = mpu.broadcast_data(["text"], data, torch.int64)["text"]      # [b, s+1]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [b, s] each
    attention_mask, loss_mask, position_ids = pretraining_masks(tokens, get_args(), get_tokenizer())
    return batch_on_this_context_parallel_rank(tokens, labels, loss_mask, attention_mask, position_ids)


def forward_step(data_iterator, model):
    """Loss = mean of per-token losses under the loss mask; also the data-parallel average for logging. Before the
    last pipeline stage: the stage's output and no losses."""
    timers = get_timers()
    timers("batch-generator").start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    losses = model(tokens, position_ids, attention_mask, labels=labels)   # [b, s]
    if not mpu.is_pipeline_last_stage():
        return losses, {}   # this stage's hidden states [b, s, h], for the next pipeline stage
    loss, whole_sequence_loss = masked_token_mean(losses, loss_mask)     # the same at context-parallel size 1
    reduced = reduce_losses([whole_sequence_loss])
    return loss, {"lm loss": reduced[0]}    # read on the host once per step (training.losses_to_host)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """--mock-data, or GPTDataset over --data-path / --train-data (megatron/data/pretraining.py)."""
    return pretraining_datasets(get_args(), train_val_test_num_samples)


def main(args_list=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step, args_list=args_list)


if __name__ == "__main__":
    run_main(main)  # an error the user can fix (megatron.cli.UserError) is one line, exit status 1
