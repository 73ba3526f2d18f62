"""transformers' ZeRO-3 model building on our engine (issue 45 row 8): with a stage-3 HfDeepSpeedConfig alive,
`PreTrainedModel._from_config` enters `deepspeed.zero.Init(config_dict_or_path=...)` behind transformers'
prevent_arange_dtype_change (which reads and replaces partition_parameters.zero_wrapper_for_fp_tensor_constructor
and compares with _orig_torch_arange), then initializes the weights inside GatheredParameters. The model built so
is partitioned, initialized, and trains under `deepspeed.initialize` at stage 3 with the plain model's loss.
Run in a subprocess: the fake `deepspeed` and transformers' global config never reach this pytest process."""
import importlib.util
import json
import sys
import textwrap

import pytest

from tests.helpers import REPO, script_env
from tests import warm_python

CLIENT = textwrap.dedent('''
    import json
    import torch
    from megatron.zero import as_deepspeed
    as_deepspeed.install()
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    deepspeed.init_distributed()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    dschf = HfDeepSpeedConfig(config)          # kept alive: transformers holds a weakref
    out = {"zero3": is_deepspeed_zero3_enabled()}
    gpt_config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = GPT2LMHeadModel._from_config(gpt_config)          # transformers' ZeRO-3 path
    out["partitioned"] = all(hasattr(p, "ds_tensor") for p in model.parameters())
    out["numel_outside"] = sum(p.numel() for p in model.parameters())
    out["restored"] = [torch.arange is pp._orig_torch_arange, torch.zeros is pp._orig_torch_zeros,
                       pp.zero_wrapper_for_fp_tensor_constructor.__module__]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["std"] = weights["transformer.h.0.attn.c_attn.weight"].std().item()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    engine.eval()
    with torch.no_grad():
        out["loss"] = engine(input_ids=tokens, labels=tokens).loss.item()
    plain = GPT2LMHeadModel(gpt_config)
    plain.load_state_dict(weights)
    plain.eval()
    with torch.no_grad():
        out["plain"] = plain(input_ids=tokens, labels=tokens).loss.item()
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("deepspeed") is None,
                    reason="transformers and DeepSpeed (its metadata: transformers' is_deepspeed_available) are "
                           "test requirements")
def test_transformers_zero3_from_config_builds_partitioned_and_matches_plain(tmp_path):
    script = tmp_path / "hf_zero3.py"
    script.write_text(CLIENT)
    result = warm_python.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300,
                             env=script_env({"PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu"}))
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    out = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert out["zero3"] and out["partitioned"] and out["numel_outside"] == 0
    assert out["restored"] == [True, True, "megatron.zero.zero_init"]
    assert 0.015 < out["std"] < 0.025                 # initialized under GatheredParameters (initializer_range 0.02)
    assert abs(out["loss"] - out["plain"]) <= 1e-6


def test_init_accepts_deepspeeds_signature_and_config_dtype():
    import inspect

    import torch

    import mpu
    from megatron.zero import zero_init
    names = list(inspect.signature(zero_init.Init.__init__).parameters)[1:]
    assert names == ["module", "data_parallel_group", "mem_efficient_linear", "remote_device", "pin_memory",
                     "config_dict_or_path", "config", "enabled", "dtype", "mpu", "zero_param_parallel_group",
                     "zero_quantized_weights", "zero_quantized_nontrainable_weights",
                     "sequence_data_parallel_group", "param_swapper", "tensor_overrides"]
    with zero_init.Init(config_dict_or_path={"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}):
        layer = torch.nn.Linear(4, 4)
        buffer = torch.zeros(3)
        index = torch.arange(3)
    assert layer.weight.ds_tensor.dtype == torch.bfloat16 and buffer.dtype == torch.bfloat16 and index.dtype == torch.int64
    assert torch.zeros is zero_init._orig_torch_zeros
    with zero_init.Init():                            # no dtype: constructors default to the device only
        assert torch.zeros is not zero_init._orig_torch_zeros
        assert torch.zeros(2).device == torch.empty(2, device=None).device == mpu.get_device()
        assert torch.zeros(2).dtype == torch.float32
        torch.nn.Linear(2, 2)
    with zero_init.Init(tensor_overrides=[]):         # no overrides: constructors untouched (DeepSpeed's rule)
        assert torch.zeros is zero_init._orig_torch_zeros
    assert torch.zeros is zero_init._orig_torch_zeros
