"""Inert stand-ins for the classes DeepSpeed pickles into its checkpoints, so that weights_only loading reads them
without DeepSpeed installed and without running code (megatron.checkpoint.deepspeed_format explains the format).

    SAFE_GLOBALS    DeepSpeed's loss scalers, ZeroStageEnum and fragment_address, and argparse.Namespace
                    (Megatron-DeepSpeed's args): allowed in every safe_torch_load
    NUMPY_GLOBALS   numpy's array reconstruction (Megatron-DeepSpeed's numpy RNG state): model-states files only
    pickle_module   torch.save(..., pickle_module=pickle_module) writes the loss-scaler stand-ins under
                    DeepSpeed's class names (its stage-3 loader requires that object)

This module imports nothing of ours: megatron.checkpoint.layout's safe load and checked save use it.
"""
import argparse
import enum
import pickle

import numpy as np


class DeepSpeedLossScaler:
    """deepspeed.runtime.fp16.loss_scaler.LossScaler / DynamicLossScaler: only their attributes (cur_scale,
    dynamic, cur_iter, last_overflow_iter, scale_window, min_scale, delayed_shift, cur_hysteresis, ...)."""

    def __init__(self, scale=1.0, **attributes):
        self.cur_scale = scale
        self.__dict__.update(attributes)


class DeepSpeedDynamicLossScaler(DeepSpeedLossScaler):
    pass


class ZeroStageEnum(enum.IntEnum):
    """deepspeed.runtime.zero.config.ZeroStageEnum"""
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """deepspeed.utils.tensor_fragment.fragment_address (a dataclass: numel, start)"""

    def __init__(self, numel=0, start=0):
        self.numel, self.start = numel, start

LOSS_SCALER_CLASS = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
DYNAMIC_LOSS_SCALER_CLASS = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


def _numpy_globals():
    core = getattr(np, "_core", None) or np.core
    found = [(core.multiarray._reconstruct, f"{core.__name__}.multiarray._reconstruct"), (np.ndarray, "numpy.ndarray"),
             (np.dtype, "numpy.dtype")]
    # numpy >= 1.25 pickles a dtype through its class (numpy.dtypes.UInt32DType, ...)
    found += [(cls, f"numpy.dtypes.{cls.__name__}") for cls in vars(getattr(np, "dtypes", object)).values()
              if isinstance(cls, type) and issubclass(cls, np.dtype)]
    if core.__name__ == "numpy._core":   # a file written under numpy 1.x names numpy.core
        found.append((core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"))
    return found


SAFE_GLOBALS = [(DeepSpeedLossScaler, LOSS_SCALER_CLASS), (DeepSpeedDynamicLossScaler, DYNAMIC_LOSS_SCALER_CLASS),
                (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
                (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
                (argparse.Namespace, "argparse.Namespace")]
NUMPY_GLOBALS = _numpy_globals()      # allowed in model-states files only (deepspeed_format.load_model_states)


class _Pickler(pickle._Pickler):
    """Python's pickler, writing the stand-ins under DeepSpeed's class names (DeepSpeed need not be installed)."""

    def save_global(self, obj, name=None):
        module_and_name = _PICKLED_AS.get(obj)
        if module_and_name is None:
            return super().save_global(obj, name)
        module, qualname = module_and_name.rsplit(".", 1)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode("utf-8"))
        self.memoize(obj)


_PICKLED_AS = {DeepSpeedLossScaler: LOSS_SCALER_CLASS, DeepSpeedDynamicLossScaler: DYNAMIC_LOSS_SCALER_CLASS}


class pickle_module:
    """torch.save(..., pickle_module=pickle_module) for files holding the stand-ins."""
    Pickler = _Pickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)
    dump = staticmethod(pickle.dump)
    __name__ = "megatron.checkpoint.deepspeed_classes.pickle_module"


STAND_INS = (DeepSpeedLossScaler,)     # instances our files may hold (check_weights_only_safe allows them)
