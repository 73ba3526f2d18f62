"""What a run carries from step to step and across checkpoints (TrainState), and the flags that choose what a
checkpoint save or load includes (CheckpointOptions). Both are explicit objects, so the training loop, the
checkpoint functions and offline tools pass them instead of writing onto the argparse Namespace."""
import dataclasses
from dataclasses import dataclass
from typing import Optional


DATA_STREAM = "data_stream"   # the checkpoint key of the training stream's record (megatron.data.stream)


@dataclass
class TrainState:
    iteration: int = 0
    """Optimizer steps taken (skipped fp16 steps included)."""
    consumed_train_samples: int = 0
    """Training samples consumed: the sampler resumes from here, so a resumed run sees the same batches."""
    consumed_valid_samples: int = 0
    """Validation samples consumed (the validation sampler cycles through its split)."""
    skipped_iterations: int = 0
    """Steps skipped because of an fp16 overflow."""
    data_stream: Optional[object] = dataclasses.field(default=None, compare=False, repr=False)
    """The live training stream (megatron.data.stream.StreamLoader) when --data-path names raw shards: its
    state_dict() is saved under DATA_STREAM with every checkpoint. Only a live stream is saved, never a record
    loaded earlier (that would restart a twice-resumed run at the first resume's position)."""
    loaded_stream_record: Optional[dict] = dataclasses.field(default=None, compare=False, repr=False)
    """The stream record of the checkpoint this state was loaded from (None without one): the data iterators
    start the stream there."""

    COUNTERS = ("iteration", "consumed_train_samples", "consumed_valid_samples", "skipped_iterations")

    def to_state(self):
        """The counters as a checkpoint stores them (model_optim_rng.pt's keys; the ZeRO path's client_state):
        the field names are the keys (megatron.checkpoint.layout spells them ITERATION, CONSUMED_..., ...); with a
        live data stream, its record under DATA_STREAM."""
        state = {name: getattr(self, name) for name in self.COUNTERS}
        if self.data_stream is not None:
            state[DATA_STREAM] = self.data_stream.state_dict()
        return state

    @classmethod
    def from_state(cls, state):
        """The counters of a checkpoint's state (a counter it lacks, e.g. in a converted model: 0) and its data
        stream's record, if any."""
        return cls(**{name: int(state.get(name, 0)) for name in cls.COUNTERS},
                   loaded_stream_record=state.get(DATA_STREAM))


@dataclass(frozen=True)
class CheckpointOptions:
    save: Optional[str] = None
    """Directory to save to (--save)."""
    load: Optional[str] = None
    """Directory to load from (--load)."""
    save_keep_last: Optional[int] = None
    """Keep only the newest N iter_* directories (--save-keep-last)."""
    no_save_optim: bool = False
    """Save weights and counters without optimizer and lr-scheduler state."""
    no_save_rng: bool = False
    """Save without RNG states."""
    no_load_optim: bool = False
    """Load the counters but start a fresh optimizer and lr scheduler (as Megatron does)."""
    no_load_rng: bool = False
    """Keep this run's seeded RNG states."""
    finetune: bool = False
    """Load the weights only: counters, optimizer, lr scheduler and RNG start fresh."""
    async_save: bool = False
    """Write the files in a background thread after a copy to host memory; published at the next save, load or
    the end of training (megatron.checkpoint.finalize_async_save)."""

    @classmethod
    def from_args(cls, args):
        return cls(save=args.save, load=args.load, save_keep_last=args.save_keep_last,
                   no_save_optim=args.no_save_optim, no_save_rng=args.no_save_rng,
                   no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng, finetune=args.finetune,
                   async_save=getattr(args, "async_save", False))
