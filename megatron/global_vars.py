"""Process-wide singletons for the training script only (library code takes explicit arguments).

set_global_variables(args) is called once by megatron.initialize; get_args(), get_timers(),
get_tensorboard_writer() read them.
"""
import torch

from megatron.timers import Timers

_GLOBAL_ARGS = None
_GLOBAL_TIMERS = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_TOKENIZER = None


def get_args():
    assert _GLOBAL_ARGS is not None, "args are not initialized: call megatron.initialize.initialize_megatron"
    return _GLOBAL_ARGS


def get_timers():
    assert _GLOBAL_TIMERS is not None, "timers are not initialized"
    return _GLOBAL_TIMERS


def get_tokenizer():
    """The tokenizer built from --vocab-file/--merge-file, or None with --mock-data."""
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer():
    """The SummaryWriter on the last rank when --tensorboard-dir is set, else None."""
    return _GLOBAL_TENSORBOARD_WRITER


def set_global_variables(args):
    global _GLOBAL_ARGS, _GLOBAL_TIMERS, _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_TOKENIZER
    _GLOBAL_ARGS = args
    _GLOBAL_TOKENIZER = _build_tokenizer(args)
    _GLOBAL_TIMERS = Timers(enabled=args.timing_log_level >= 1)   # level 0: no phase timers, no device syncs
    _GLOBAL_TENSORBOARD_WRITER = _build_tensorboard_writer(args)


def _build_tokenizer(args):
    """Sets args.real_vocab_size and args.padded_vocab_size (the vocabulary padded to make-vocab-size-divisible-by
    x model-parallel size)."""
    from megatron.tokenizer.tokenizer import build_tokenizer, set_padded_vocab_size
    if args.mock_data:
        args.real_vocab_size = args.vocab_size
        set_padded_vocab_size(args, args.vocab_size)
        return None
    tokenizer = build_tokenizer(args)
    args.real_vocab_size = tokenizer.vocab_size
    return tokenizer


def _build_tensorboard_writer(args):
    if not args.tensorboard_dir or torch.distributed.get_rank() != torch.distributed.get_world_size() - 1:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise SystemExit(f"--tensorboard-dir needs the tensorboard package: pip install tensorboard ({error})")
    return SummaryWriter(log_dir=args.tensorboard_dir)
