"""The tables of DeepSpeed 0.19.8's keys that are not fields of our schema (config_schema.py), and of the types
of what the parser checks by hand (optimizer and scheduler params, top-level no-effect scalars).

config.load_config reads them: a key here is accepted with no effect (named in `Config.no_effect` with the reason)
or refused by name when it switches on a feature we do not have. Every public name here is also importable from
megatron.zero.config.
"""

# Every DeepSpeed 0.19.8 key that is not a field of config_schema.py's dataclasses (those are honoured), with what
# we do:
#   NO_EFFECT: accepted at any value so existing files load unchanged, and named with the reason in one start-up
#     line (Config.no_effect);
#   REFUSED: accepted (and named) while off; refused by name when on, because it would change training in a way
#     we do not implement. `off` is DeepSpeed's default: a scalar is on when it differs; a block is on when any
#     "enabled" inside it is true, or, where `off` is a dict, when one of those switch keys differs.
# Nested keys are dotted ("zero_optimization.memory_efficient_linear"). tests/zero/test_zero_config.py walks
# DeepSpeed's own schema and checks that no key of it is "unknown" here.
NO_EFFECT, REFUSED = "no effect", "refused when enabled"
DEEPSPEED_KEYS = {
    # top level
    "zero_allow_untested_optimizer": (NO_EFFECT, "any torch Adam/AdamW client optimizer is stepped as it is"),
    "zero_force_ds_cpu_optimizer": (NO_EFFECT, "offload steps any client Adam on the host, DeepSpeedCPUAdam "
                                               "included"),
    "communication_data_type": (NO_EFFECT, "gradients are reduced in the parameters' dtype (fp32 masters are "
                                           "never sent)"),
    "seq_parallel_communication_data_type": (NO_EFFECT, "there is no sequence parallelism"),
    "prescale_gradients": (NO_EFFECT, "gradients are averaged once, after the reduction"),
    "gradient_predivide_factor": (NO_EFFECT, "gradients are averaged once, after the reduction"),
    "memory_breakdown": (NO_EFFECT, "memory is reported by --log-jsonl and the start-up estimate"),
    "dump_state": (NO_EFFECT, "the config is printed by tools/estimate_memory.py"),
    "graph_harvesting": (NO_EFFECT, "CUDA graphs are not captured"),
    "disable_allgather": (NO_EFFECT, "stages 1-2 always gather the updated slices"),
    "disable_python_gc": (NO_EFFECT, "Python's garbage collector is left as it is"),
    "log_level": (NO_EFFECT, "megatron.zero prints on rank 0 only"),
    "managed_gradient_accumulation": (NO_EFFECT, "the engine always counts micro-steps to the boundary"),
    "vocabulary_size": (NO_EFFECT, "read by DeepSpeed's pipeline engine only"),
    "use_data_before_expert_parallelism": (NO_EFFECT, "the expert groups come from --expert-model-parallel-size "
                                                      "(mpu/expert_parallel.py)"),
    "flops_profiler": (NO_EFFECT, "the log line prints TFLOP/s"),
    "tensorboard": (NO_EFFECT, "use --tensorboard-dir"),
    "csv_monitor": (NO_EFFECT, "use --log-jsonl"), "wandb": (NO_EFFECT, "use --log-jsonl"),
    "comet": (NO_EFFECT, "use --log-jsonl"),
    "comms_logger": (NO_EFFECT, "bench_zero prints the communication table"),
    "aio": (NO_EFFECT, "there is no NVMe offload"),
    "checkpoint": (NO_EFFECT, "checkpoints are written as docs/ describe"),
    "autotuning": (NO_EFFECT, "there is no autotuner"),
    "optimizer.legacy_fusion": (NO_EFFECT, "the optimizer is torch's"),
    "gradient_allreduce_op": (REFUSED, "gradients are averaged (\"mean\"), never summed", "mean"),
    "amp": (REFUSED, "use bf16 or fp16", None), "elasticity": (REFUSED, "launch with a fixed world size", None),
    "compression_training": (REFUSED, "not supported", None), "sparse_attention": (REFUSED, "not supported", {}),
    "curriculum_learning": (REFUSED, "not supported", None), "data_efficiency": (REFUSED, "not supported", None),
    "progressive_layer_drop": (REFUSED, "not supported", None), "eigenvalue": (REFUSED, "not supported", None),
    "quantize_training": (REFUSED, "not supported", None),
    "pipeline": (REFUSED, "use --pipeline-model-parallel-size", None),
    "sparse_gradients": (REFUSED, "not supported", False),
    "nebula": (REFUSED, "checkpoints are written with torch.save", None),
    "datastates_ckpt": (REFUSED, "checkpoints are written with torch.save", None),
    "torch_autocast": (REFUSED, "use bf16 or fp16", None),
    "compile": (REFUSED, "DeepCompile is not implemented; torch.compile the model yourself", {"deepcompile": False}),
    "weight_quantization": (REFUSED, "weights are never quantized here",
                            {"quantized_initialization": {}, "post_init_quant": {}}),
    "data_types": (REFUSED, "gradients accumulate in the parameters' dtype; fp32 masters are kept by bf16/fp16",
                   {"grad_accum_dtype": None, "param_dtype": None, "buffer_dtype": None,
                    "keep_in_fp32_modules": "auto"}),
    "tensor_parallel": (REFUSED, "use --tensor-model-parallel-size", {"autotp_size": 0}),
    "expert_parallel": (REFUSED, "use --num-experts and --expert-model-parallel-size (docs/models.md)",
                        {"enabled": False}),
    # hybrid_engine ("enabled" is honoured: HybridEngineConfig); DeepSpeed's inference-kernel settings
    "hybrid_engine.max_out_tokens": (NO_EFFECT, "the KV cache is sized per call, for its prompts and new tokens"),
    "hybrid_engine.inference_tp_size": (NO_EFFECT, "generation runs at the training's tensor-parallel layout; the "
                                                   "tokens are the same"),
    "hybrid_engine.release_inference_cache": (NO_EFFECT, "the KV cache is built per call and dropped after it"),
    "hybrid_engine.pin_parameters": (NO_EFFECT, "ZeRO-3 gathers every parameter once per call and releases them "
                                                "after it"),
    "hybrid_engine.tp_gather_partition_size": (NO_EFFECT, "generation is never re-sharded (inference_tp_size)"),
    "hybrid_engine.enable_cuda_graph": (NO_EFFECT, "CUDA graphs are not captured"),
    # fp16 / bf16
    "fp16.auto_cast": (REFUSED, "the model runs in the dtype it is given", False),
    "fp16.consecutive_hysteresis": (REFUSED, "the hysteresis budget is refilled only when the scale grows", False),
    "fp16.fp16_master_weights_and_grads": (REFUSED, "masters are fp32", False),
    "bf16.immediate_grad_update": (NO_EFFECT, "gradients are accumulated into the fp32 masters at the boundary"),
    "bf16.check_grad_overflow": (NO_EFFECT, "bf16 steps are never skipped"),
    "bf16.bf16_master_weights_and_grads": (REFUSED, "masters are fp32", False),
    "bf16.bf16_optimizer_states": (REFUSED, "optimizer states are fp32", False),
    # zero_optimization (the fields of ZeroConfig are honoured; these are accepted as shown)
    "zero_optimization.allgather_partitions": (NO_EFFECT, "updated slices are always all-gathered"),
    "zero_optimization.load_from_fp32_weights": (NO_EFFECT, "the fp32 slices are always restored"),
    "zero_optimization.elastic_checkpoint": (NO_EFFECT, "checkpoints always re-partition"),
    "zero_optimization.ignore_unused_parameters": (NO_EFFECT, "unused parameters get zero gradients"),
    "zero_optimization.round_robin_gradients": (NO_EFFECT, "gradient partitions are contiguous ranges"),
    "zero_optimization.memory_efficient_linear": (NO_EFFECT, "linears are torch's; their backward keeps no extra "
                                                             "copy to save"),
    "zero_optimization.use_multi_rank_bucket_allreduce": (NO_EFFECT, "each bucket is reduced to its owners"),
    "zero_optimization.legacy_stage1": (NO_EFFECT, "there is one stage-1 implementation"),
    "zero_optimization.parameter_alignment": (NO_EFFECT, "partitions are padded as partition.py draws"),
    "zero_optimization.stage3_model_persistence_threshold": (NO_EFFECT, "stage3_param_persistence_threshold "
                                                                        "alone decides what stays whole"),
    "zero_optimization.stage3_module_granularity_threshold": (NO_EFFECT, "parameters are fetched per module"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (NO_EFFECT, "parameters are fetched by "
                                                                            "all-gather"),
    "zero_optimization.stage3_allgather_sequential": (NO_EFFECT, "parameters are fetched by all-gather"),
    "zero_optimization.zero_hpz_partition_size": (NO_EFFECT, "there is one partition group (no ZeRO++ hpZ "
                                                             "secondary copy); the numbers are the same"),
    "zero_optimization.pipeline_loading_checkpoint": (NO_EFFECT, "checkpoints load into the partitions"),
    "zero_optimization.override_module_apply": (NO_EFFECT, "module.apply is never patched"),
    "zero_optimization.log_trace_cache_warnings": (NO_EFFECT, "there is no trace cache"),
    "zero_optimization.enable_sanity_checks": (NO_EFFECT, "the engine's checks always run"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (NO_EFFECT, "Muon's momentum is partitioned like "
                                                               "Adam's moments, always in memory"),
    "zero_optimization.leaf_module": (NO_EFFECT, "parameters are fetched per module"),
    "zero_optimization.cpu_offload_use_pin_memory": (NO_EFFECT, "pin_memory is set in offload_optimizer / "
                                                                "offload_param"),
    "zero_optimization.compute_grad_norm": (REFUSED, "the gradient norm is always computed", True),
    "zero_optimization.zero_quantized_weights": (REFUSED, "weights are gathered unquantized", False),
    "zero_optimization.zero_quantized_nontrainable_weights": (REFUSED, "weights are never quantized", False),
    "zero_optimization.zero_quantized_gradients": (REFUSED, "gradients are reduced unquantized", False),
    "zero_optimization.zenflow": (REFUSED, "ZenFlow is not implemented", None),
    "zero_optimization.mics_shard_size": (REFUSED, "MiCS was removed in DeepSpeed 0.19.8 too", -1),
    "zero_optimization.mics_hierarchical_params_gather": (REFUSED, "MiCS was removed in DeepSpeed 0.19.8 too",
                                                          False),
    "zero_optimization.offload_optimizer.super_offload": (REFUSED, "SuperOffload is not implemented", False),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (NO_EFFECT, "torch chooses its own threads"),
    "zero_optimization.offload_optimizer.ratio": (NO_EFFECT, "the whole partition is offloaded; the numbers are "
                                                             "the same"),
    "zero_optimization.offload_optimizer.fast_init": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.pipeline_read": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.pipeline_write": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.buffer_count": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_optimizer.nvme_path": (NO_EFFECT, "there is no NVMe offload (device \"nvme\" is "
                                                                 "refused)"),
    "zero_optimization.offload_param.buffer_count": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.buffer_size": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.max_in_cpu": (NO_EFFECT, "there is no NVMe offload"),
    "zero_optimization.offload_param.nvme_path": (NO_EFFECT, "there is no NVMe offload (device \"nvme\" is "
                                                             "refused)"),
}
# Types checked for top-level no-effect scalars (a wrong type is still an error).
_NO_EFFECT_TYPES = {"zero_allow_untested_optimizer": bool, "prescale_gradients": bool,
                    "gradient_predivide_factor": float, "memory_breakdown": bool, "dump_state": bool,
                    "zero_force_ds_cpu_optimizer": bool, "communication_data_type": str,
                    "seq_parallel_communication_data_type": str, "graph_harvesting": bool,
                    "disable_allgather": bool}
# DeepSpeed's pydantic field names for keys spelt with "stage3_" (it accepts both): the same keys here.
ZERO_ALIASES = {name: "stage3_" + name for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}
_OPTIMIZER_PARAMS = {"lr": float, "betas": list, "eps": float, "weight_decay": float, "adam_w_mode": bool,
                     "torch_adam": bool, "bias_correction": bool, "amsgrad": bool, "max_grad_norm": float}
# DeepSpeed 0.19.8's Muon keys: muon_lr / adam_lr override lr for each half; momentum and ns_method are Muon's
_MUON_PARAMS = {"muon_lr": float, "adam_lr": float, "momentum": float, "ns_method": str, "per_head_muon": bool}
_SCHEDULER_PARAMS = {"WarmupLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                  "warmup_type": str, "last_batch_iteration": int},
                     "WarmupDecayLR": {"warmup_min_lr": float, "warmup_max_lr": float, "warmup_num_steps": int,
                                       "warmup_type": str, "last_batch_iteration": int, "total_num_steps": int}}


def _deepspeed_keys(prefix):
    """{name: entry} of DEEPSPEED_KEYS directly under the dotted `prefix` ("" for the top level)."""
    head = prefix + "." if prefix else ""
    return {key[len(head):]: entry for key, entry in DEEPSPEED_KEYS.items()
            if key.startswith(head) and "." not in key[len(head):]}


def _is_on(value, off):
    """Whether a REFUSED key's value switches its feature on (`off` as in DEEPSPEED_KEYS)."""
    if isinstance(value, dict) and off == {}:      # on by being there, unless "enabled": false
        return value.get("enabled", True) is not False
    if isinstance(value, dict) and isinstance(off, dict):      # switch keys, missing ones at DeepSpeed's default
        return any(value.get(switch, default) != default for switch, default in off.items())
    if isinstance(value, dict):        # a block: on when any "enabled" inside it is true
        return value.get("enabled") is True or any(_is_on(v, None) for v in value.values() if isinstance(v, dict))
    return bool(value) if off is None else value != off
