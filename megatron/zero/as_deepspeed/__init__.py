"""Run a DeepSpeed client unchanged on megatron.zero: `import deepspeed` and `from deepspeed.X import Y` resolve
to this package's objects.

    python -m megatron.zero.as_deepspeed train.py --deepspeed_config ds.json
    python -m megatron.zero.as_deepspeed --num_gpus 2 train.py --deepspeed_config ds.json   # DeepSpeed's launcher
    torchrun --nproc_per_node 2 -m megatron.zero.as_deepspeed train.py --deepspeed_config ds.json
    python -m megatron.zero.as_deepspeed -m my_package.train ...

    from megatron.zero import as_deepspeed
    as_deepspeed.install()          # in-process; then `import deepspeed` is megatron.zero
    import deepspeed

Only when asked: importing megatron.zero never claims the name `deepspeed`, so an installed DeepSpeed stays
importable beside it. `install()` puts the modules of MODULES into sys.modules, ahead of any installed DeepSpeed;
a real DeepSpeed already imported is left in place unless `install(force=True)`. A `deepspeed.X` not in the table
fails at its import, naming what is provided, instead of half-loading the real package's submodule.
"""
import importlib.machinery
import sys
import types

from .. import __all__ as ZERO_API
from .. import zero_init
from . import accelerator, adam, comm, module_utils

DEEPSPEED_VERSION = "0.19.8"      # the DeepSpeed release whose API this mirrors (clients and transformers read it)

_TOP = sys.modules["megatron.zero"]

# DeepSpeed module path -> our module (used as it is) or the names a fresh module holds. A parent of a path here
# is a fresh module (dict), so that attaching its children never edits one of ours.
MODULES = {
    # DeepSpeedEngine: accelerate's unwrap_model (transformers' save_pretrained) unwraps instances of it
    "deepspeed": {**{name: getattr(_TOP, name) for name in ZERO_API}, "__version__": DEEPSPEED_VERSION,
                  "get_accelerator": accelerator.get_accelerator, "init_distributed": comm.init_distributed,
                  "DeepSpeedEngine": _TOP.ZeroEngine},
    "deepspeed.zero": _TOP,                       # Init, GatheredParameters, register_external_parameter
    "deepspeed.ops": {},
    "deepspeed.ops.adam": {"FusedAdam": adam.FusedAdam, "DeepSpeedCPUAdam": adam.DeepSpeedCPUAdam},
    "deepspeed.accelerator": {"get_accelerator": accelerator.get_accelerator},
    "deepspeed.comm": comm,
    "deepspeed.runtime": {},
    "deepspeed.runtime.zero": {},
    # ZeroParamStatus, Init, GatheredParameters, register_external_parameter, and the tensor-constructor names
    # transformers' ZeRO-3 model building reads and replaces (zero_wrapper_for_fp_tensor_constructor,
    # _orig_torch_arange, ...): the module itself, so that a replacement reaches Init
    "deepspeed.runtime.zero.partition_parameters": zero_init,
    "deepspeed.utils": {},
    "deepspeed.utils.module_utils": module_utils,
    "deepspeed.compression": {},
    "deepspeed.compression.helper": {"recursive_getattr": module_utils.recursive_getattr,
                                     "recursive_setattr": module_utils.recursive_setattr},
}

_MARK = "__megatron_zero_as_deepspeed__"


def install(force=False):
    """Make `deepspeed` and every path of MODULES import as ours; returns the `deepspeed` module. Idempotent.
    A real DeepSpeed already imported raises (its objects may already be in use) unless `force`, which drops
    every `deepspeed.*` entry of sys.modules first."""
    present = sys.modules.get("deepspeed")
    if present is not None and getattr(present, _MARK, False):
        return present
    if present is not None:
        if not force:
            raise RuntimeError(f"a real DeepSpeed is already imported ({getattr(present, '__file__', present)}): "
                               "as_deepspeed.install(force=True) replaces it with megatron.zero")
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
    modules = {path: _module(path, content) for path, content in MODULES.items()}
    for path, module in modules.items():
        parent, _, child = path.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    setattr(modules["deepspeed"], _MARK, True)
    sys.modules.update(modules)
    if not any(isinstance(finder, _Unprovided) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Unprovided())
    return modules["deepspeed"]


def _module(path, content):
    """A fresh package-like module holding `content`'s names (with a spec: importlib.util.find_spec reads it)."""
    if isinstance(content, types.ModuleType):
        return content
    module = types.ModuleType(path, f"DeepSpeed's {path}, provided by megatron.zero.as_deepspeed")
    module.__spec__ = importlib.machinery.ModuleSpec(path, None, is_package=True)
    module.__path__ = []          # a package: its unknown submodules reach _Unprovided
    module.__dict__.update(content)
    return module


class _Unprovided:
    """Meta path finder: a `deepspeed.*` module the table lacks fails naming the ones it has."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("deepspeed.") and sys.modules.get("deepspeed") is not None and \
                getattr(sys.modules["deepspeed"], _MARK, False):
            raise ModuleNotFoundError(f"{fullname} is not provided by megatron.zero.as_deepspeed (it provides "
                                      f"{', '.join(sorted(MODULES))}; docs/zero.md)", name=fullname)
        return None
