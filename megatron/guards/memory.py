"""Model-state and activation memory per rank, computed from shapes alone (no hardware, no global args).

Model states (the ZeRO paper, Rajbhandari et al. 2020, mixed precision + Adam, K = 12 bytes of fp32 optimizer state
per parameter: master weights 4 + two Adam moments 8), for P parameters on this model-parallel rank and
data-parallel size dp, in the 2-byte case:

    stage 0:  2P params + 2P grads + 12P          stage 1:  2P + 2P + 12P/dp          stage 2:  2P + (2 + 12)P/dp
    stage 3:  (2 + 2 + 12)P/dp, plus the small persistent parameters whole (at dp 1: no more, they view the
              partition, which is the whole model)

What our engine (megatron/zero) really allocates, which `model_state_bytes` reproduces to the byte:
  * one flat buffer per optimizer param group, padded to a multiple of (partitions x 32) elements (partition.py);
    partitions = dp for stages 1-3, 1 for stage 0; every rank holds the whole flat buffer of 16-bit params, in stage 3
    only its partition (and the persistent parameters' buffer);
  * gradients in the params' dtype: the whole padded flat buffer in stages 0-1, this rank's partition in 2-3;
  * fp32 master = this rank's partition, a copy only when the params are not fp32 or it is offloaded (else a view);
  * Adam's exp_avg and exp_avg_sq: fp32, this rank's partition (allocated by the first optimizer step);
  * stage 2-3 reduce buckets (not part of `total`, an upper bound): with contiguous_gradients a pool of buffers of
    min(reduce_bucket_size, largest group) elements, at most one per param group being filled plus MAX_IN_FLIGHT
    in flight with overlap_comm; stages 0-1 reduce in place (0).
offload_optimizer keeps masters, moments (and in stages 2-3 the gradient partitions) in host memory,
offload_param (stage 3) the parameter partitions: they are reported under "host" and leave the device total.

The settings come from the run's parsed DeepSpeed config (`zero.Config`), so the tool and training read them the
same way. The Megatron path (no --deepspeed, `config=None`) is stage 0 without padding plus, in fp16/bf16,
FP16_Optimizer's fp32 master gradients.

Frozen parameters (LoRA's base weights, `frozen_elements`) are in no optimizer group: parameters only (no gradients,
master or moments), whole on every rank in stages 0-2; stage 3 partitions them as one more flat group.
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron.zero import ALIGNMENT, MAX_IN_FLIGHT

KINDS = ("parameters", "gradients", "master", "moments")


def _dtype(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    return names[str(dtype).replace("torch.", "")]


def _padded(numel, partitions, alignment):
    unit = partitions * alignment
    return -(-numel // unit) * unit


class StateGroup(NamedTuple):
    """One optimizer param group as its model state sees it."""
    elements: int
    """Its element count on this model-parallel rank."""
    expert: bool = False
    """MoE expert parameters: ZeRO partitions them over the expert-data-parallel ranks (dp / ep)."""
    muon: bool = False
    """Muon's half (zero.split_param_groups): one fp32 momentum per element instead of Adam's two moments."""


def run_model_state_bytes(groups, dtype, config, data_parallel_size, context_parallel_size=1,
                          expert_model_parallel_size=1, parameter_sizes=(), frozen_elements=0):
    """model_state_bytes of a run's param groups (StateGroup, or plain counts: dense Adam groups), each partitioned
    as the engine does: over the data x context parallel ranks (they hold the same parameters), an expert group
    over dp / ep (experts and context parallelism are exclusive). The start-up estimate (operations) and
    tools/estimate_memory.py both call this."""
    groups = [StateGroup(g) if isinstance(g, int) else g for g in groups]
    partitions = [data_parallel_size // expert_model_parallel_size if g.expert
                  else data_parallel_size * context_parallel_size for g in groups]
    return model_state_bytes([g.elements for g in groups], dtype, config, partitions, parameter_sizes,
                             frozen_elements, optimizer_states=[1 if g.muon else 2 for g in groups])


def model_state_bytes(counts, dtype, config=None, dp=1, parameter_sizes=(), frozen_elements=0,
                      optimizer_states=None):
    """Bytes per rank by kind: {"parameters", "gradients", "master", "moments", "total", "buckets", "host"}.

    `counts`: an int (one param group) or the element counts of each optimizer param group on this model-parallel
    rank (exact to the byte: each group is padded on its own). `dtype`: the parameters' training dtype (torch dtype
    or "fp16"/"bf16"/"fp32"; with fp16 or bf16 enabled in `config`, that one). `config`: the run's `zero.Config`
    (zero.load_config), whose zero_optimization block gives the stage, the offloads, the stage-3 persistence
    threshold and the reduce buckets; None: the Megatron optimizer (no partitioning, alignment 1, FP16_Optimizer's
    fp32 master gradients in fp16/bf16). `dp`: the data-parallel size (the partitions of stages 1-3), or one per
    param group (MoE expert groups under expert parallelism are partitioned over the expert-data-parallel size).
    `parameter_sizes`: every parameter's element count, for stage 3, which keeps those up to
    stage3_param_persistence_threshold whole on every rank (the units gathered during forward and backward are
    working memory, not model state). `frozen_elements`: parameters without optimizer state (requires_grad False),
    counted under "parameters" only. `optimizer_states`: per group, the fp32 optimizer-state tensors per element
    (2: Adam's exp_avg and exp_avg_sq; 1: Muon's momentum); None: 2 each.

    "total" = parameters + gradients + master + moments (+ "master_gradients" on the Megatron path) on the device;
    "buckets" is the stage-2/3 bucket bound; "host" is what offload keeps in host memory: offload_optimizer
    (stages 1-3) the fp32 masters (always a copy there), the moments and, in stages 2-3, the reduced gradient
    partitions; offload_param (stage 3) the parameter partitions.
    """
    counts = [int(counts)] if isinstance(counts, int) else [int(n) for n in counts]
    dtype = _dtype(dtype)
    zero = config.zero_optimization if config is not None else None
    if config is not None and _config_dtype(config) not in (None, dtype):
        raise ValueError(f"dtype {dtype} disagrees with the config, which enables {_config_dtype(config)}")
    stage = zero.stage if zero is not None else 0
    offload = zero is not None and zero.offload_optimizer.enabled
    offload_param = zero is not None and zero.offload_param.enabled
    size = torch.tensor([], dtype=dtype).element_size()
    group_dps = list(dp) if isinstance(dp, (list, tuple)) else [dp] * len(counts)
    # stage 3 at dp 1 (every group) without offload_param: the parameters are views of their partitions (resident,
    # stage3.py), so the small ones are not held a second time
    resident = stage == 3 and zero.stage3_resident_at_dp1 and not offload_param \
        and all(d == 1 for d in group_dps + ([] if isinstance(dp, (list, tuple)) else [dp]))
    persistent = sum(n for n in parameter_sizes if n <= zero.stage3_param_persistence_threshold) \
        if stage == 3 and not resident else 0
    dp = group_dps[0] if group_dps else 1         # the dense groups' (the frozen parameters')
    partitions = dp if stage >= 1 else 1
    group_partitions = [d if stage >= 1 else 1 for d in group_dps]
    padded = [_padded(n, q, ALIGNMENT if zero is not None else 1) for n, q in zip(counts, group_partitions)]
    own = [p // q for p, q in zip(padded, group_partitions)]
    frozen = _padded(frozen_elements, partitions, ALIGNMENT) // partitions if stage == 3 else frozen_elements
    result = {"parameters": (sum(own) + frozen + persistent if stage == 3 else sum(padded) + frozen) * size,
              "gradients": (sum(own) if stage >= 2 else sum(padded)) * size,
              "master": 0 if dtype == torch.float32 and not offload else sum(own) * 4,
              "moments": sum(k * n for k, n in zip(optimizer_states or [2] * len(own), own)) * 4}
    if zero is None and dtype != torch.float32:
        result["master_gradients"] = sum(own) * 4
    host = 0
    if offload:
        host = result["master"] + result["moments"] + (result["gradients"] if stage >= 2 else 0)
        result["master"] = result["moments"] = 0
        result["gradients"] = 0 if stage >= 2 else result["gradients"]
    if offload_param:
        host += (sum(own) + frozen) * size
        result["parameters"] = persistent * size
    result["total"] = sum(result.values())
    result["host"] = host
    result["buckets"] = _bucket_bytes(zero, counts, size) if stage >= 2 and counts else 0
    return result


def _config_dtype(config):
    """The parameters' dtype a config sets (as the engine casts them), None when it leaves them as built."""
    return torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None


