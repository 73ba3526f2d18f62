"""An unmodified DeepSpeed client on our engine (issue 45, Build item 1 and rows 1-5): `python -m
megatron.zero.as_deepspeed client.py` resolves `import deepspeed` and DeepSpeed-Chat's `from deepspeed.X import Y`
to megatron.zero; FusedAdam / DeepSpeedCPUAdam step as DeepSpeed's; ZeRO-3 parameters carry ds_id / ds_status."""
import importlib.util
import inspect
import json
import math
import os
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron import zero
from megatron.zero.as_deepspeed.accelerator import get_accelerator
from megatron.zero.as_deepspeed.adam import DeepSpeedCPUAdam, FusedAdam
from mpu import get_backend, get_device
from tests.helpers import REPO, script_env
from tests import warm_python

PYTHON = sys.executable
STEPS, LR, BETAS = 5, 1e-2, (0.9, 0.95)

# DeepSpeed-Chat's calls (utils/utils.py, main.py), written against DeepSpeed's names only.
CLIENT = textwrap.dedent('''
    import json
    import sys

    import torch
    import torch.nn.functional as F

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


    def to_fetch(params):                       # DeepSpeed-Chat's _z3_params_to_fetch
        return [p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


    def statuses(model):
        return {name: p.ds_status.name for name, p in model.named_parameters()}


    offload = sys.argv[1] == "offload"
    gather = sys.argv[1] == "gather"            # our key: the gather path at dp 1 too, DeepSpeed's statuses
    deepspeed.init_distributed()
    device = torch.device(get_accelerator().device_name())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 16,
                                    "offload_optimizer": {"device": "cpu" if offload else "none"},
                                    **({"stage3_resident_at_dp1": False} if gather else {})}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    out = {"after_init": statuses(model), "ids": [p.ds_id for p in model.parameters()]}
    recursive_setattr(model, "1", torch.nn.Tanh())
    out["helpers"] = recursive_getattr(model, "2.bias") is model[2].bias and isinstance(model[1], torch.nn.Tanh)
    Adam = DeepSpeedCPUAdam if offload else FusedAdam   # as DeepSpeed-Chat picks
    optimizer = Adam(model.parameters(), lr=%(lr)r, betas=%(betas)r)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    out["after_initialize"] = statuses(engine.module)
    out["losses"] = []
    for step in range(%(steps)d):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        loss = F.mse_loss(engine(x), torch.sin(x[:, :4]))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    out["after_step"] = statuses(engine.module)
    saved, inside = {}, {}
    for name, p in engine.module.named_parameters():   # DeepSpeed-Chat's save_zero_three_model
        with deepspeed.zero.GatheredParameters(to_fetch([p]), enabled=True):
            inside[name] = p.ds_status.name
            saved[name] = p.data.cpu()
    out["inside_gathered"], out["after_gathered"] = inside, statuses(engine.module)
    out["saved"] = {name: t.tolist() for name, t in saved.items()}
    with torch.no_grad():
        engine(torch.zeros(4, 8, device=device))
    out["after_no_grad_forward"] = statuses(engine.module)
    total = torch.ones(1, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    dist.barrier()
    accelerator = get_accelerator()
    out["comm"] = [dist.is_initialized(), dist.get_rank(), dist.get_world_size(), total.item()]
    out["accelerator"] = [accelerator is deepspeed.get_accelerator(), accelerator.device_name(),
                          accelerator.current_device_name(), accelerator.communication_backend_name()]
    out["modules"] = [deepspeed.__version__, type(engine).__module__, FusedAdam.__module__]
    out["engine_class"] = isinstance(engine, deepspeed.DeepSpeedEngine)
    try:        # transformers' save_pretrained unwraps models through accelerate, which imports DeepSpeedEngine
        from accelerate.utils import extract_model_from_parallel
        out["unwrapped"] = extract_model_from_parallel(engine) is engine.module
    except ImportError:
        out["unwrapped"] = None
    print("RESULT " + json.dumps(out))
''') % {"lr": LR, "betas": BETAS, "steps": STEPS}


def _run(args, tmp_path, env=None):
    result = warm_python.run([PYTHON, *args], cwd=REPO, env=script_env(env or {}), capture_output=True, text=True,
                             timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def _result(stdout):
    return json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def _reference(steps):
    """The same model and batches with torch's AdamW at weight_decay 0 (FusedAdam's default), no engine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = F.mse_loss(model(x), torch.sin(x[:, :4]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("variant", ["fused", "offload", "gather"])
def test_a_deepspeed_chat_style_client_runs_unchanged_at_zero3(tmp_path, variant):
    """One process: dp 1, where the parameters are resident (stage3.py: whole views of their partitions, AVAILABLE
    from deepspeed.initialize on, so the client fetches none, as at stages 0-2); "gather" turns that off
    (stage3_resident_at_dp1: false) and pins DeepSpeed's statuses, which gathers at dp 1 too."""
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    out = _result(_run(["-m", "megatron.zero.as_deepspeed", str(client), variant], tmp_path))
    assert out["modules"] == ["0.19.8", "megatron.zero.engine", "megatron.zero.as_deepspeed.adam"]
    assert out["engine_class"] and out["unwrapped"] is (True if importlib.util.find_spec("accelerate") else None)
    assert out["comm"] == [True, 0, 1, 1.0] and out["helpers"]
    assert out["accelerator"] == [True, "cpu", "cpu", "gloo"]
    assert len(set(out["ids"])) == 4
    every = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert out["after_init"] == dict.fromkeys(every, "NOT_AVAILABLE")            # zero.Init's pieces
    if variant != "gather":
        for key in ("after_initialize", "after_step", "inside_gathered", "after_gathered", "after_no_grad_forward"):
            assert out[key] == dict.fromkeys(every, "AVAILABLE"), key
    else:
        _check_deepspeed_statuses(out, every)
    losses, params = _reference(STEPS)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(out["losses"], losses)), (out["losses"], losses)
    for name, value in out["saved"].items():
        torch.testing.assert_close(torch.tensor(value), params[name].detach(), rtol=1e-5, atol=1e-6)


