"""Checkpoints under expert parallelism (MoE experts split over the expert-model-parallel group, mpu/moe.py).

Each rank holds E / EP experts of every MoE layer, named by their global numbers. A save puts every expert in the
model-states file (data-parallel rank 0 writes it): the ranks of each expert-model-parallel group send their
experts' weights to the group's first rank, so the file holds the whole model and its weights load at any
expert-parallel (and data-parallel) size: a rank keeps the experts it holds (own_experts_only). The optimizer files
stay per rank: an expert group's partition holds this rank's experts, partitioned over its expert-data-parallel
group, so they load at the same expert-parallel size (any data-parallel size that it divides): each rank reads the
files of the saved ranks at its own expert-parallel position (expert_optim_states). At another expert-parallel size
the optimizer state is refused by name (load the weights only).
"""
import torch.distributed as dist

import mpu.expert_parallel as expert_parallel
from megatron.checkpoint import layout as ckpt
from megatron.checkpoint.experts import files_at_position, is_expert_name


def with_all_experts(module_state, module, ctx):
    """module_state (this rank's module weights, or {} on a rank that keeps nothing) with the other expert-parallel
    ranks' experts added on the expert-model-parallel group's first rank. Collective over that group; module_state
    itself without expert parallelism."""
    if ctx.expert_model_parallel_size == 1:
        return module_state
    mine = {name: param.detach().cpu() for name, param in module.named_parameters()
            if expert_parallel.is_expert_parameter(param)}
    group = ctx.expert_model_parallel_group
    first = dist.get_global_rank(group, 0)
    received = [None] * ctx.expert_model_parallel_size if dist.get_rank() == first else None
    dist.gather_object(mine, received, dst=first, group=group)
    if received is None or not module_state:
        return module_state
    merged = dict(module_state)
    for experts in received:
        merged.update(experts)
    return merged


def own_experts_only(state_dict, module):
    """The saved module weights without the experts this rank does not hold (a checkpoint holds every expert)."""
    own = {name for name, _ in module.named_parameters()}
    return {name: value for name, value in state_dict.items() if not is_expert_name(name) or name in own}


def check_optimizer_states_load(state, ctx, path):
    """CheckpointError when the optimizer files were saved at another expert-parallel size than this run's."""
    saved = state.get(ckpt.EXPERT_MODEL_PARALLEL_SIZE, 1)
    if saved != ctx.expert_model_parallel_size:
        raise ckpt.CheckpointError(f"{path} was saved at expert-model-parallel size {saved}, this run uses "
                                   f"{ctx.expert_model_parallel_size}: its optimizer state (experts partitioned by "
                                   "expert-parallel rank) does not load here; load the weights only "
                                   "(--no-load-optim, load_optimizer_states=False)")


def expert_optim_states(states, ctx):
    """The saved ranks' optimizer dicts that hold this rank's experts: data-parallel rank d holds the experts of
    expert-parallel rank d % EP (mpu.expert_parallel's layout), in data-parallel order; all of them without expert
    parallelism."""
    if ctx.expert_model_parallel_size == 1:
        return states
    ep = ctx.expert_model_parallel_size
    return files_at_position(states, ep, ctx.data_parallel_rank % ep)
