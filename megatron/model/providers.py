"""The GPT model provider of the post-training drivers, as pretrain_gpt.py's model_provider (the seed tutorial's)
builds it: ZeRO's activation checkpointing set up if asked, then the model under zero.Init (at ZeRO-3 each parameter
is partitioned as its module is built). pretrain_gpt.py shares its two helpers.

    model = gpt_model(args)                       # finetune_gpt.py, RLHF's actor
    model = gpt_model(args, reward_head=True)     # train_reward_model.py, RLHF's critic
"""
import dataclasses

import mpu
import megatron.model
from megatron import print_rank_0, zero
from megatron.model.gpt2_model import GPT2ModelConfig


def set_deepspeed_activation_checkpointing(args):
    """--deepspeed_activation_checkpointing: zero.checkpointing partitions the checkpointed activations across
    model-parallel ranks (configured before the model is built: the model asks is_configured() once)."""
    if args.deepspeed and args.deepspeed_activation_checkpointing:
        from megatron.zero import checkpointing
        checkpointing.configure(mpu, deepspeed_config=args.zero_config, partition_activations=True)


def partitioned_while_built(args):
    """zero.Init's `enabled`: ZeRO-3 partitions each parameter as its module is built, except under expert
    parallelism (the model is built whole: the engine partitions the experts over their own group)."""
    return args.zero_stage == 3 and getattr(args, "expert_model_parallel_size", 1) == 1


def gpt_model(args, reward_head=False):
    """GPT2Model of the command line's config (reward_head: with the scalar head of a reward model)."""
    set_deepspeed_activation_checkpointing(args)
    print_rank_0("building GPT2 reward model ..." if reward_head else "building GPT2 model ...")
    config = GPT2ModelConfig.from_args(args)
    if reward_head:
        config = dataclasses.replace(config, reward_head=True)
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(with_context_parallel=True),
                   remote_device=args.remote_device, enabled=partitioned_while_built(args)):
        # looked up on megatron.model when called: a caller that replaces megatron.model.GPT2Model gets its class
        return megatron.model.GPT2Model(config, num_tokentypes=0, parallel_output=True)
