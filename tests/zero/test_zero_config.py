"""DeepSpeed-documentation configs load unchanged; every kind of bad config names its key and value."""
import argparse
import dataclasses
import glob
import json
import os

import pytest
import torch

from megatron import zero
from megatron.zero.config import ZERO_ALIASES, Config, ConfigError, load_config, resolve_batch_triangle
from megatron.zero.lr_schedules import WarmupDecayLR, WarmupLR
from tests.helpers import REPO, TinyNet, ZERO_CONFIGS

CONFIG_DIR = ZERO_CONFIGS
EXAMPLES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json")))


SCRIPT_CONFIGS = sorted(glob.glob(os.path.join(REPO,
                                                "scripts", "*.json")))
# DeepSpeed's documented defaults for what a config leaves out.
ZERO_DEFAULTS = {"stage": 0, "allgather_partitions": True, "allgather_bucket_size": 500_000_000,
                 "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 500_000_000,
                 "contiguous_gradients": False, "sub_group_size": 1_000_000_000,
                 "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                 "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                 "stage3_gather_16bit_weights_on_model_save": False}   # DeepSpeed's defaults
FP16_DEFAULTS = {"enabled": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}
CHECKPOINTING_DEFAULTS = {"partition_activations": False, "contiguous_memory_optimization": False,
                          "number_checkpoints": None, "cpu_checkpointing": False,
                          "synchronize_checkpoint_boundary": False, "profile": False}


def _expected_batch(raw, dp):
    """(train_batch_size, micro batch per gpu, accumulation steps): global = micro x accumulation x dp."""
    train, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    accumulation = raw.get("gradient_accumulation_steps")
    if train is not None and micro is not None:
        assert train % (micro * dp) == 0
        accumulation = train // (micro * dp)
    elif train is not None:
        accumulation = accumulation or 1
        assert train % (accumulation * dp) == 0
        micro = train // (accumulation * dp)
    else:
        accumulation = accumulation or 1
        train = micro * accumulation * dp
    return train, micro, accumulation


@pytest.mark.parametrize("path", SCRIPT_CONFIGS + EXAMPLES, ids=os.path.basename)
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_example_configs_give_the_values_they_write(path, dp):
    """Every value the file writes (json.load'ed here), DeepSpeed's default for each one it leaves out, and the
    batch triangle worked out for `dp`; the loss scaler starts at the scale the fp16 block asks for."""
    with open(path) as f:
        raw = json.load(f)
    config = load_config(path, data_parallel_size=dp)
    train, micro, accumulation = _expected_batch(raw, dp)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
        == (train, micro, accumulation)
    assert train == micro * accumulation * dp

    zero_raw = raw.get("zero_optimization", {})
    if isinstance(zero_raw, bool):                    # old DeepSpeed: "zero_optimization": true means stage 1
        zero_raw = {"stage": int(zero_raw)}
    for key, default in ZERO_DEFAULTS.items():
        value = getattr(config.zero_optimization, key)
        assert value == zero_raw.get(key, default), key
        assert type(value) is type(default) or value == "auto", key     # 5e8 in the file is the int 500000000
    for key in ("offload_optimizer", "offload_param"):     # device "none" unless the file says otherwise
        assert getattr(config.zero_optimization, key).device == zero_raw.get(key, {}).get("device", "none"), key

    fp16_raw = raw.get("fp16", {})
    for key, default in FP16_DEFAULTS.items():
        assert getattr(config.fp16, key) == fp16_raw.get(key, default), key
    assert config.bf16.enabled == raw.get("bf16", {}).get("enabled", False)
    assert not (config.fp16.enabled and config.bf16.enabled)
    scaler_config = config.fp16.loss_scaler_config()
    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        assert getattr(scaler_config, key) == fp16_raw.get(key, FP16_DEFAULTS[key]), key
    loss_scale = fp16_raw.get("loss_scale", 0)
    initial = 2.0 ** fp16_raw.get("initial_scale_power", 16) if loss_scale == 0 else float(loss_scale)
    assert zero.LossScaler(scaler_config).cur_scale == initial

    assert config.gradient_clipping == raw.get("gradient_clipping", 1.0)   # DeepSpeed 0.19.8's default
    assert config.steps_per_print == raw.get("steps_per_print", 10)
    assert config.wall_clock_breakdown == raw.get("wall_clock_breakdown", False)
    checkpointing_raw = raw.get("activation_checkpointing", {})
    for key, default in CHECKPOINTING_DEFAULTS.items():
        assert getattr(config.activation_checkpointing, key) == checkpointing_raw.get(key, default), key
    if "optimizer" in raw:
        assert config.optimizer.type.lower() == raw["optimizer"]["type"].lower()
        assert config.optimizer.params == raw["optimizer"].get("params", {})
    else:
        assert config.optimizer is None
    if "scheduler" in raw:
        assert (config.scheduler.type, config.scheduler.params) == (raw["scheduler"]["type"],
                                                                    raw["scheduler"].get("params", {}))
    else:
        assert config.scheduler is None


