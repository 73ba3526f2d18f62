"""DeepSpeed-Chat's EMA actor (train_rlhf.py --enable-ema): after every actor step each weight moves toward the
actor's, `ema = torch.lerp(actor, ema, 0.992)` = 0.992 ema + 0.008 actor (dschat/utils/utils.py's moving_average,
its default beta), starting from the actor's starting weights; saved beside the run (--ema-save, default SAVE/ema)
as a Megatron-layout checkpoint with the actor's model shape, so it loads wherever the actor's checkpoint loads
(--load of any entry point at any topology, tools/generate_samples_gpt.py, convert_to_hf.py).

    ema = EMAActor(actor)                  # a copy of the actor's weights as this rank holds them
    ...train_step(...)                     # one actor step
    ema.update()                           # after every actor step, as DeepSpeed-Chat (skipped steps included)
    ema.save(train_state, options)         # with the actor's checkpoint (options.save: the EMA's directory)

Every parameter of the actor is averaged, as DeepSpeed-Chat's moving_average zips all of them: with LoRA the
adapters (A and B each, not their product) and the frozen base weights (which do not move). What this rank holds:
a copy of each parameter it holds whole (its tensor-parallel shard, in the parameters' dtype: DeepSpeed-Chat's EMA
model is in the actor's dtype too); at ZeRO-3 a copy of its partitions of the engine's flat groups. The update is
element-wise, so at ZeRO-3 it needs no gather: DeepSpeed-Chat gathers both parameters inside
`GatheredParameters(..., modifier_rank=None)`, whose exit discards edits (DeepSpeed's, and zero.GatheredParameters'
semantics), so its ZeRO-3 EMA never leaves the starting weights (OpenRLHF, whose moving_average is this one,
fixed it in its PR 1357); here the formula holds at every stage.
"""
import dataclasses

import torch

import mpu
from megatron import unwrap_model
from megatron.cli import UserError

EMA_BETA = 0.992


class EMAError(UserError, ValueError):
    """The EMA checkpoint a resumed run needs is missing or at another iteration (the message names --ema-save)."""


@dataclasses.dataclass
class _EMAWeights:
    """What save_checkpoint needs of a model (the Megatron path): the actor's model config and the EMA's weights."""
    config: object
    weights: dict

    def state_dict(self):
        return self.weights


def _copy(tensor):
    """A copy of an actor weight where the weight lives: ZeRO-3's offload_param partitions stay host offload memory
    (swapped in for the save's gather, which copies them to the device as it does the engine's)."""
    from megatron.zero import offload
    if offload.is_host_offload(tensor):
        return offload.host_copy(tensor)
    return tensor.detach().clone()


class EMAActor:
    """The EMA of one actor (an engine or the Megatron path's wrapped model): update() after each of its steps,
    save() beside its checkpoints, load() when it resumes."""

    def __init__(self, model, beta=EMA_BETA):
        self.model, self.beta = model, beta
        self.stage3 = getattr(model, "stage3", None)
        module = unwrap_model(model)
        self.params = [] if self.stage3 is not None else list(module.parameters())
        with torch.no_grad():
            self.tensors = [_copy(source) for source in self._sources()]

    def _sources(self):
        """The actor's weights, one tensor per EMA tensor (ZeRO-3: the current partitions of the engine's groups)."""
        if self.stage3 is not None:
            return [group.partition for group in self.stage3.groups]
        return [param.data for param in self.params]

    @torch.no_grad()
    def update(self):
        """DeepSpeed-Chat's moving_average: ema = lerp(actor, ema, beta)."""
        for ema, source in zip(self.tensors, self._sources()):
            ema.copy_(torch.lerp(source, ema, self.beta))

    def state_dict(self):
        """The actor module's state dict with the EMA's weights (on host; ZeRO-3: gathered, a collective of the
        data-parallel group, copied on its rank 0 only, which writes it)."""
        module = unwrap_model(self.model)
        if self.stage3 is not None:
            with self.stage3.swapped_partitions(self.tensors):
                return self.stage3.full_state_dict(keep=mpu.get_data_parallel_rank() == 0)
        ema_of = {id(param): ema for param, ema in zip(self.params, self.tensors)}
        state = module.state_dict()
        for name, param in module.named_parameters(remove_duplicate=False):
            state[name] = ema_of[id(param)].to("cpu", copy=True)
        return state

    def save(self, train_state, options):
        """A weights-only Megatron-layout checkpoint at train_state.iteration in options.save (every rank calls)."""
        from megatron.checkpoint import save_checkpoint
        options = dataclasses.replace(options, no_save_optim=True, no_save_rng=True)
        save_checkpoint(train_state, _EMAWeights(unwrap_model(self.model).config, self.state_dict()), None, None,
                        options)

    def load(self, directory, iteration):
        """A resumed run's EMA: the checkpoint `directory` wrote at `iteration` (the actor's), any topology."""
        from megatron.checkpoint import reshard
        from megatron.checkpoint.layout import ITERATION, CheckpointError
        try:
            saved = reshard.SavedCheckpoint(directory)
        except (CheckpointError, OSError) as error:
            raise EMAError(f"--enable-ema: the resumed run's EMA actor cannot be read from --ema-save {directory}: "
                           f"{error}") from None
        if int(saved.run_state.get(ITERATION, -1)) != iteration:
            raise EMAError(f"--enable-ema: --ema-save {directory} holds iteration {saved.run_state.get(ITERATION)}, "
                           f"the actor resumes at {iteration}")
        module = unwrap_model(self.model)
        world, rank = mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
        weights = {}
        for name, param in module.named_parameters():
            rows = mpu.full_shape(param)[0] * world if reshard.partitioning(name)[2] else None
            weights[name] = saved.shard(name, "weight", world, rank, rows)
        with torch.no_grad():
            if self.stage3 is None:
                for (name, _), ema in zip(module.named_parameters(), self.tensors):
                    ema.copy_(weights[name].reshape(ema.shape))
                return
            name_of = {id(p): n for n, p in module.named_parameters()}
            for group, partition in zip(self.stage3.groups, self.tensors):
                start, end = group.own_range
                for index, lo, hi in group.segments(start, end):
                    p_start = group.offsets[index][0]
                    value = weights[name_of[id(group.params[index])]].reshape(-1).to(partition.dtype)
                    partition[lo - start:hi - start].copy_(value[lo - p_start:hi - p_start])
