"""`zero.Init`: build a model whose parameters are partitioned as each module is constructed, and
`zero.GatheredParameters`: read or edit partitioned parameters whole (DeepSpeed's API).

    with zero.Init(data_parallel_group=mpu.get_data_parallel_group(), remote_device=args.remote_device,
                   enabled=args.zero_stage == 3):
        model = GPT2Model(num_tokentypes=0, parallel_output=True)

Inside the context every nn.Module subclass's __init__ is wrapped: when it returns, the module's own parameters
that are still whole are broadcast from data-parallel rank 0 and cut into equal pieces; this rank keeps its piece
(`param.ds_tensor`, on `remote_device`) and the parameter becomes an empty tensor with `ds_shape` / `ds_numel`.
Initialization runs exactly as without the context (same RNG draws), so the model equals the unpartitioned one
built from the same seed; at most one module's own parameters are whole at a time. Code that edits a parameter
after its module was built (e.g. a custom init) does so inside `GatheredParameters(param, modifier_rank=0)`.
The engine (zero.initialize, stage 3) gathers each piece set once more, one parameter at a time, into its own
contiguous partitions.
"""
import enum
import functools
import json

import torch
import torch.distributed as dist
from torch import nn

import mpu.utils as mpu_utils

from . import offload
from .collectives import all_gather_into_tensor
from .config import ConfigError
from .param_status import ZeroParamStatus, assign_id, set_status

# DeepSpeed's deepspeed.runtime.zero.partition_parameters is this module (megatron.zero.as_deepspeed): the names
# below are DeepSpeed 0.19.8's, with its semantics. transformers' prevent_arange_dtype_change replaces
# zero_wrapper_for_fp_tensor_constructor for the length of a model build and compares against _orig_torch_arange;
# Init looks the wrapper up here at each entry, so such a replacement is honoured as in DeepSpeed.
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")



def register_external_parameter(module, parameter):
    """Declare that `module`'s forward uses `parameter` owned by another module (DeepSpeed's name, in its
    partition_parameters module, which this module stands for): stage 3 then gathers it for `module` too (read by
    stage3._find_units). A no-op for the other stages."""
    external = module.__dict__.setdefault("_zero_external_params", [])
    if all(p is not parameter for p in external):
        external.append(parameter)


class DeepSpeedTensorOverride(enum.Enum):
    dtype = 1
    device = 2


DEFAULT_TENSOR_OVERRIDES = [DeepSpeedTensorOverride.dtype, DeepSpeedTensorOverride.device]


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device):
    """DeepSpeed's: `fn` (a torch constructor) with `device` defaulted to `target_device` and a floating-point
    result converted to `target_fp_dtype` (either None: left alone)."""
    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device", None) is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor
    return wrapped_fn


def _config_dict(config_dict_or_path):
    if config_dict_or_path is None or isinstance(config_dict_or_path, dict):
        return config_dict_or_path
    with open(config_dict_or_path) as f:
        return json.load(f)


def _config_dtype(config):
    """DeepSpeed's Init._set_dtype with a config: bf16, fp16, else fp32."""
    bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled", False)
    fp16 = (config.get("fp16") or {}).get("enabled", False)
    if bf16 is True and fp16 is True:
        raise ConfigError("zero.Init: bfloat16 and fp16 cannot be enabled at once")
    return torch.bfloat16 if bf16 is True else torch.half if fp16 is True else torch.float


