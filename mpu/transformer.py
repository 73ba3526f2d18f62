"""The model-parallel GPT-2 transformer: self-attention, MLP, layer and stack (pre-LayerNorm, as GPT-2).

Activations are [b, s, h] (batch, sequence, hidden). With p model-parallel ranks each rank holds heads/p
attention heads and 4h/p MLP columns: column-parallel in, row-parallel out, one all-reduce per block.

Sequence parallelism (`ParallelTransformer(..., sequence_parallel=True)`, Megatron-LM's --sequence-parallel): the
stack's input and output and everything between the blocks (LayerNorms, hidden dropout, residual adds) are this
rank's slice of the sequence, [b, s/p, h]; each block all-gathers the sequence before its column-parallel linear
and reduce-scatters after its row-parallel one (the all-reduce's two halves), and the LayerNorms' and row-parallel
biases' gradients are summed over the group, a layer's six in one all-reduce
(mpu.layers.replicated_gradients_together). The hidden dropouts keep each rank's slice of the whole sequence's mask
(mpu.layers.replicated_mask_dropout), so the run equals the one without; incremental decoding runs without it.

Activation checkpointing and dropout RNG come from the builder: `ParallelTransformer(...,
checkpoint_function=..., rng_tracker=...)` (default: mpu's own `checkpoint` and `get_cuda_rng_tracker()`).
The model builder passes zero.checkpointing's pair when it is configured, so mpu imports nothing but torch.
What is recomputed (nothing, the attention core of every layer, or whole layers in groups) is a RecomputeConfig
(mpu/recompute.py): `ParallelTransformer(..., recompute=...)`.

The layer's parts live beside it (each name is re-exported here): mpu/architecture.py (the options, norms, init
methods, the hidden dropout), mpu/attention.py (ParallelSelfAttention), mpu/mlp.py (ParallelMLP; an MoE layer's
MoEMLP is mpu/moe.py's), mpu/decoding.py (the incremental-decoding cache and CPU weight layouts).
"""
import torch
from torch import nn

from . import fused as compiled_ops
from .architecture import (GPT2_ARCHITECTURE, Architecture, hidden_dropout, init_method_normal,  # noqa: F401
                           norm_layer, scaled_init_method_normal)
from .attention import ParallelSelfAttention
from .decoding import (InferenceCache, LayerPast, ONEDNN_HEAD_MIN_ROWS, decoding_head_matmul,  # noqa: F401
                       decoding_weight_t)
from .layers import replicated_gradients_together
from .mappings import copy_to_model_parallel_region, reduce_from_model_parallel_region
from .mlp import ParallelMLP
from .moe import MoEMLP, moe_init_shapes
from .random import checkpoint as mpu_checkpoint
from .random import get_cuda_rng_tracker, skip_init_draws
from .recompute import RecomputeConfig
from .utils import get_device


