"""Where an expert's optimizer state lies in a ZeRO checkpoint saved under expert parallelism (EP > 1).

The model-states file holds every expert (megatron/zero/expert_checkpoint.py gathers them), but its param_names are
data-parallel rank 0's: in an expert param group only the experts of expert-parallel position 0. The optimizer file
of data-parallel rank d holds, in the expert groups, the experts of position d % EP (mpu.expert_parallel's layout),
partitioned over the ranks of that position. Position p holds experts [p E/EP, (p+1) E/EP) of every MoE layer, in
the same order and shapes as position 0 holds its own; so rank 0's names with each expert number raised by p E/EP
are position p's group. E = 4, EP = 2, one expert group over two MoE layers:

    rank 0's names     L0.e0 L0.e1 L1.e0 L1.e1       (as saved)          the files of ranks d = 0, 2, 4, ...
    at position 1      L0.e2 L0.e3 L1.e2 L1.e3                           the files of ranks d = 1, 3, 5, ...
    every expert       L0.e0 L0.e1 L0.e2 L0.e3 L1.e0 ... L1.e3           (EP 1's order: the module's)

The engine's own load (expert_checkpoint.expert_optim_states) and the any-topology reader (reshard.SavedCheckpoint,
hence zero_to_fp32, convert_to_hf and checkpoint_util) pick the files of a position here.
"""
import re

from megatron.checkpoint import layout as ckpt

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)(\..+)$")


def is_expert_name(name):
    return _EXPERT.match(name) is not None


def expert_number(name):
    """The global expert number j of `...mlp.experts.j....`."""
    return int(_EXPERT.match(name).group(2))


def _renumbered(name, offset):
    match = _EXPERT.match(name)
    return name if match is None else f"{match.group(1)}{int(match.group(2)) + offset}{match.group(3)}"


def names_at_position(group_names, position, experts_per_rank):
    """Position `position`'s names of a param group whose saved names are position 0's."""
    return [_renumbered(name, position * experts_per_rank) for name in group_names]


def with_every_expert(group_names, expert_model_parallel_size, experts_per_rank):
    """A param group's names with every position's experts, in the order EP 1 holds them: each MoE layer's run of
    position 0's experts followed by the same run at positions 1, 2, ..."""
    result, run = [], []

    def flush():
        for position in range(expert_model_parallel_size):
            result.extend(names_at_position(run, position, experts_per_rank))
        run.clear()
    for name in group_names:
        layer = _EXPERT.match(name).group(1) if is_expert_name(name) else None
        if run and _EXPERT.match(run[-1]).group(1) != layer:
            flush()
        if layer is None:
            result.append(name)
        else:
            run.append(name)
    flush()
    return result


def files_at_position(optim_states, expert_model_parallel_size, position):
    """The optimizer-states dicts (of every saved data-parallel rank) that hold position `position`'s experts, in
    data-parallel order."""
    mine = [s for s in optim_states if s[ckpt.DATA_PARALLEL_RANK] % expert_model_parallel_size == position]
    return sorted(mine, key=lambda s: s[ckpt.DATA_PARALLEL_RANK])
