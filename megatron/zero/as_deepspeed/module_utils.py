"""`deepspeed.utils.module_utils` (and its old home `deepspeed.compression.helper`): dotted-name get/set."""


def recursive_getattr(model, module_name):
    """`recursive_getattr(model, "h.0.attn")` is `model.h[0].attn` (getattr works on ModuleList by index name)."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name, module):
    """Set the attribute at a dotted name (replace a submodule, as DeepSpeed-Chat's LoRA conversion does)."""
    parent, _, last = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, last, module)
