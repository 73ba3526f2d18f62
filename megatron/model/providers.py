"""The GPT model providers of the entry points and the post-training drivers (the body of the seed tutorial's
pretrain_gpt.py model_provider, in one place): each takes the parsed arguments, sets up ZeRO's activation
checkpointing if asked, and builds the model under zero.Init (at ZeRO-3 each parameter is partitioned as its
module is built).

    model = gpt_model(args)                       # pretrain_gpt.py, finetune_gpt.py, RLHF's actor
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


def gpt_model(args, reward_head=False):
    """GPT2Model of the command line's config (reward_head: with the scalar head of a reward model)."""
    set_deepspeed_activation_checkpointing(args)
    print_rank_0("building GPT2 reward model ..." if reward_head else "building GPT2 model ...")
    config = GPT2ModelConfig.from_args(args)
    if reward_head:
        config = dataclasses.replace(config, reward_head=True)
    # ZeRO-3: each parameter partitioned as its module is built (under expert parallelism built whole: the engine
    # partitions the experts over their own group)
    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(with_context_parallel=True),
                   remote_device=args.remote_device,
                   enabled=args.zero_stage == 3 and getattr(args, "expert_model_parallel_size", 1) == 1):
        # the class is looked up on megatron.model when called, as the seed's pretrain_gpt.py imported it from there:
        # a caller that replaces megatron.model.GPT2Model (tests/training/test_nonfinite.py poisons a gradient so)
        # gets its own class
        return megatron.model.GPT2Model(config, num_tokentypes=0, parallel_output=True)