class Init:
    """DeepSpeed 0.19.8's signature. Accepted with no effect here: `mem_efficient_linear` (torch's linear is
    used; its memory saving is DeepSpeed's own autograd function), `param_swapper` (NVMe).
    `zero_param_parallel_group` (hpZ), `zero_quantized_weights` and
    `zero_quantized_nontrainable_weights` are refused when given. `config_dict_or_path` (or the deprecated
    `config`), a dict or a JSON path, gives as in DeepSpeed the dtype when `dtype` is None (bf16, fp16, else fp32)
    and, when `remote_device` is None, `zero_optimization.offload_param.device` and `pin_memory`. With a dtype
    (given or from the config) and `DeepSpeedTensorOverride.dtype` in `tensor_overrides`, torch's tensor
    constructors inside the context return floating-point tensors in that dtype, as in DeepSpeed; without one,
    parameters keep the dtype they were built in. As DeepSpeed builds on the local accelerator, the model is built
    on mpu.get_device(): with `DeepSpeedTensorOverride.device` in `tensor_overrides` torch's constructors default
    to it, and a parameter built elsewhere is moved there before it is partitioned (its piece then goes to
    `remote_device`, or stays on the device)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False,
                 zero_quantized_nontrainable_weights=False, sequence_data_parallel_group=None, param_swapper=None,
                 tensor_overrides=DEFAULT_TENSOR_OVERRIDES):
        self.enabled = enabled
        self._patched = {}
        self._constructors = {}
        if not enabled:
            return
        for name, value in (("zero_param_parallel_group", zero_param_parallel_group),
                            ("zero_quantized_weights", zero_quantized_weights),
                            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights)):
            if value not in (None, False):
                raise ConfigError(f"zero.Init({name}=...) is not supported: hpZ and quantized weights are not "
                                  "implemented here")
        if sequence_data_parallel_group is not None:
            if data_parallel_group is not None:
                raise ValueError("Both 'data_parallel_group' and 'sequence_data_parallel_group' were specified. "
                                 "Please provide only one of these arguments.")
            data_parallel_group = sequence_data_parallel_group
        ds_config = _config_dict(config_dict_or_path if config_dict_or_path is not None else config)
        if ds_config is not None:
            if dtype is None:
                dtype = _config_dtype(ds_config)
            offload_param = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
            if remote_device is None and offload_param.get("device") is not None:
                remote_device = offload_param["device"]
                pin_memory = offload_param.get("pin_memory", pin_memory)
        self.tensor_overrides = list(tensor_overrides or [])
        if remote_device not in (None, "none", "cpu"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}) is not supported: use 'cpu' (host "
                              "memory) or 'none' (the training device)")
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self.size = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.remote_device = torch.device("cpu") if remote_device == "cpu" else None
        self.device = mpu_utils.get_device()
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.dtype = dtype
        if module is not None:
            for sub in module.modules():
                self._partition_module(sub)

    def __enter__(self):
        if self.enabled:
            for cls in _module_classes():
                if "__init__" in cls.__dict__:
                    self._patched[cls] = cls.__dict__["__init__"]
                    cls.__init__ = self._wrap(cls.__dict__["__init__"])
            dtype = self.dtype if DeepSpeedTensorOverride.dtype in self.tensor_overrides else None
            device = self.device if DeepSpeedTensorOverride.device in self.tensor_overrides else None
            if dtype is not None or device is not None:
                for name in _CONSTRUCTORS:
                    self._constructors[name] = getattr(torch, name)
                    # looked up at each entry: a client's replacement of the wrapper (transformers) applies
                    setattr(torch, name, zero_wrapper_for_fp_tensor_constructor(
                        globals()[f"_orig_torch_{name}"], target_fp_dtype=dtype, target_device=device))
        return self

    def __exit__(self, *exc):
        for cls, original in self._patched.items():
            cls.__init__ = original
        self._patched = {}
        for name, original in self._constructors.items():
            setattr(torch, name, original)
        self._constructors = {}
        return False

    def _wrap(self, init):
        @functools.wraps(init)
        def wrapped(module, *args, **kwargs):
            init(module, *args, **kwargs)
            self._partition_module(module)
        return wrapped

    def _partition_module(self, module):
        for param in module.parameters(recurse=False):
            if not is_partitioned(param):
                self._partition(param)

    def _partition(self, param):
        with torch.no_grad():
            full = param.data.to(self.device)      # built on the host (outside the constructors): to the device
            if self.dtype is not None and full.is_floating_point():
                full = full.to(self.dtype)
            if self.size > 1:
                dist.broadcast(full, group_src=0, group=self.group)
            piece_size = -(-full.numel() // self.size)
            if self.remote_device is not None:          # "cpu": host offload memory
                piece = offload.host_zeros(piece_size, full.dtype, self.pin_memory)
            else:
                piece = torch.zeros(piece_size, dtype=full.dtype, device=self.device)
            lo, hi = self.rank * piece_size, min((self.rank + 1) * piece_size, full.numel())
            if lo < hi:
                piece[:hi - lo].copy_(full.reshape(-1)[lo:hi])
            param.ds_tensor = piece
            param.ds_shape, param.ds_numel = full.shape, full.numel()
            param.ds_group, param.ds_world_size = self.group, self.size
            param.data = torch.empty(0, dtype=full.dtype, device=self.device)
            assign_id(param)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _module_classes():
    """nn.Module and every subclass defined so far (the ones a model can be built from)."""
    seen, todo = [], [nn.Module]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def is_partitioned(param):
    return hasattr(param, "ds_tensor") or getattr(param, "ds_manager", None) is not None


def gather_initial(param, device):
    """The whole value of a zero.Init parameter from every rank's piece (a collective of its group), on
    `device`, and the piece dropped; a parameter zero.Init did not partition is returned as it is."""
    if not hasattr(param, "ds_tensor"):
        return param.data
    piece = offload.to_device(param.ds_tensor, device)
    full = torch.empty(piece.numel() * param.ds_world_size, dtype=piece.dtype, device=device)
    if param.ds_world_size > 1:
        all_gather_into_tensor(full, piece, param.ds_group)
    else:
        full.copy_(piece)
    return full[:param.ds_numel].view(param.ds_shape)


class GatheredParameters:
    """Parameters whole inside the context, on every rank of their data-parallel group (all must enter it).
    With `modifier_rank` r, rank r's edits are broadcast and partitioned again on exit; with None they are
    read-only: edits are lost, as in DeepSpeed (whose exit frees every parameter of the context), those of a
    persistent (whole) parameter too, which is gathered again at its next use. Parameters that are not
    partitioned are left alone."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        self.params = [p for p in params if enabled and is_partitioned(p)]
        self.modifier_rank = modifier_rank
        self._held = None

    def __enter__(self):
        init_params = [p for p in self.params if hasattr(p, "ds_tensor")]
        for p in init_params:
            p.data = gather_initial(p, p.data.device).clone()
        set_status(init_params, ZeroParamStatus.AVAILABLE)
        managed = [p for p in self.params if getattr(p, "ds_manager", None) is not None]
        self._held = [(p.ds_manager, p.ds_manager.gather([p], own_storage=True)) for p in managed]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for p in self.params:
                if hasattr(p, "ds_tensor"):
                    if self.modifier_rank is not None:
                        _broadcast(p.data, self.modifier_rank, p.ds_group, p.ds_world_size)
                        _repartition_initial(p)
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            for manager, buffers in self._held:
                if self.modifier_rank is not None:
                    for p in (q for q in self.params if getattr(q, "ds_manager", None) is manager):
                        # an expert parameter's holders are its expert-data-parallel group
                        data_parallel = manager.ctx.for_experts() if getattr(p, "expert_parallel", False) else \
                            manager.ctx
                        _broadcast(p.data, self.modifier_rank, data_parallel.data_parallel_group,
                                   data_parallel.data_parallel_size)
                        manager.write_partition(p, p.data)
                        manager.on_partition_edited(p)
                manager.release(buffers, keep_edits=self.modifier_rank is not None)
        return False


def _broadcast(tensor, src, group, size):
    if size > 1:
        dist.broadcast(tensor, group_src=src, group=group)


def _repartition_initial(param):
    piece_size = param.ds_tensor.numel()
    rank = dist.get_rank(param.ds_group) if param.ds_world_size > 1 else 0
    flat = param.data.reshape(-1)
    lo, hi = rank * piece_size, min((rank + 1) * piece_size, flat.numel())
    param.ds_tensor.zero_()
    if lo < hi:
        param.ds_tensor[:hi - lo].copy_(flat[lo:hi])
