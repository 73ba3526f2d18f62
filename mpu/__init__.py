"""Tensor model parallelism. Imports only torch."""
from .initialize import (destroy_model_parallel, get_data_parallel_group, get_data_parallel_rank,
                         get_data_parallel_world_size, get_model_parallel_group, get_model_parallel_rank,
                         get_model_parallel_src_rank, get_model_parallel_world_size, initialize_model_parallel,
                         model_parallel_is_initialized)
from .utils import divide, get_backend, get_device, split_tensor_along_last_dim, VocabUtility