def test_example_configs_are_all_found():
    names = [os.path.basename(p) for p in SCRIPT_CONFIGS + EXAMPLES]
    assert {"ds_zero2_config.json", "ds_zero2_config_bf16.json", "getting_started.json",
            "megatron_ds_zero2_config.json", "zero_tutorial_stage2.json", "bf16_zero2_warmup_decay.json"} <= set(names)


def test_example_values_are_read():
    mega = load_config(os.path.join(CONFIG_DIR, "megatron_ds_zero2_config.json"), data_parallel_size=2)
    assert (mega.train_micro_batch_size_per_gpu, mega.zero_optimization.stage) == (8, 2)
    assert mega.zero_optimization.overlap_comm and mega.fp16.enabled and mega.gradient_clipping == 1.0
    assert mega.optimizer.type == "Adam" and mega.optimizer.params["betas"] == [0.9, 0.95]
    tutorial = load_config(os.path.join(CONFIG_DIR, "zero_tutorial_stage2.json"), data_parallel_size=2)
    assert tutorial.zero_optimization.reduce_bucket_size == 500_000_000          # written as 5e8
    assert tutorial.gradient_accumulation_steps == 2
    assert load_config(os.path.join(CONFIG_DIR, "getting_started.json")).zero_optimization.stage == 1
    bf16 = load_config(os.path.join(CONFIG_DIR, "bf16_zero2_warmup_decay.json"), data_parallel_size=4)
    assert bf16.train_batch_size == 32 and bf16.bf16.enabled
    assert bf16.activation_checkpointing.partition_activations and bf16.scheduler.type == "WarmupDecayLR"


def test_engine_from_example_config_with_json_optimizer_and_scheduler():
    engine, optimizer, _, scheduler = zero.initialize(
        model=TinyNet(), config=os.path.join(CONFIG_DIR, "bf16_zero2_warmup_decay.json"))
    assert isinstance(optimizer.optimizer, torch.optim.AdamW) and isinstance(scheduler, WarmupDecayLR)
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and engine.get_lr() == [0.0]
    assert next(engine.module.parameters()).dtype == torch.bfloat16 and engine.zero_optimization_stage() == 2


def test_config_from_args_and_cli_flags(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}))
    parser = zero.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path), "--deepspeed_activation_checkpointing"])
    assert args.deepspeed and args.deepspeed_activation_checkpointing
    engine, optimizer, _, _ = zero.initialize(args=args, model=TinyNet())
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)      # DeepSpeed's "Adam" is AdamW by default
    assert engine.train_batch_size() == 4 and engine.get_lr() == [0.1]
    with pytest.raises(ConfigError, match="both args.deepspeed_config"):
        zero.initialize(args=args, model=TinyNet(), config={"train_batch_size": 4})