class ParallelTransformerLayer(nn.Module):
    """fused: run training and evaluation forwards through mpu/fused.py's compiled pieces (the same math;
    incremental decoding stays eager). sequence_parallel: the input and output are this rank's sequence slice
    (except while decoding, which runs without sequence parallelism)."""

    def __init__(self, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
                 layernorm_epsilon, init_method, output_layer_init_method, rng_tracker=None, fused=False,
                 architecture=GPT2_ARCHITECTURE, sequence_parallel=False):
        super().__init__()
        if fused and architecture.moe is not None:
            raise ValueError("--torch-compile (fused_compute) runs dense layers only: drop it, or --num-experts")
        self.fused = fused
        self.sequence_parallel = sequence_parallel
        device = get_device()
        self.input_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device)
        self.attention = ParallelSelfAttention(hidden_size, num_attention_heads, attention_dropout_prob,
                                               output_dropout_prob, init_method, output_layer_init_method,
                                               rng_tracker, architecture)
        self.post_attention_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device)
        if architecture.moe is not None:
            self.mlp = MoEMLP(hidden_size, architecture.ffn_size(hidden_size), architecture.moe, init_method,
                              output_layer_init_method, architecture.swiglu, architecture.add_bias_linear,
                              output_dropout_prob)
        else:
            self.mlp = ParallelMLP(hidden_size, output_dropout_prob, init_method, output_layer_init_method,
                                   architecture)

    def forward(self, hidden_states, attention_mask=None, layer_past=None, rotary=None, sequence_parallel=None):
        """rotary: the (cos, sin) tables of the whole sequence's positions, or None. sequence_parallel: whether
        hidden_states (and the result) are this rank's sequence slice [b, s/p, h]; None: the layer's own setting,
        except while decoding."""
        if self.fused and layer_past is None:
            return self._fused_forward(hidden_states, attention_mask, rotary)
        sp = self.sequence_parallel and layer_past is None if sequence_parallel is None else sequence_parallel
        with replicated_gradients_together(self.replicated_parameters() if sp else ()):
            hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states, sequence_parallel=sp),
                                                           attention_mask, layer_past, rotary, sequence_parallel=sp)
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states, sequence_parallel=sp),
                                            layer_past, sequence_parallel=sp)

    def replicated_parameters(self):
        """What sequence parallelism sums over the group: both norms' parameters and the row-parallel biases (LoRA's
        B, used only while the adapter is on, keeps its own all-reduce)."""
        return [param for param in (*self.input_layernorm.parameters(), *self.post_attention_layernorm.parameters(),
                                    self.attention.dense.bias, self.mlp.dense_4h_to_h.bias) if param is not None]

    def _fused_forward(self, hidden_states, attention_mask, rotary=None):
        """The eager forward's math, compiled between the collectives (see mpu/fused.py)."""
        attention, mlp, norm = self.attention, self.mlp, self.post_attention_layernorm
        ln1 = copy_to_model_parallel_region(self.input_layernorm(hidden_states))
        dropout_p = attention.attention_dropout_prob if self.training else 0.0
        cos, sin = rotary if rotary is not None else (None, None)
        with attention.rng_tracker.fork():
            partial = compiled_ops.attention(ln1, attention.query_key_value.weight, attention.query_key_value.bias,
                                             attention.dense.weight, attention_mask, attention.heads_per_partition,
                                             attention.kv_heads_per_partition, dropout_p, cos, sin)
        hidden_states, ln2 = compiled_ops.bias_dropout_add_norm(
            reduce_from_model_parallel_region(partial), attention.dense.bias, hidden_states,
            attention.output_dropout.p, self.training, norm.weight, getattr(norm, "bias", None), norm.eps,
            isinstance(norm, nn.RMSNorm))
        partial = compiled_ops.mlp(copy_to_model_parallel_region(ln2), mlp.dense_h_to_4h.weight,
                                   mlp.dense_h_to_4h.bias, mlp.dense_4h_to_h.weight, mlp.swiglu)
        return compiled_ops.bias_dropout_add(reduce_from_model_parallel_region(partial), mlp.dense_4h_to_h.bias,
                                             hidden_states, mlp.dropout.p, self.training)


def layer_init_shapes(hidden_size, num_attention_heads=1, architecture=GPT2_ARCHITECTURE):
    """The full-size master shapes one ParallelTransformerLayer draws from the default generator, in build order
    (its norms and biases draw nothing): q/k/v, attention output, MLP in, MLP out (an MoE layer: the router, then
    every expert's MLP in and out)."""
    ffn = architecture.ffn_size(hidden_size)
    attention = [(sum(architecture.qkv_rows(hidden_size, num_attention_heads)), hidden_size), (hidden_size, hidden_size)]
    if architecture.moe is not None:
        return attention + moe_init_shapes(hidden_size, ffn, architecture.swiglu, architecture.moe)
    return attention + [((2 if architecture.swiglu else 1) * ffn, hidden_size), (hidden_size, ffn)]


def pipeline_layer_ranges(num_layers, num_stages, stage, num_chunks=1):
    """[(start, end)] global layer numbers of each model chunk of pipeline stage `stage` (Megatron-LM's
    get_num_layers and offset): chunk c of stage r holds the (c P + r)-th slice of L / (P v) layers, so the model
    runs stage 0, 1, ..., P - 1 on chunk 0, then again on chunk 1, ... Example, L = 8, P = 2, v = 2:

        stage 0: chunk 0 layers 0-1, chunk 1 layers 4-5
        stage 1: chunk 0 layers 2-3, chunk 1 layers 6-7          (v = 1: stage 0 layers 0-3, stage 1 layers 4-7)
    """
    if num_layers % (num_stages * num_chunks):
        raise ValueError(f"num_layers ({num_layers}) is not divisible by the pipeline size ({num_stages}) x model "
                         f"chunks per stage ({num_chunks})")
    per_chunk = num_layers // (num_stages * num_chunks)
    return [((chunk * num_stages + stage) * per_chunk, (chunk * num_stages + stage + 1) * per_chunk)
            for chunk in range(num_chunks)]