def _bucket_bytes(zero, counts, size):
    """Stages 2-3: with contiguous_gradients a pool of min(reduce_bucket_size, largest group) element buffers, one
    per param group being filled plus MAX_IN_FLIGHT in flight with overlap_comm; else reduce_bucket_size each."""
    buffers = len(counts) + (MAX_IN_FLIGHT if zero.overlap_comm else 0)
    elements = min(zero.reduce_bucket_size, max(counts)) if zero.contiguous_gradients else zero.reduce_bucket_size
    return buffers * elements * size


def measured_model_state_bytes(zero_optimizer):
    """The same kinds summed over the engine's real tensors (ZeroOptimizer.partitioned_state_bytes), with
    "buckets" the peak bucket bytes seen (stage 2)."""
    held = zero_optimizer.partitioned_state_bytes()
    result = {kind: held[kind] for kind in KINDS}
    offloaded = zero_optimizer.offloaded_kinds()
    host = sum(result[kind] for kind in offloaded)
    if "parameters" in offloaded:     # the persistent stage-3 parameters stay on the device
        host -= zero_optimizer.resident_parameter_bytes
    for kind in offloaded:
        result[kind] = zero_optimizer.resident_parameter_bytes if kind == "parameters" else 0
    result["total"] = sum(result.values())
    result["host"] = host
    result["buckets"] = getattr(zero_optimizer.reducer, "peak_bucket_bytes", 0)
    return result


