"""DeepSpeed 0.19.8's checkpoint keys (the names its model-states and optimizer files use), one place for the
reader (megatron/checkpoint/deepspeed_format.py) and the writer (megatron/checkpoint/deepspeed_writing.py)."""
from megatron.checkpoint import layout as ckpt

DS_VERSION = "0.19.8"       # the DeepSpeed version whose format we read and write
BUFFER_NAMES, PARAM_SHAPES, FROZEN_PARAM_SHAPES = "buffer_names", "param_shapes", "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS, SHARED_PARAMS = "frozen_param_fragments", "shared_params"
DP_WORLD_SIZE, MP_WORLD_SIZE, GLOBAL_SAMPLES = "dp_world_size", "mp_world_size", "global_samples"
DS_VERSION_KEY, DS_CONFIG = "ds_version", "ds_config"
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
SINGLE_PARTITION = "single_partition_of_fp32_groups"      # stages 1-2
BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state", "base_optimizer_state_step"
GROUP_PADDINGS, PARAM_ALIGNMENT_PADDINGS, PARTITION_COUNT = "group_paddings", "param_alignment_paddings", \
    "partition_count"
FP32_FLAT_GROUPS, INNER_OPTIMIZER_STATE = "fp32_flat_groups", "optimizer_state_dict"      # stage 3
# The model-states keys DeepSpeed's load_checkpoint keeps for itself; the others are the client state.
ENGINE_KEYS = {ckpt.MODULE, BUFFER_NAMES, "optimizer", PARAM_SHAPES, FROZEN_PARAM_SHAPES, SHARED_PARAMS,
               FROZEN_PARAM_FRAGMENTS, ckpt.LR_SCHEDULER, "data_sampler", "random_ltd", "sparse_tensor_module_names",
               ckpt.SKIPPED_STEPS, ckpt.GLOBAL_STEPS, GLOBAL_SAMPLES, DP_WORLD_SIZE, MP_WORLD_SIZE,
               "checkpoint_parallel_dimensions", DS_CONFIG, DS_VERSION_KEY, "universal_checkpoint_info"}