class _StageLayers(nn.ModuleList):
    """A pipeline stage's layers, registered under their global numbers (`layers.6...` on the stage holding
    layers 6-11; `layers.{2,3,6,7}` on stage 1 of an interleaved pipeline), so that state-dict and parameter names
    are those of the whole model. Indexed locally."""

    def __init__(self, layers, numbers):
        super().__init__()
        for number, layer in zip(numbers, layers, strict=True):
            self.add_module(str(number), layer)

    def __getitem__(self, index):
        return list(self._modules.values())[index]


class ParallelTransformer(nn.Module):
    """L layers and a final LayerNorm. `recompute` (a RecomputeConfig, mpu/recompute.py) says what backward
    recomputes instead of keeping: nothing, each layer's attention core (selective), or whole layers in checkpointed
    groups (full: uniform groups of num_layers, or the first num_layers layers of the stage, block); a checkpointed
    group keeps only its input. `checkpoint_activations` / `checkpoint_num_layers` are the older spelling of full
    uniform recomputation (pass one or the other); `model.checkpoint_activations = on` still switches it.

    A pipeline stage passes `layer_ranges=[(start, end), ...]` (global layer numbers of each of its model chunks,
    pipeline_layer_ranges; None = all L in one chunk) and `final_layernorm=False` unless it is the last stage.
    Only the stage's layers are built; the other layers' draws are made into a scratch buffer and dropped
    (skip_init_draws), so the default generator runs exactly as for the whole model: each stage's weights equal
    the single-stage model's bitwise, and the generator ends where the whole model leaves it (LoRA's masters and
    dropout come after). Memory: the stage's layers and one layer-sized scratch; time: the whole model's draws.
    forward(..., chunk=c) runs model chunk c (the interleaved schedule's); the final LayerNorm follows the last
    chunk only. Recomputation groups are each chunk's own (block: the first num_layers layers of each chunk, as
    Megatron-LM).

    `fused=True`: every layer's forward runs mpu/fused.py's compiled pieces (--torch-compile); selective
    recomputation needs the eager attention (refused with fused).

    `checkpoint_function(fn, *args)` and `rng_tracker` (the model-parallel dropout stream) default to mpu's; pass
    another pair (zero.checkpointing's) together, so that recomputation replays the tracker it checkpoints. Full
    recomputation uses checkpoint_function; selective always mpu's plain checkpoint (its inputs, q/k/v, hold this
    rank's heads: nothing to partition), replaying the same one tracker."""

    def __init__(self, num_layers, hidden_size, num_attention_heads, attention_dropout_prob, output_dropout_prob,
                 checkpoint_activations=False, checkpoint_num_layers=1, layernorm_epsilon=1e-5,
                 init_method_std=0.02, checkpoint_function=None, rng_tracker=None, layer_ranges=None,
                 final_layernorm=True, fused=False, recompute=None, architecture=GPT2_ARCHITECTURE,
                 sequence_parallel=False):
        super().__init__()
        if recompute is not None and checkpoint_activations:
            raise ValueError("pass recompute=RecomputeConfig(...) or checkpoint_activations=True, not both")
        if sequence_parallel and fused:
            raise ValueError("sequence parallelism runs the eager layers: drop --torch-compile or --sequence-parallel")
        self.sequence_parallel = sequence_parallel
        self.checkpoint_num_layers = checkpoint_num_layers
        self.checkpoint_function = checkpoint_function if checkpoint_function is not None else mpu_checkpoint
        rng_tracker = rng_tracker if rng_tracker is not None else get_cuda_rng_tracker()
        init_method = init_method_normal(init_method_std)
        output_layer_init_method = scaled_init_method_normal(init_method_std, num_layers)
        layer_ranges = list(layer_ranges) if layer_ranges is not None else [(0, num_layers)]
        self.num_layers = num_layers
        self.numbers = [number for start, end in layer_ranges for number in range(start, end)]
        local = [0]
        for start, end in layer_ranges:
            local.append(local[-1] + end - start)
        self.chunk_bounds = list(zip(local[:-1], local[1:]))   # [(first, end)] local indices of each model chunk
        device = get_device()

        def shapes(first, end):   # what layers first..end-1 draw
            return [shape for number in range(first, end)
                    for shape in layer_init_shapes(hidden_size, num_attention_heads, architecture.for_layer(number))]
        kept, drawn = [], 0
        for start, end in layer_ranges:
            skip_init_draws(shapes(drawn, start), device)  # the layers before this chunk
            kept += [ParallelTransformerLayer(hidden_size, num_attention_heads, attention_dropout_prob,
                                              output_dropout_prob, layernorm_epsilon, init_method,
                                              output_layer_init_method, rng_tracker, fused,
                                              architecture.for_layer(number), sequence_parallel)
                     for number in range(start, end)]
            drawn = end
        skip_init_draws(shapes(drawn, num_layers), device)  # the layers after
        self.layers = nn.ModuleList(kept) if self.numbers == list(range(num_layers)) else \
            _StageLayers(kept, self.numbers)
        self.final_layernorm = norm_layer(architecture, hidden_size, layernorm_epsilon, device) \
            if final_layernorm else None
        self.recompute = recompute if recompute is not None else \
            RecomputeConfig.from_checkpoint_activations(checkpoint_activations, checkpoint_num_layers)

    @property
    def recompute(self):
        """The RecomputeConfig in force (set it to change what the next forwards recompute)."""
        return self._recompute

    @recompute.setter
    def recompute(self, config):
        if config.selective and any(layer.fused for layer in self.layers):
            raise ValueError("selective recomputation checkpoints the eager attention core: it cannot run with the "
                             "fused (compiled) layers (--torch-compile)")
        self._recompute = config
        for layer in self.layers:
            layer.attention.checkpoint_core_attention = config.selective

    @property
    def checkpoint_activations(self):
        """The older switch: whether whole layers are recomputed (full granularity)."""
        return self._recompute.full

    @checkpoint_activations.setter
    def checkpoint_activations(self, on):
        self.recompute = RecomputeConfig.from_checkpoint_activations(on, self.checkpoint_num_layers)

    def numbered_layers(self):
        """[(global layer number, layer)] of this stage's layers."""
        return list(zip(self.numbers, self.layers))

    def set_activation_checkpointing(self, checkpoint_function, rng_tracker):
        """Use another checkpoint function and dropout RNG tracker (a pair: recomputation must replay the
        tracker the checkpoint function captures)."""
        self.checkpoint_function = checkpoint_function
        for layer in self.layers:
            layer.attention.rng_tracker = rng_tracker       # the one user of the per-rank stream

    def _chunk(self, start, end, rotary=None, sequence_parallel=False):
        def run(hidden_states, *mask):
            attention_mask = mask[0] if mask else None
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary=rotary,
                                      sequence_parallel=sequence_parallel)
            return hidden_states
        return run

    def new_inference_cache(self, capacity):
        """An empty InferenceCache for this stack (one slot per layer) of `capacity` positions."""
        return InferenceCache(len(self.layers), capacity)

    def forward(self, hidden_states, attention_mask=None, inference_cache=None, rotary=None,
                sequence_parallel=None, chunk=0):
        """inference_cache: an InferenceCache (see new_inference_cache) to decode incrementally; never
        checkpointed. rotary: the (cos, sin) tables of the whole sequence's positions (mpu.rotary.rotary_tables),
        or None (attention runs on whole sequences, also with sequence parallelism). hidden_states and the result:
        [b, s, h], or this rank's sequence slice [b, s/p, h] with sequence_parallel (not while decoding).
        sequence_parallel: whether this call runs sequence-parallel (None: the stack's setting, except while
        decoding; False: whole sequences, e.g. a length the model-parallel size does not divide). chunk: the model
        chunk to run (interleaved pipeline; 0 otherwise)."""
        if sequence_parallel is None:
            sequence_parallel = self.sequence_parallel and inference_cache is None
        first, end = self.chunk_bounds[chunk]
        if inference_cache is not None:
            for layer, layer_past in zip(self.layers, inference_cache.layers, strict=True):
                hidden_states = layer(hidden_states, attention_mask, layer_past, rotary,
                                      sequence_parallel=sequence_parallel)
        elif self._recompute.full and self.training:
            mask_args = () if attention_mask is None else (attention_mask,)
            for start, stop, checkpointed in self._recompute.layer_chunks(end - first):
                run = self._chunk(first + start, first + stop, rotary, sequence_parallel)
                hidden_states = self.checkpoint_function(run, hidden_states, *mask_args) if checkpointed else \
                    run(hidden_states, *mask_args)
        else:
            for layer in self.layers[first:end]:
                hidden_states = layer(hidden_states, attention_mask, rotary=rotary, sequence_parallel=sequence_parallel)
        if self.final_layernorm is None or chunk != len(self.chunk_bounds) - 1:
            return hidden_states
        return self.final_layernorm(hidden_states, sequence_parallel=sequence_parallel)