def tensors_bytes(tensors):
    """Bytes of distinct storages among `tensors` (views of one flat buffer are counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


# ---- GPT-2 shapes -----------------------------------------------------------------------------------------------
def gpt2_parameter_sizes(num_layers, hidden_size, padded_vocab_size, max_position_embeddings,
                         model_parallel_size=1, num_attention_heads=None, architecture=None):
    """[(elements, decayed)] of every parameter on one model-parallel rank of our GPT2Model (megatron/model,
    mpu/transformer.py): the word embedding [V/p, h] (tied LM head) and position embedding [s, h] replicated; per
    layer two LayerNorms (h weight + h bias each, replicated), QKV column-parallel [3h/p, h] + bias 3h/p, attention
    output row-parallel [h, h/p] + bias h (replicated), MLP h->4h [4h/p, h] + 4h/p, 4h->h [h, 4h/p] + h; the final
    LayerNorm. Megatron's grouping: biases and LayerNorm parameters are not decayed.
    `architecture`: the Llama options (docs/models.md) as {GPT2ModelConfig field: value}, the missing ones GPT-2's:
    grouped-query q/k/v rows (mpu.GroupedQKVStride.rows_per_rank, `num_attention_heads` needed), SwiGLU's [2f/p, h],
    RMSNorm without bias, no biases, no position table, an untied output layer [V/p, h]."""
    import mpu
    options = dict(architecture or {})
    h, p = hidden_size, model_parallel_size
    kv_heads = options.get("num_key_value_heads")
    qkv = 3 * h // p if not kv_heads else \
        mpu.GroupedQKVStride(h, h // num_attention_heads * kv_heads, h // num_attention_heads).rows_per_rank(p)
    f = options.get("ffn_hidden_size") or 4 * h
    mlp_in = (2 if options.get("swiglu") else 1) * f // p
    norm = [(h, False)] if options.get("normalization") == "rmsnorm" else [(h, False), (h, False)]
    bias = options.get("add_bias_linear", True)

    def linear(rows, columns, bias_size):
        return [(rows * columns, True)] + ([(bias_size, False)] if bias else [])
    layer = norm + linear(qkv, h, qkv) + linear(h, h // p, h) + norm + linear(mlp_in, h, mlp_in) + \
        linear(h, f // p, h)
    positions = [(max_position_embeddings * h, True)] if options.get("learned_position_embeddings", True) else []
    output = [(padded_vocab_size // p * h, True)] if options.get("untie_embeddings_and_output_weights") else []
    return [(padded_vocab_size // p * h, True)] + positions + layer * num_layers + norm + output


def gpt2_param_groups(num_layers, hidden_size, padded_vocab_size, max_position_embeddings, model_parallel_size=1,
                      num_attention_heads=None, architecture=None):
    """(weight-decay elements, no-decay elements) per model-parallel rank (gpt2_parameter_sizes summed)."""
    sizes = gpt2_parameter_sizes(num_layers, hidden_size, padded_vocab_size, max_position_embeddings,
                                 model_parallel_size, num_attention_heads, architecture)
    return sum(n for n, decay in sizes if decay), sum(n for n, decay in sizes if not decay)


@dataclass(frozen=True)
class ActivationLayout:
    """How our transformer layer keeps its activations for backward: the knobs of activation_bytes_per_layer."""
    bytes_per_element: int = 2
    """The activations' element size: 2 (fp16, bf16) or 4 (fp32)."""
    mask_bytes: int = 1
    """A dropout mask element: 1 on CUDA (native_dropout keeps a bool mask); on the CPU dropout multiplies by a mask
    of the activations' dtype, so bytes_per_element (for_run decides)."""
    attention_scores: bool = True
    """True: the attention core keeps its s x s tensors (softmax output, dropout mask, dropped-out probabilities),
    as Korthikanti et al. count it and as SDPA's math path does (ours on the CPU with attention dropout). False:
    SDPA's fused kernels (flash / memory-efficient on CUDA; the CPU's flash kernel without attention dropout), which
    keep their output and an fp32 log-sum-exp per query and head instead."""
    hidden_dropout: bool = True
    """The two dropouts before the residual adds keep a mask each (False: --hidden-dropout 0, none)."""
    partition_activations: bool = False
    """Full recomputation: each model-parallel rank keeps 1/t of a checkpointed group's input
    (zero.checkpointing's partition_activations)."""
    sequence_parallel: bool = False
    """--sequence-parallel: the replicated part (LayerNorms, their outputs, the hidden dropout masks) and a
    checkpointed group's input hold 1/t of the sequence per model-parallel rank."""
    ring_attention: bool = False
    """--context-parallel-size > 1: the attention core is mpu/context_parallel.py's ring attention, which keeps
    its output and log-sum-exp in fp32 (4 sbh + 4 asb over the rank's s/C tokens), never the s x s scores."""

    @classmethod
    def for_run(cls, device_type, bytes_per_element, attention_dropout, hidden_dropout, partition_activations=False,
                sequence_parallel=False, context_parallel_size=1):
        """The layout of a run on `device_type` ("cuda" or "cpu") with these dropout probabilities."""
        cuda, ring = device_type == "cuda", context_parallel_size > 1
        return cls(bytes_per_element=bytes_per_element, mask_bytes=1 if cuda else bytes_per_element,
                   attention_scores=not cuda and attention_dropout > 0 and not ring, hidden_dropout=hidden_dropout > 0,
                   partition_activations=partition_activations, sequence_parallel=sequence_parallel,
                   ring_attention=ring)