def _check_deepspeed_statuses(out, every):
    assert out["after_initialize"] == dict.fromkeys(every, "NOT_AVAILABLE")
    # the biases (16 and 4 elements) are persistent: whole, but stale after a step until their next use, so a
    # client that reads AVAILABLE parameters directly never saves last step's values
    assert out["after_step"] == dict.fromkeys(every, "NOT_AVAILABLE")
    assert out["inside_gathered"] == dict.fromkeys(every, "AVAILABLE")
    # DeepSpeed frees every parameter of a GatheredParameters context without a modifier rank on exit (edits made
    # inside are lost), whole ones too; a forward gathers the whole ones again
    assert out["after_gathered"] == dict.fromkeys(every, "NOT_AVAILABLE")
    assert out["after_no_grad_forward"] == {"0.weight": "NOT_AVAILABLE", "0.bias": "AVAILABLE",
                                            "2.weight": "NOT_AVAILABLE", "2.bias": "AVAILABLE"}


def test_run_module_form_and_unknown_deepspeed_modules(tmp_path):
    (tmp_path / "ds_module_client.py").write_text(textwrap.dedent('''
        import sys
        import deepspeed
        try:
            import deepspeed.inference.engine
        except ModuleNotFoundError as e:
            print("REFUSED", e)
        print("ARGV", sys.argv[1:], deepspeed.initialize.__module__)
    '''))
    stdout = _run(["-m", "megatron.zero.as_deepspeed", "-m", "ds_module_client", "--flag", "1"], tmp_path,
                  {"PYTHONPATH": str(tmp_path)})
    assert "ARGV ['--flag', '1'] megatron.zero.builder" in stdout
    assert "REFUSED deepspeed.inference is not provided by megatron.zero.as_deepspeed (it provides deepspeed," in stdout