BAD_CONFIGS = [
    ({"train_batch_size": 8, "zero_optimisation": {"stage": 2}},
     "unknown key 'zero_optimisation' in the config; did you mean 'zero_optimization'?"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": True}},
     "unknown key 'overlap_com' in 'zero_optimization'; did you mean 'overlap_comm'?"),
    ({"train_batch_size": 8, "fp16": {"enabeld": True}}, "did you mean 'enabled'"),
    ({"train_batch_size": "8"}, "train_batch_size: expected int, got str '8'"),
    ({"train_batch_size": 8.5}, "train_batch_size: expected int, got float 8.5"),
    ({"train_batch_size": 8, "fp16": {"enabled": 1}}, "fp16.enabled: expected bool, got int 1"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": True}}, "zero_optimization.stage: expected int"),
    ({"train_batch_size": 8, "fp16": []}, "fp16: expected an object, got list"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
     r"train_batch_size \(16\) != train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps \(1\) "
     r"x data-parallel size \(2\) = 8"),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     r"train_batch_size \(10\) is not divisible by train_micro_batch_size_per_gpu \(4\) x data-parallel size "
     r"\(2\) = 8"),
    ({"train_batch_size": 9}, r"train_batch_size \(9\) is not divisible by gradient_accumulation_steps \(1\) x "
                              r"data-parallel size \(2\) = 2"),
    ({"gradient_accumulation_steps": 2}, "must set train_batch_size or train_micro_batch_size_per_gpu"),
    ({"train_batch_size": 0}, "train_batch_size must be positive, got 0"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}}, r"stage: 4 is not supported \(0, 1, 2 or 3\)"),
    ({"train_batch_size": 8, "zero_optimization": {"cpu_offload": True}}, "offload_optimizer needs stage 1, 2 or 3"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     r"offload_optimizer.device: 'nvme' is not supported: use \"cpu\""),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}},
     "unknown key 'devise' in 'zero_optimization.offload_param'; did you mean 'device'"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "automatic"}},
     "stage3_prefetch_bucket_size: expected int, got str 'automatic'"),
    ({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 0}}, "reduce_bucket_size must be positive"),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    ({"train_batch_size": 8, "optimizer": {"type": "Lamb"}}, r"optimizer.type: 'Lamb' is not supported"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"learning_rate": 1}}},
     "unknown key 'learning_rate' in 'optimizer.params'"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9]}}},
     "betas: expected two numbers"),
    # torch's ranges for its optimizers' numbers, one line at parse time (issue 67)
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}},
     r"optimizer.params.betas\[1\] is 1.0: it must be a number in \[0, 1\)"),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [-0.1, 0.9]}}},
     r"optimizer.params.betas\[0\] is -0.1: it must be a number in \[0, 1\)"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": -0.001}}},
     "optimizer.params.lr is -0.001: it must be zero or a positive number"),
    ({"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"eps": -1e-8}}},
     "optimizer.params.eps is -1e-08: it must be zero or a positive number"),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"weight_decay": -0.01}}},
     "optimizer.params.weight_decay is -0.01: it must be zero or a positive number"),
    ({"train_batch_size": 8, "optimizer": {"type": "Muon", "params": {"muon_lr": -1}}},
     "optimizer.params.muon_lr is -1.0: it must be zero or a positive number"),
    ({"train_batch_size": 8, "optimizer": {"type": "Muon", "params": {"adam_lr": -1}}},
     "optimizer.params.adam_lr is -1.0: it must be zero or a positive number"),
    ({"train_batch_size": 8, "optimizer": {"type": "Muon", "params": {"momentum": 1.0}}},
     r"optimizer.params.momentum is 1.0: it must be a number in \[0, 1\)"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLr"}}, "did you mean 'WarmupLR'"),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps is required"),
    ({"train_batch_size": 8, "gradient_clipping": -1}, "gradient_clipping must be >= 0, got -1.0"),
    ({"train_batch_size": 8, "fp16": {"hysteresis": 0}}, r"hysteresis \(0\)"),
    ([1, 2], "must be a JSON object, got list"),
]


@pytest.mark.parametrize("raw,message", BAD_CONFIGS, ids=[m[:40] for _, m in BAD_CONFIGS])
def test_bad_config_messages(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw, data_parallel_size=2)


def test_the_edges_of_the_optimizer_ranges_are_accepted():
    """torch's own edges: an lr of 0 (a JSON scheduler sets the lr), betas 0 and just below 1, eps, decay 0."""
    edges = {"lr": 0.0, "betas": [0.0, 0.9999], "eps": 0.0, "weight_decay": 0.0, "muon_lr": 0.0, "adam_lr": 0.0,
             "momentum": 0.0}
    config = load_config({"train_batch_size": 8, "optimizer": {"type": "Muon", "params": edges}}, data_parallel_size=2)
    assert config.optimizer.params == edges


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,}')
    with pytest.raises(ConfigError, match="broken.json' is not valid JSON"):
        load_config(str(tmp_path / "broken.json"))