def activation_bytes_per_layer(seq_length, micro_batch_size, hidden_size, num_attention_heads,
                               model_parallel_size=1, recompute=None, layout=ActivationLayout()):
    """Bytes one transformer layer keeps for backward after its forward (one micro-batch, one model-parallel rank),
    for `recompute` (an mpu.RecomputeConfig; None: no recomputation) on `layout`.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count, in 16 bits with
    1-byte dropout masks, sbh(34 + 5as/h) per layer: sbh*10 replicated across the t tensor-parallel ranks and
    sbh*(24 + 5as/h) split, so sbh(10 + (24 + 5as/h)/t); 34sbh/t-split with selective recomputation; the layer
    input 2sbh with full recomputation. What our layer (mpu/transformer.py) keeps, with e = bytes_per_element and
    m = mask_bytes (s sequence, b micro batch, h hidden, a heads, t model-parallel size):

        replicated      LayerNorm 1 input e, its output (the QKV input) e, attention-output dropout mask m,
                        LayerNorm 2 input e, its output (fc1's input) e, MLP dropout mask m          sbh(4e + 2m)
                        both LayerNorms' mean and rstd, fp32                                        + 16sb
        split by t      q, k, v 3e (the math path's scaled q and k copies and contiguous v; with
                        recomputation or the fused kernels, the qkv output they view), the dense
                        layer's input e, fc1's output (GeLU's input) 4e, GeLU's output (fc2's input)
                        4e                                                                           sbh * 12e / t
        attention core  scores: softmax output e, attention dropout mask m, dropped-out
                        probabilities e                                                              as^2b(2e + m)/t
                        (and at micro batch 1, where the AV product keeps v as a view of the
                        whole qkv output instead of a copy of v                                      + 2e sbh/t)
                        or fused kernels: their output e sbh and the fp32 log-sum-exp 4asb           (e sbh + 4asb)/t

    No recomputation = all of it: with e = 2, m = 1, scores: sbh(10 + (24 + 5as/h)/t) + 16sb, Korthikanti's formula
    plus the LayerNorm statistics; in fp32 on the CPU (e = m = 4): sbh(24 + (48 + 12as/h)/t) + 16sb.
    Selective: the attention core's part is not kept (recomputed from q, k, v): sbh(4e + 2m + 12e/t) + 16sb, 34sbh
    at t = 1 in 16 bits. Full: a layer that starts a checkpointed group keeps its input e sbh (e sbh / t with
    partition_activations), the other layers of the group nothing; activation_bytes_saved sums the groups.
    Context parallelism (C ranks, layout.ring_attention): every term above with s the rank's s/C tokens, and the
    core kept by ring attention (fp32 output and log-sum-exp) 4(sbh + asb)/t: the callers pass s/C.
    Sequence parallelism (layout.sequence_parallel) divides the replicated part by t too, sbh(4e + 2m)/t + 16sb/t:
    Korthikanti's sbh(34 + 5as/h)/t (its column-parallel linears keep their input's sequence slice and all-gather
    it again in backward, mpu.layers._SequenceParallelLinear); and a checkpointed group's input is a slice, e sbh/t.
    """
    replicated, split, core = _layer_parts(seq_length, micro_batch_size, hidden_size, num_attention_heads, layout)
    t = model_parallel_size
    if layout.sequence_parallel:
        replicated /= t
    if recompute is not None and recompute.full:
        return _checkpointed_input_bytes(seq_length, micro_batch_size, hidden_size, t, layout)
    if recompute is not None and recompute.selective:
        return int(replicated + split / t)
    return int(replicated + (split + core) / t)