REAL_DEEPSPEED = textwrap.dedent('''
    import inspect, json, sys
    import megatron.zero                                  # importing our engine does not claim the name
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from megatron.zero import as_deepspeed
    real = deepspeed
    def signature(cls):
        return [(p.name, repr(p.default)) for p in list(inspect.signature(cls.__init__).parameters.values())[1:]]
    out = {"fused": signature(FusedAdam), "cpu": signature(DeepSpeedCPUAdam),
           "status": [(s.name, s.value) for s in ZeroParamStatus], "real_first": "site-packages" in real.__file__}
    try:
        as_deepspeed.install()
    except RuntimeError as e:
        out["refused"] = str(e)
    out["still_real"] = sys.modules["deepspeed"] is real
    as_deepspeed.install(force=True)
    import deepspeed
    from deepspeed.ops.adam import FusedAdam as Ours
    out["forced"] = [deepspeed is not real, Ours.__module__]
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is a test requirement")
def test_a_real_deepspeed_is_not_shadowed_and_its_signatures_are_ours(tmp_path):
    script = tmp_path / "real.py"
    script.write_text(REAL_DEEPSPEED)
    out = _result(_run([str(script)], tmp_path, {"DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO}))
    assert out["real_first"] and out["still_real"]
    assert out["refused"].startswith("a real DeepSpeed is already imported (") and "force=True" in out["refused"]
    assert out["forced"] == [True, "megatron.zero.as_deepspeed.adam"]
    assert out["status"] == [[s.name, s.value] for s in zero.ZeroParamStatus]
    assert out["fused"] == _signature(FusedAdam) and out["cpu"] == _signature(DeepSpeedCPUAdam)


def _signature(cls):
    """[name, repr(default)] of each constructor argument after self (as the script above prints them)."""
    return [[p.name, repr(p.default)] for p in list(inspect.signature(cls.__init__).parameters.values())[1:]]


# ---- FusedAdam / DeepSpeedCPUAdam ------------------------------------------------------------------------------
def _deepspeed_adam(p, grads, lr, betas, eps, weight_decay, adam_w_mode):
    """DeepSpeed's multi_tensor_adam kernel in float64: mode 0 adds L2 decay to the gradient, mode 1 adds the
    decay to the bias-corrected update (decoupled: AdamW)."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double() + (0 if adam_w_mode else weight_decay * p)
        m, v = betas[0] * m + (1 - betas[0]) * g, betas[1] * v + (1 - betas[1]) * g * g
        denom = (v / (1 - betas[1] ** t)).sqrt() + eps
        p = p - lr * (m / (1 - betas[0] ** t) / denom + (weight_decay * p if adam_w_mode else 0))
    return p


def _steps(optimizer_class, grads, **kwargs):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 33))
    optimizer = optimizer_class([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


@pytest.mark.parametrize("cls,mode_arg", [(FusedAdam, "adam_w_mode"), (DeepSpeedCPUAdam, "adamw_mode")])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_deepspeed_adams_step_as_deepspeed_and_torch(cls, mode_arg, adam_w_mode):
    grads = [torch.randn(33, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours = _steps(cls, grads, **kwargs, **{mode_arg: adam_w_mode})
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam       # Adam: L2 decay on the gradient
    assert torch.equal(ours, _steps(torch_class, grads, **kwargs, fused=True))
    reference = _deepspeed_adam(torch.linspace(-1, 1, 33), grads, adam_w_mode=adam_w_mode, **kwargs)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-6, atol=1e-7)
    decay_free = _deepspeed_adam(torch.linspace(-1, 1, 33), grads, adam_w_mode=adam_w_mode,
                                 **dict(kwargs, weight_decay=0.0))
    assert not torch.allclose(ours.double(), decay_free, rtol=1e-6, atol=1e-7)   # the decay was applied


def test_deepspeed_adams_default_to_no_weight_decay_and_torchs_fastest_kernel():
    p = torch.nn.Parameter(torch.ones(3))
    for optimizer in (FusedAdam([p]), DeepSpeedCPUAdam([p])):
        group = optimizer.param_groups[0]
        assert group["weight_decay"] == 0 and group["decoupled_weight_decay"] and group["fused"] is True
    optimizer = FusedAdam([p])
    p.grad = torch.ones(3)
    optimizer.zero_grad()
    assert p.grad is None                            # set_grad_none=True
    optimizer = FusedAdam([p], set_grad_none=False)
    p.grad = torch.ones(3)
    optimizer.zero_grad()
    assert torch.equal(p.grad, torch.zeros(3))


@pytest.mark.parametrize("cls,kwargs,named", [
    (FusedAdam, {"bias_correction": False}, "bias_correction=False"), (FusedAdam, {"amsgrad": True}, "amsgrad=True"),
    (DeepSpeedCPUAdam, {"bias_correction": False}, "bias_correction=False"),
    (DeepSpeedCPUAdam, {"fp32_optimizer_states": False}, "fp32_optimizer_states=False")])
def test_what_torch_cannot_run_is_refused_by_name(cls, kwargs, named):
    with pytest.raises(ValueError, match=named):
        cls([torch.nn.Parameter(torch.ones(2))], **kwargs)


# ---- accelerator, ds_status before the engine -----------------------------------------------------------------
def test_the_accelerator_answers_from_mpus_device():
    accelerator = get_accelerator()
    device = get_device()
    assert accelerator.device_name() == device.type and accelerator.communication_backend_name() == get_backend()
    assert torch.device(accelerator.current_device_name()) == device if device.type == "cuda" else \
        accelerator.current_device_name() == "cpu"
    assert accelerator.is_available() and accelerator.on_accelerator(torch.ones(1, device=device))
    accelerator.manual_seed(3)
    first = torch.rand(2, device=device)
    accelerator.manual_seed(3)
    assert torch.equal(first, torch.rand(2, device=device))
    accelerator.synchronize()
    accelerator.empty_cache()


def test_zero_init_parameters_carry_ds_id_and_ds_status():
    with zero.Init():
        model = torch.nn.Linear(3, 2)
    assert model.weight.ds_id != model.bias.ds_id
    assert {p.ds_status for p in model.parameters()} == {zero.ZeroParamStatus.NOT_AVAILABLE}
    with zero.GatheredParameters(list(model.parameters())):
        assert {p.ds_status for p in model.parameters()} == {zero.ZeroParamStatus.AVAILABLE}
        assert model.weight.shape == (2, 3)
    assert {p.ds_status for p in model.parameters()} == {zero.ZeroParamStatus.NOT_AVAILABLE}


# ---- dotted-name helpers at depth (issue 57) ---------------------------------------------------------------------
@pytest.mark.parametrize("name, path", [("0.1", (0, 1)), ("0.1.0", (0, 1, 0))])
def test_recursive_setattr_replaces_the_module_at_a_nested_dotted_name(name, path):
    """At "0.1" every split agrees; at "0.1.0" a split at the first dot ("0" | "1.0") would set a module literally
    named "1.0" on model[0] and leave model[0][1][0] alone."""
    from megatron.zero.as_deepspeed.module_utils import recursive_getattr, recursive_setattr
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                    torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())))
    replacement = torch.nn.Tanh()
    recursive_setattr(model, name, replacement)
    target = model
    for index in path:
        target = target[index]
    assert target is replacement and recursive_getattr(model, name) is replacement
    assert not any("." in key for sub in model.modules() for key in sub._modules)   # no module named "1.0"
