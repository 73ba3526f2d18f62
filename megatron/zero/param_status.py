"""DeepSpeed's view of a ZeRO-3 parameter: `param.ds_id` (unique in the process) and `param.ds_status`.

DeepSpeed clients read them to decide what to gather before touching `.data` (DeepSpeed-Chat's save and EMA):

    to_fetch = [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
    with zero.GatheredParameters(to_fetch): ...

Both are plain attributes (a property cannot be put on one Parameter instance), written where the state changes:
zero.Init's partitioning and GatheredParameters (zero_init.py), stage 3's gather and release
(stage3_buffer._Buffer).
Parameters of stages 0-2 have neither, as in DeepSpeed: a client reads them directly.
"""
import enum
import itertools


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names and values (deepspeed.runtime.zero.partition_parameters.ZeroParamStatus)."""
    AVAILABLE = 1        # whole and up to date on every rank of the data-parallel group
    NOT_AVAILABLE = 2    # partitioned (or whole but stale: the persistent parameters after a step)
    INFLIGHT = 3         # a gather was launched and not yet waited for


_next_id = itertools.count()     # DeepSpeed's ds_id is a process-wide counter too (Init.param_id)


def assign_id(param):
    """Give `param` a `ds_id` unless it has one: zero.Init gives it first, the engine keeps it."""
    if not hasattr(param, "ds_id"):
        param.ds_id = next(_next_id)


def set_status(params, status):
    for param in params:
        param.ds_status = status