def _layer_parts(s, b, h, a, layout):
    """(replicated bytes, tensor-parallel bytes outside the attention core, the attention core's bytes) of one
    layer without recomputation, before dividing by t (the table in activation_bytes_per_layer's docstring).
    Sequence parallelism splits the replicated part along the sequence: activation_bytes_per_layer divides it by t.
    """
    e, m = layout.bytes_per_element, layout.mask_bytes
    replicated = s * b * h * (4 * e + (2 * m if layout.hidden_dropout else 0)) + 16 * s * b
    split = s * b * h * 12 * e
    if layout.ring_attention:
        core = 4 * s * b * h + 4 * a * s * b
    elif layout.attention_scores:
        # At micro batch 1 the math path's AV product keeps v as a view of the whole qkv output ([b heads, s, d]
        # is a view of it when b = 1), not a copy of v: 2e sbh more.
        core = a * s * s * b * (2 * e + m) + (2 * e * s * b * h if b == 1 else 0)
    else:
        core = e * s * b * h + 4 * a * s * b
    return replicated, split, core


def _checkpointed_input_bytes(s, b, h, t, layout):
    """A checkpointed group's input [b, s, h], whole or 1/t per model-parallel rank (partition_activations; with
    sequence parallelism the input is already a slice of the sequence: 1/t, and 1/t^2 with both)."""
    return s * b * h * layout.bytes_per_element // (t if layout.partition_activations else 1) \
        // (t if layout.sequence_parallel else 1)