def test_batch_triangle_any_two_determine_the_third():
    assert resolve_batch_triangle(32, 4, None, 2) == (32, 4, 4)
    assert resolve_batch_triangle(32, None, 4, 2) == (32, 4, 4)
    assert resolve_batch_triangle(None, 4, 4, 2) == (32, 4, 4)
    assert resolve_batch_triangle(None, 4, None, 2) == (8, 4, 1)
    assert resolve_batch_triangle(32, None, None, 4) == (32, 8, 1)


def test_warmup_schedules_follow_deepspeed_formulas():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    linear = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    lrs = []
    for _ in range(6):
        linear.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    decay = WarmupDecayLR(opt, total_num_steps=8, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    for _ in range(7):
        decay.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2 / 4)        # (8 - 6) / (8 - 4)


def test_auto_values_resolve_from_the_hidden_size_and_cpu_offload_is_offload_optimizer():
    from megatron.zero.config import resolve_auto_values
    config = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9}}, data_parallel_size=2)
    assert resolve_auto_values(config, 64) == {"reduce_bucket_size": 64 * 64, "stage3_prefetch_bucket_size": 3686,
                                               "stage3_param_persistence_threshold": 640}
    assert config.zero_optimization.stage3_prefetch_bucket_size == 3686          # int(0.9 * 64^2)
    # A model without config.hidden_size: DeepSpeed 0.19.8 drops the "auto" keys, so its defaults apply.
    no_hidden = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}}, 2)
    assert resolve_auto_values(no_hidden, None) == {"reduce_bucket_size": 500_000_000,
                                                    "stage3_prefetch_bucket_size": 50_000_000,
                                                    "stage3_param_persistence_threshold": 100_000}
    assert no_hidden.zero_optimization.reduce_bucket_size == 500_000_000
    old = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": True}}, 2)
    assert old.zero_optimization.offload_optimizer.device == "cpu" and old.zero_optimization.offload_optimizer.enabled


def test_deepspeed_keys_with_no_effect_are_named_and_missing_features_refused():
    config = load_config({"train_batch_size": 8, "zero_force_ds_cpu_optimizer": False,
                          "communication_data_type": "fp32", "tensorboard": {"enabled": True, "output_path": "tb"},
                          "hybrid_engine": {"enabled": False, "release_inference_cache": True},
                          "zero_optimization": {"stage": 3, "round_robin_gradients": True}}, 2)
    assert config.no_effect == {
        "zero_force_ds_cpu_optimizer": "offload steps any client Adam on the host, DeepSpeedCPUAdam included",
        "communication_data_type": "gradients are reduced in the parameters' dtype (fp32 masters are never sent)",
        "tensorboard": "use --tensorboard-dir",
        "hybrid_engine.release_inference_cache": "the KV cache is built per call and dropped after it",
        "zero_optimization.round_robin_gradients": "gradient partitions are contiguous ranges"}
    assert load_config({"train_batch_size": 8}, 2).no_effect == {}
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "elasticity": {"enabled": True}}, 2)
    assert str(info.value) == ("elasticity is enabled in the config, but megatron.zero has no elasticity (launch "
                               "with a fixed world size): remove the block or set \"enabled\": false")
    fp16 = load_config({"train_batch_size": 8, "fp16": {"enabled": True, "min_loss_scale": 1e-5}}, 2).fp16
    assert fp16.min_loss_scale == 1e-5      # DeepSpeed's pydantic wants an int here; a float is what users mean


