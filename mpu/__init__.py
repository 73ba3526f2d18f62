"""Tensor model parallelism (Megatron-style). Imports only torch: the model builder hands the transformer its
checkpoint function and RNG tracker (see transformer.py)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .grads import clip_grad_norm, duplicate_ranges
from .initialize import (destroy_model_parallel, get_data_parallel_group, get_data_parallel_rank,
                         get_data_parallel_world_size, get_model_parallel_group, get_model_parallel_rank,
                         get_model_parallel_src_rank, get_model_parallel_world_size, initialize_model_parallel,
                         model_parallel_is_initialized)
from .initialize import (get_context_parallel_global_ranks, get_context_parallel_group, get_context_parallel_rank,
                         get_context_parallel_world_size, get_sequence_data_parallel_group,
                         get_sequence_data_parallel_rank, get_sequence_data_parallel_world_size)
from .context_parallel import (context_parallel_positions, ring_attention, sequence_length_problem,
                               slice_for_context_parallel, SequenceLengthError)
from .initialize import (get_embedding_group, get_pipeline_model_parallel_group, get_pipeline_model_parallel_rank,
                         get_pipeline_model_parallel_ranks, get_pipeline_model_parallel_world_size,
                         get_virtual_pipeline_model_parallel_rank, get_virtual_pipeline_model_parallel_world_size,
                         is_pipeline_first_stage, is_pipeline_last_stage, is_rank_in_embedding_group,
                         set_virtual_pipeline_model_parallel_rank)
from .layers import (ColumnParallelLinear, GroupedQKVStride, replicated_mask_dropout, RowParallelLinear,
                     VocabParallelEmbedding)
from .initialize import (get_expert_data_parallel_group, get_expert_data_parallel_rank,
                         get_expert_data_parallel_world_size, get_expert_model_parallel_group,
                         get_expert_model_parallel_rank, get_expert_model_parallel_world_size,
                         initialize_expert_parallel)
from .expert_parallel import is_expert_parameter
from .lora import TARGETS as LORA_TARGETS
from .lora import (LoRAConfig, adapters_disabled, add_lora, fresh_adapters, has_adapters, is_lora_parameter,
                   mark_only_lora_as_trainable)
from .mappings import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                       gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region,
                       scatter_to_sequence_parallel_region)
from .moe import MoEConfig, MoEMLP, moe_statistics, set_aux_loss_scale
from .random import checkpoint, get_cuda_rng_tracker, model_parallel_cuda_manual_seed, RngStatesTracker
from .recompute import RecomputeConfig
from .rotary import apply_rotary, rotary_tables
from .transformer import (GPT2_ARCHITECTURE, Architecture, ParallelMLP, ParallelSelfAttention, ParallelTransformer,
                          ParallelTransformerLayer, init_method_normal, pipeline_layer_ranges, scaled_init_method_normal)
from .utils import (current_device, device_is_set, divide, full_numel, full_shape, get_backend, get_device,
                    init_distributed, set_device, split_tensor_along_last_dim, VocabUtility)