def activation_bytes_saved(num_layers, seq_length, micro_batch_size, hidden_size, num_attention_heads,
                           model_parallel_size=1, recompute=None, layout=ActivationLayout()):
    """Bytes a stage of `num_layers` layers keeps for backward after one micro-batch's forward: every layer's
    activation_bytes_per_layer, except that under full recomputation a checkpointed group keeps its input only
    (recompute.layer_chunks: uniform groups, or block's first num_layers layers) and the others everything."""
    shape = (seq_length, micro_batch_size, hidden_size, num_attention_heads, model_parallel_size)
    whole = activation_bytes_per_layer(*shape, recompute=None, layout=layout)
    if recompute is None or not recompute.full:
        return num_layers * activation_bytes_per_layer(*shape, recompute=recompute, layout=layout)
    chunks = recompute.layer_chunks(num_layers)
    kept_inputs = sum(1 for *_, checkpointed in chunks if checkpointed)
    kept_whole = sum(end - start for start, end, checkpointed in chunks if not checkpointed)
    return kept_inputs * activation_bytes_per_layer(*shape, recompute=recompute, layout=layout) + kept_whole * whole


def activation_bytes(num_layers, seq_length, micro_batch_size, hidden_size, num_attention_heads,
                     model_parallel_size=1, recompute=None, layout=ActivationLayout(), micro_batches_in_flight=1):
    """The activations of a stage of `num_layers` layers at the peak: activation_bytes_saved for each micro-batch
    in flight (1F1B pipeline stage s of P: min(P - s, micro-batches); 1 without pipelining), where the one in
    backward peaks at: without recomputation, what it saved; selective, that plus one attention core recomputed;
    full, the larger of what it saved and its checkpointed inputs plus the largest group recomputed (backward frees
    block's unchecked layers before it reaches the checkpointed ones). The embeddings, the final LayerNorm and
    the loss are not counted."""
    shape = (seq_length, micro_batch_size, hidden_size, num_attention_heads, model_parallel_size)
    saved = activation_bytes_saved(num_layers, *shape, recompute=recompute, layout=layout)
    peak = saved
    if recompute is not None and recompute.full:
        chunks = recompute.layer_chunks(num_layers)
        inputs = sum(1 for *_, checkpointed in chunks if checkpointed) * \
            activation_bytes_per_layer(*shape, recompute=recompute, layout=layout)
        group = max(end - start for start, end, checkpointed in chunks if checkpointed)
        peak = max(saved, inputs + group * activation_bytes_per_layer(*shape, layout=layout))
    elif recompute is not None and recompute.selective:
        peak = saved + int(_layer_parts(*shape[:4], layout)[2] / model_parallel_size)
    return (micro_batches_in_flight - 1) * saved + peak


def format_bytes(result):
    """'parameters=1234 gradients=... total=... (12.3 MiB)': exact bytes by kind, parseable."""
    parts = [f"{key}={value}" for key, value in result.items() if value is not None]
    total = result.get("total")
    return " ".join(parts) + (f" ({total / 2 ** 20:.2f} MiB)" if total is not None else "")


def saved_activation_bytes(model, x):
    """Bytes of the distinct storages autograd keeps for backward during one forward of `model` on `x` (a copy that
    requires grad), parameters excluded: the measured side of the activation formulas (tests, benchmarks)."""
    import torch
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            kept[storage.data_ptr()] = storage        # held: no address is reused while we count
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x.clone().requires_grad_())
    return sum(storage.nbytes() for storage in kept.values())