def _deepspeed_schema():
    """{dotted key: DeepSpeed 0.19.8's default} from DeepSpeed's own source: every top-level key its
    DeepSpeedConfig reads (recorded while it parses a minimal config), the key constants of its constants module
    (a NAME with a NAME_DEFAULT) that belong to fp16/bf16/optimizer, and the fields and aliases of its pydantic
    zero_optimization / offload / fp16 / bf16 / hybrid_engine models; activation_checkpointing's ACT_CHKPT_*
    constants."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime import constants
    from deepspeed.runtime.activation_checkpointing import config as checkpointing
    from deepspeed.runtime.config import DeepSpeedConfig, HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    read = set()

    class Recording(dict):      # records every key DeepSpeedConfig asks its param dict about
        def get(self, key, *default):
            read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            read.add(key)
            return super().__contains__(key)

        def keys(self):
            owner = self

            class Keys:
                def __contains__(self, key):
                    read.add(key)
                    return dict.__contains__(owner, key)

                def __iter__(self):
                    return iter(dict.keys(owner))
            return Keys()
    DeepSpeedConfig(Recording(train_batch_size=1))
    schema = {key: getattr(constants, name + "_DEFAULT", {}) for name, key in vars(constants).items()
              if isinstance(key, str) and key in read and name.isupper()}
    schema.update({key: {} for key in read if key not in schema})
    for key in ("fp16", "bf16", "bfloat16", "zero_optimization", "activation_checkpointing", "optimizer",
                "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        schema.pop(key, None)                  # walked field by field below, or the batch triangle itself
    schema["optimizer.legacy_fusion"] = constants.LEGACY_FUSION_DEFAULT
    schema.update({f"activation_checkpointing.{key}": getattr(checkpointing, name + "_DEFAULT")
                   for name, key in vars(checkpointing).items()
                   if name.startswith("ACT_CHKPT_") and hasattr(checkpointing, name + "_DEFAULT")})
    models = {"fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config, "zero_optimization": DeepSpeedZeroConfig,
              "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig,
              "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
              "hybrid_engine": HybridEngineConfig}
    for prefix, model in models.items():
        for name, info in model.model_fields.items():
            default = info.get_default(call_default_factory=True)
            default = default.model_dump() if hasattr(default, "model_dump") else default
            for spelling in {name, info.alias or name}:
                schema[f"{prefix}.{spelling}"] = default
    return schema


def _nested(key, value):
    *blocks, name = key.split(".")
    raw = {name: value}
    for block in reversed(blocks):
        raw = {block: raw}
    return {"train_batch_size": 8, **raw}


def _our_fields(cls=None, prefix=""):
    """Dotted names of every field of our Config dataclasses (the keys we honour)."""
    names = set()
    for f in dataclasses.fields(cls or Config):
        names.add(prefix + f.name)
        if dataclasses.is_dataclass(f.type):
            names |= _our_fields(f.type, f"{prefix}{f.name}.")
    return names


def test_every_deepspeed_key_at_its_default_is_known():
    """DeepSpeed 0.19.8's whole schema, walked from its own source: no key at its default value is "unknown";
    each is honoured (a field of our dataclasses) or named in no_effect; only blocks DeepSpeed 0.19.8 itself
    refuses may be refused at their default."""
    schema = _deepspeed_schema()
    removed = {"graph_harvesting", "sparse_attention"}      # DeepSpeed 0.19.8 refuses these itself
    assert len(schema) == 146 and "zero_optimization.memory_efficient_linear" in schema   # DeepSpeed 0.19.8
    ours, kinds = _our_fields() | {"bfloat16.enabled"}, {}
    for key, default in sorted(schema.items()):
        try:
            config = load_config(_nested(key, default), 2)
        except ConfigError as e:
            assert "unknown key" not in str(e) and key in removed, (key, default, str(e))
            continue
        *block, name = key.split(".")
        canonical = ".".join(block + [ZERO_ALIASES.get(name, name) if block == ["zero_optimization"] else name])
        if canonical in config.no_effect:
            kinds[key] = "refused when on" if config.no_effect[canonical].startswith("off; ") else "no effect"
        else:
            assert canonical in ours, (key, "neither honoured nor named")
            kinds[key] = "honoured"
    assert kinds["zero_optimization.prefetch_bucket_size"] == "honoured"    # DeepSpeed's field name for the key
    assert kinds["zero_optimization.memory_efficient_linear"] == "no effect"
    assert kinds["zero_optimization.zero_quantized_weights"] == "refused when on"
    assert kinds["hybrid_engine"] == kinds["hybrid_engine.enabled"] == "honoured"      # engine.generate
    hybrid_rest = {key: kind for key, kind in kinds.items()
                   if key.startswith("hybrid_engine.") and key != "hybrid_engine.enabled"}
    assert hybrid_rest == dict.fromkeys(["hybrid_engine.max_out_tokens", "hybrid_engine.inference_tp_size",
                                        "hybrid_engine.release_inference_cache", "hybrid_engine.pin_parameters",
                                        "hybrid_engine.tp_gather_partition_size", "hybrid_engine.enable_cuda_graph"],
                                       "no effect")


@pytest.mark.parametrize("key,value,message", [
    ("zero_optimization.zero_quantized_weights", True, "zero_optimization.zero_quantized_weights: True is not "
                                                       "supported \\(weights are gathered unquantized\\)"),
    ("zero_optimization.zero_quantized_gradients", True, "gradients are reduced unquantized"),
    ("zero_optimization.offload_optimizer.super_offload", True, "SuperOffload"),
    ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}}, "compression"),
    ("compile", {"deepcompile": True}, "compile: .*DeepCompile"),
    ("gradient_allreduce_op", "sum", "gradient_allreduce_op: 'sum' is not supported"),
    ("bf16.bf16_optimizer_states", True, "optimizer states are fp32"),
    ("data_types", {"grad_accum_dtype": "fp32"}, "data_types: .*gradients accumulate"),
    # a block that is on by being there (as DeepSpeed reads it), with no "enabled" key at all
    ("sparse_attention", {"mode": "fixed"}, "sparse_attention is enabled .*not supported"),
])
def test_deepspeed_features_we_do_not_have_are_refused_when_on(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_nested(key, value), 2)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("zero", [{"offload_param": {"device": "cpu"}}, {"cpu_offload_param": True}])
def test_offload_param_below_stage_3_is_named_and_off_as_deepspeed_ignores_it(stage, zero):
    """DeepSpeed reads offload_param at stage 3 only (DeepSpeed-Chat's --offload sets it for its ZeRO-2 critic
    too, and DeepSpeed trains that critic): accepted, switched off and named, never refused."""
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": stage, **zero}}, 2)
    assert not config.zero_optimization.offload_param.enabled
    assert config.no_effect["zero_optimization.offload_param"] == \
        f"stage {stage}: only stage 3 partitions the parameters (offload_optimizer offloads at stages 1-3)"
    at_stage_3 = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, **zero}}, 2)
    assert at_stage_3.zero_optimization.offload_param.device == "cpu"
    assert "zero_optimization.offload_param" not in at_stage_3.no_effect


def test_deepspeed_chat_keys_are_named_and_misspellings_still_unknown():
    config = load_config({"train_batch_size": 8, "hybrid_engine": {"enabled": False, "max_out_tokens": 512},
                          "zero_optimization": {"stage": 3, "memory_efficient_linear": False,
                                                "prefetch_bucket_size": 3e7, "zero_quantized_weights": False,
                                                "offload_param": None, "overlap_comm": None},
                          "compile": {"deepcompile": False, "debug_log": True}}, 2)
    assert config.no_effect["zero_optimization.memory_efficient_linear"].startswith("linears are torch's")
    assert config.no_effect["hybrid_engine.max_out_tokens"].startswith("the KV cache is sized per call")
    assert "hybrid_engine" not in config.no_effect and not config.hybrid_engine.enabled   # honoured
    assert config.no_effect["zero_optimization.zero_quantized_weights"].startswith("off; ")
    assert config.zero_optimization.stage3_prefetch_bucket_size == 30_000_000
    assert not config.zero_optimization.offload_param.enabled and config.zero_optimization.overlap_comm is False
    assert load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload_param": True}},
                       2).zero_optimization.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match="unknown key 'memory_efficent_linear' in 'zero_optimization'; did you "
                                          "mean 'memory_efficient_linear'"):
        load_config({"train_batch_size": 8, "zero_optimization": {"memory_efficent_linear": True}}, 2)
    with pytest.raises(ConfigError, match="unknown key 'hybrid_engin' in the config; did you mean 'hybrid_engine'"):
        load_config({"train_batch_size": 8, "hybrid_engin": {}}, 2)


def test_script_test_config_is_the_default_but_for_its_micro_batch():
    """The scripts' tests run scripts/ds_zero2_config.json at micro batch 8 (tests/helpers.SCRIPT_TEST_DS_CONFIG):
    any other difference would test another configuration than make pretrain's."""
    from tests.helpers import REPO, SCRIPT_TEST_DS_CONFIG
    with open(os.path.join(REPO, "scripts", "ds_zero2_config.json")) as handle:
        default = json.load(handle)
    with open(SCRIPT_TEST_DS_CONFIG) as handle:
        test = json.load(handle)
    assert test.pop("train_micro_batch_size_per_gpu") == 8
    default.pop("train_micro_batch_size_per_gpu")
    assert test == default
