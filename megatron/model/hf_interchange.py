"""The one mapping between our GPT2Model parameter names and Hugging Face transformers' GPT2LMHeadModel
(used by tools/convert_to_hf.py and tools/convert_from_hf.py; DESIGN.md section 6).

    hf_state = to_hf_state_dict(weights, model_config)          # ours (full, unsharded) -> HF tensors
    hf_config = to_hf_config_dict(model_config, eod_id)          # -> the keyword arguments of GPT2Config
    weights, model_config = from_hf_state_dict(hf_state, hf_config)   # HF -> ours (hf_config: config.json dict)

`weights` are what megatron.checkpoint.reshard returns: {our name: full tensor}, vocabulary rows = the real vocabulary.
`model_config`: num_layers, hidden_size, num_attention_heads, max_sequence_length, vocab_size (real),
layernorm_epsilon.

The layouts:
    ours                                              HF GPT2LMHeadModel
    word_embeddings.weight [V, h]                     transformer.wte.weight [V, h] (lm_head.weight tied to it)
    position_embeddings.weight [s, h]                 transformer.wpe.weight [s, h]
    transformer.layers.{i}.input_layernorm            transformer.h.{i}.ln_1
    ...attention.query_key_value [3h, h] (q, k, v)    transformer.h.{i}.attn.c_attn [h, 3h] (columns q | k | v)
    ...attention.dense [h, h]                         transformer.h.{i}.attn.c_proj [h, h]
    ...post_attention_layernorm                       transformer.h.{i}.ln_2
    ...mlp.dense_h_to_4h [4h, h]                      transformer.h.{i}.mlp.c_fc [h, 4h]
    ...mlp.dense_4h_to_h [h, 4h]                      transformer.h.{i}.mlp.c_proj [4h, h]
    transformer.final_layernorm                       transformer.ln_f
Our linears are nn.Linear ([out, in]); HF's are Conv1D ([in, out]): weights are transposed, biases are not. The
fused q/k/v is the full master (rows q, then k, then v), so it maps to c_attn's columns directly.

LoRA (mpu/lora.py): a checkpoint's adapters `transformer.layers.{i}.<linear>.lora_A` [r, in] / `.lora_B` [out, r]
(full tensors: q/k/v rows of lora_B in the full q | k | v order) are either merged into the weights,
W + (alpha / r) B A (`merge_lora`, before the Conv1D transpose), or written as a PEFT adapter for the unmerged base
(`to_peft_state_dict`, `peft_adapter_config`): PEFT's lora_A / lora_B are nn.Linear weights on every target, the
Conv1D ones too (fan_in_fan_out), so they keep our layout:
    ...{ours}.lora_A  ->  base_model.model.transformer.h.{i}.{HF module}.lora_A.weight     (the same for lora_B)
with the target modules c_attn, attn.c_proj, c_fc, mlp.c_proj.

This module imports neither transformers nor safetensors (nor peft): the tools do, inside their functions.
"""
import torch

from mpu import LORA_TARGETS as _LORA_LINEARS   # target name -> our linear inside a layer
from megatron.cli import UserError

# Our per-layer module name -> (HF per-layer module name, is a Conv1D whose weight is transposed).
_LAYER_MODULES = (
    ("input_layernorm", "ln_1", False),
    ("attention.query_key_value", "attn.c_attn", True),
    ("attention.dense", "attn.c_proj", True),
    ("post_attention_layernorm", "ln_2", False),
    ("mlp.dense_h_to_4h", "mlp.c_fc", True),
    ("mlp.dense_4h_to_h", "mlp.c_proj", True),
)
# Our LoRA targets (--lora-targets) -> PEFT's target_modules name of the HF Conv1D (matched as a name suffix).
PEFT_TARGET_MODULES = {"qkv": "c_attn", "dense": "attn.c_proj", "fc1": "c_fc", "fc2": "mlp.c_proj"}
PEFT_PREFIX = "base_model.model."
MODEL_CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "max_sequence_length", "vocab_size",
                     "layernorm_epsilon")
# The tanh-approximated GELU under transformers' names (our MLP's activation).
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
HF_PREFIX = "transformer."
REWARD_HEAD = "score.weight"   # GPT2Model's reward head (reward_head) = GPT2ForSequenceClassification's, [1, h]


class InterchangeError(UserError, ValueError):
    """A Hugging Face model or config this codebase cannot represent; the message is one line."""


def name_pairs(num_layers):
    """[(our name, HF name, transposed)] for every parameter, in our module order (lm_head is tied: not listed)."""
    pairs = [("word_embeddings.weight", "transformer.wte.weight", False),
             ("position_embeddings.weight", "transformer.wpe.weight", False)]
    for i in range(num_layers):
        for ours, theirs, conv1d in _LAYER_MODULES:
            for kind in ("weight", "bias"):
                pairs.append((f"transformer.layers.{i}.{ours}.{kind}", f"transformer.h.{i}.{theirs}.{kind}",
                              conv1d and kind == "weight"))
    pairs += [("transformer.final_layernorm.weight", "transformer.ln_f.weight", False),
              ("transformer.final_layernorm.bias", "transformer.ln_f.bias", False)]
    return pairs


def to_hf_state_dict(weights, model_config):
    """Our full weights -> GPT2LMHeadModel's state dict without the tied lm_head.weight (what save_pretrained
    writes). Each tensor is contiguous and owns its memory (safetensors refuses shared storage)."""
    missing = [ours for ours, _, _ in name_pairs(model_config["num_layers"]) if ours not in weights]
    if missing:
        raise InterchangeError(f"the checkpoint lacks {len(missing)} parameter(s), e.g. {missing[0]}")
    state = {}
    for ours, theirs, transposed in name_pairs(model_config["num_layers"]):
        tensor = weights[ours]
        state[theirs] = (tensor.t() if transposed else tensor).contiguous().clone()
    if REWARD_HEAD in weights:   # a reward model: GPT2ForSequenceClassification's score [1, h], the same layout
        state[REWARD_HEAD] = weights[REWARD_HEAD].contiguous().clone()
    rows = state["transformer.wte.weight"].size(0)
    if rows != model_config["vocab_size"]:
        raise InterchangeError(f"word embedding has {rows} rows but the vocabulary is {model_config['vocab_size']}")
    return state


def to_hf_config_dict(model_config, eod_id, reward=False):
    """Keyword arguments of transformers.GPT2Config for our model (the real vocabulary; tied head; tanh GELU).
    reward: GPT2ForSequenceClassification with one label, scoring each row's last token that is not
    pad_token_id = eod (the rule of megatron/posttrain/reward.py)."""
    config = {"n_layer": model_config["num_layers"], "n_embd": model_config["hidden_size"],
              "n_head": model_config["num_attention_heads"], "n_positions": model_config["max_sequence_length"],
              "vocab_size": model_config["vocab_size"], "layer_norm_epsilon": model_config["layernorm_epsilon"],
              "activation_function": "gelu_new", "n_inner": None, "tie_word_embeddings": True,
              "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "bos_token_id": eod_id, "eos_token_id": eod_id, "architectures": ["GPT2LMHeadModel"]}
    if reward:
        config.update(num_labels=1, pad_token_id=eod_id, architectures=["GPT2ForSequenceClassification"])
    return config


def check_hf_config(hf_config):
    """The model_config of a GPT-2 config.json (dict or GPT2Config); InterchangeError (one line) for what our
    GPT2Model cannot express."""
    if not isinstance(hf_config, dict):
        hf_config = hf_config.to_dict()
    model_type = hf_config.get("model_type")
    if model_type != "gpt2":
        raise InterchangeError(f"config.json has model_type {model_type!r}: only GPT-2 ('gpt2', GPT2LMHeadModel) "
                               "checkpoints can be converted")
    activation = hf_config.get("activation_function", "gelu_new")
    if activation not in TANH_GELU_NAMES:
        raise InterchangeError(f"config.json has activation_function {activation!r}: our GPT-2 uses the tanh GELU "
                               f"({' or '.join(TANH_GELU_NAMES)})")
    hidden = hf_config["n_embd"]
    n_inner = hf_config.get("n_inner")
    if n_inner not in (None, 4 * hidden):
        raise InterchangeError(f"config.json has n_inner {n_inner}: our MLP is 4 x n_embd = {4 * hidden} wide")
    for key, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf_config.get(key, ours) != ours:
            raise InterchangeError(f"config.json has {key} {hf_config[key]}: our GPT-2 needs {ours}")
    if hidden % hf_config["n_head"]:
        raise InterchangeError(f"config.json: n_embd {hidden} is not divisible by n_head {hf_config['n_head']}")
    return {"num_layers": hf_config["n_layer"], "hidden_size": hidden, "num_attention_heads": hf_config["n_head"],
            "max_sequence_length": hf_config["n_positions"], "vocab_size": hf_config["vocab_size"],
            "layernorm_epsilon": hf_config.get("layer_norm_epsilon", 1e-5)}


def from_hf_state_dict(hf_state, hf_config):
    """GPT2LMHeadModel (or GPT2Model, without the 'transformer.' prefix) tensors + its config.json ->
    (our full weights, model_config). The tensors keep their dtype; an lm_head.weight that differs from wte is
    refused (our head is tied)."""
    model_config = check_hf_config(hf_config)
    if not any(key.startswith(HF_PREFIX) for key in hf_state):  # a bare GPT2Model
        hf_state = {HF_PREFIX + key: value for key, value in hf_state.items()}
    weights = {}
    for ours, theirs, transposed in name_pairs(model_config["num_layers"]):
        if theirs not in hf_state:
            raise InterchangeError(f"the weights lack {theirs} (config.json has n_layer {model_config['num_layers']})")
        tensor = hf_state[theirs]
        weights[ours] = (tensor.t() if transposed else tensor).contiguous()
    _check_shapes(weights, model_config)
    head = hf_state.get("lm_head.weight")
    if head is not None and not torch.equal(head, hf_state["transformer.wte.weight"]):
        raise InterchangeError("lm_head.weight differs from transformer.wte.weight: our GPT-2 ties the LM head to "
                               "the word embedding (tie_word_embeddings)")
    return weights, model_config


def _check_shapes(weights, model_config):
    h, s, V = model_config["hidden_size"], model_config["max_sequence_length"], model_config["vocab_size"]
    rows = weights["word_embeddings.weight"].shape
    if tuple(rows) != (V, h):
        raise InterchangeError(f"vocabulary mismatch: transformer.wte.weight is {list(rows)} but config.json has "
                               f"vocab_size {V} and n_embd {h}")
    expected = {"position_embeddings.weight": (s, h)}
    for i in range(model_config["num_layers"]):
        prefix = f"transformer.layers.{i}."
        expected.update({prefix + "attention.query_key_value.weight": (3 * h, h),
                         prefix + "attention.query_key_value.bias": (3 * h,),
                         prefix + "attention.dense.weight": (h, h), prefix + "mlp.dense_h_to_4h.weight": (4 * h, h),
                         prefix + "mlp.dense_h_to_4h.bias": (4 * h,), prefix + "mlp.dense_4h_to_h.weight": (h, 4 * h)})
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise InterchangeError(f"{name} has shape {list(weights[name].shape)}, expected {list(shape)} from "
                                   "config.json")


# ---------------------------------------------------------------------------------------------------- LoRA

def _hf_module(ours):
    return next(theirs for name, theirs, _ in _LAYER_MODULES if name == ours)


def lora_layout(weights, num_layers):
    """(rank, targets in --lora-targets order) of the adapters in our full `weights`, or None without any; an
    adapter missing from some layer or of mixed ranks is an InterchangeError."""
    targets = [t for t, linear in _LORA_LINEARS.items() if f"transformer.layers.0.{linear}.lora_A" in weights]
    if not targets:
        return None
    ranks = set()
    for i in range(num_layers):
        for target in targets:
            prefix = f"transformer.layers.{i}.{_LORA_LINEARS[target]}."
            if prefix + "lora_A" not in weights or prefix + "lora_B" not in weights:
                raise InterchangeError(f"the checkpoint's LoRA adapters are incomplete: {prefix}lora_A/lora_B missing")
            ranks.update((weights[prefix + "lora_A"].shape[0], weights[prefix + "lora_B"].shape[1]))
    if len(ranks) != 1:
        raise InterchangeError(f"the checkpoint's LoRA adapters have different ranks {sorted(ranks)}")
    return ranks.pop(), targets


def merge_lora(weights, num_layers, scale):
    """Our full weights with every adapter merged, W + scale B A (scale = alpha / r, computed in fp64), and the
    adapters dropped; weights without adapters come back as they are."""
    merged = {name: tensor for name, tensor in weights.items() if not name.endswith((".lora_A", ".lora_B"))}
    layout = lora_layout(weights, num_layers)
    for i in range(num_layers) if layout is not None else ():
        for target in layout[1]:
            prefix = f"transformer.layers.{i}.{_LORA_LINEARS[target]}."
            weight = merged[prefix + "weight"]
            delta = weights[prefix + "lora_B"].double() @ weights[prefix + "lora_A"].double()    # [out, in]
            merged[prefix + "weight"] = (weight.double() + scale * delta).to(weight.dtype)
    return merged


def to_peft_state_dict(weights, num_layers):
    """The adapters of our full weights under PEFT's names (adapter_model.safetensors), contiguous copies."""
    rank_targets = lora_layout(weights, num_layers)
    if rank_targets is None:
        raise InterchangeError("the checkpoint has no LoRA adapters (train with --lora-rank)")
    state = {}
    for i in range(num_layers):
        for target in rank_targets[1]:
            ours = f"transformer.layers.{i}.{_LORA_LINEARS[target]}."
            theirs = f"{PEFT_PREFIX}transformer.h.{i}.{_hf_module(_LORA_LINEARS[target])}."
            for kind in ("lora_A", "lora_B"):
                state[f"{theirs}{kind}.weight"] = weights[ours + kind].contiguous().clone()
    return state


def from_peft_state_dict(peft_state, num_layers):
    """PEFT adapter tensors of an HF GPT-2 (adapter_model.safetensors, or get_peft_model_state_dict) -> our
    full LoRA weights by name (the inverse of to_peft_state_dict)."""
    weights = {}
    for i in range(num_layers):
        for linear in _LORA_LINEARS.values():
            theirs = f"{PEFT_PREFIX}transformer.h.{i}.{_hf_module(linear)}."
            for kind in ("lora_A", "lora_B"):
                if theirs + f"{kind}.weight" in peft_state:
                    weights[f"transformer.layers.{i}.{linear}.{kind}"] = peft_state[theirs + f"{kind}.weight"]
    if len(weights) != sum(1 for key in peft_state if key.endswith((".lora_A.weight", ".lora_B.weight"))):
        raise InterchangeError("the adapter has LoRA weights on modules our GPT-2 does not adapt (targets: "
                               f"{', '.join(PEFT_TARGET_MODULES.values())}) or beyond n_layer {num_layers}")
    return weights


def peft_adapter_config(rank, alpha, targets, dropout=0.0, base_model_name_or_path=None, llama=False):
    """adapter_config.json of our adapters for peft.PeftModel.from_pretrained(GPT2LMHeadModel, DIR): LoRA on the
    Conv1D targets (fan_in_fan_out), no bias, scaling alpha / r. `llama`: for LlamaForCausalLM, LoRA on its
    nn.Linear projections (LLAMA_PEFT_TARGET_MODULES: q/k/v and gate/up one module each)."""
    modules = [m for t in targets for m in LLAMA_PEFT_TARGET_MODULES[t]] if llama else \
        [PEFT_TARGET_MODULES[t] for t in targets]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
            "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": modules, "fan_in_fan_out": not llama, "bias": "none",
            "modules_to_save": None, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "inference_mode": True}


# ---------------------------------------------------------------------------------------------------- Llama
# Our GPT2Model with the Llama options (docs/models.md) <-> transformers' LlamaForCausalLM:
#     ours                                              HF LlamaForCausalLM (nn.Linear: the same [out, in] layout)
#     word_embeddings.weight [V, h]                     model.embed_tokens.weight
#     transformer.layers.{i}.input_layernorm.weight     model.layers.{i}.input_layernorm.weight (RMSNorm)
#     ...attention.query_key_value [(n + 2 n_kv) d, h]  cat(q_proj [n d, h], k_proj [n_kv d, h], v_proj [n_kv d, h])
#     ...attention.dense [h, h]                         self_attn.o_proj
#     ...post_attention_layernorm.weight                post_attention_layernorm.weight
#     ...mlp.dense_h_to_4h [2f, h]                      cat(mlp.gate_proj [f, h], mlp.up_proj [f, h])
#     ...mlp.dense_4h_to_h [h, f]                       mlp.down_proj
#     transformer.final_layernorm.weight                model.norm.weight
#     output_layer.weight [V, h] (untied)               lm_head.weight
# HF's q_proj/k_proj rows are already in the rotate-half order our rotary embedding uses: no permutation.
LLAMA_ARCHITECTURE = {"swiglu": True, "normalization": "rmsnorm", "add_bias_linear": False,
                      "learned_position_embeddings": False, "rotary": True}
LLAMA_FLAGS = {"swiglu": "--swiglu", "normalization": "--normalization rmsnorm",   # the flags that set them
               "add_bias_linear": "--disable-bias-linear", "learned_position_embeddings": "--no-position-embedding",
               "rotary": "--use-rotary-position-embeddings"}


def missing_llama_flags(model_config):
    """The flags of the Llama options (LLAMA_ARCHITECTURE) that `model_config` lacks, in LLAMA_FLAGS' order."""
    return [flag for key, flag in LLAMA_FLAGS.items() if model_config.get(key) != LLAMA_ARCHITECTURE[key]]


LLAMA_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings")


def check_llama_config(hf_config):
    """The model_config (with the architecture fields) of a Llama config.json (dict or LlamaConfig);
    InterchangeError (one line) for what our model cannot express."""
    if not isinstance(hf_config, dict):
        hf_config = hf_config.to_dict()
    if hf_config.get("model_type") != "llama":
        raise InterchangeError(f"config.json has model_type {hf_config.get('model_type')!r}, not 'llama'")
    missing = [key for key in LLAMA_CONFIG_KEYS if key not in hf_config]
    if missing:
        raise InterchangeError(f"config.json has model_type 'llama' but lacks {', '.join(missing)}")
    for key, ours in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                      ("pretraining_tp", 1)):
        if hf_config.get(key, ours) != ours:
            raise InterchangeError(f"config.json has {key} {hf_config[key]!r}: our Llama needs {ours!r}")
    rope = hf_config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", (hf_config.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default":
        raise InterchangeError(f"config.json has rope_type {rope_type!r}: only plain rotary embeddings ('default')")
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    if hidden % heads or hf_config.get("head_dim", hidden // heads) != hidden // heads or heads % kv_heads:
        raise InterchangeError(f"config.json: hidden_size {hidden}, {heads} heads, head_dim "
                               f"{hf_config.get('head_dim')}, {kv_heads} key/value heads: our attention needs "
                               "head_dim = hidden_size / heads and heads a multiple of the key/value heads")
    return dict(LLAMA_ARCHITECTURE, num_layers=hf_config["num_hidden_layers"], hidden_size=hidden,
                num_attention_heads=heads, max_sequence_length=hf_config["max_position_embeddings"],
                vocab_size=hf_config["vocab_size"], layernorm_epsilon=hf_config.get("rms_norm_eps", 1e-6),
                num_key_value_heads=None if kv_heads == heads else kv_heads,
                ffn_hidden_size=hf_config["intermediate_size"],
                rotary_theta=float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))),
                untie_embeddings_and_output_weights=not hf_config.get("tie_word_embeddings", False))


def _llama_layer_pairs(i):
    """[(our name, [HF names fused along rows, in order])] of layer i."""
    ours, theirs = f"transformer.layers.{i}.", f"model.layers.{i}."
    return [(ours + "input_layernorm.weight", [theirs + "input_layernorm.weight"]),
            (ours + "attention.query_key_value.weight",
             [theirs + f"self_attn.{p}_proj.weight" for p in ("q", "k", "v")]),
            (ours + "attention.dense.weight", [theirs + "self_attn.o_proj.weight"]),
            (ours + "post_attention_layernorm.weight", [theirs + "post_attention_layernorm.weight"]),
            (ours + "mlp.dense_h_to_4h.weight", [theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"]),
            (ours + "mlp.dense_4h_to_h.weight", [theirs + "mlp.down_proj.weight"])]


def llama_name_pairs(model_config):
    """[(our name, [HF names])] of every parameter (lm_head only when untied)."""
    pairs = [("word_embeddings.weight", ["model.embed_tokens.weight"])]
    for i in range(model_config["num_layers"]):
        pairs += _llama_layer_pairs(i)
    pairs.append(("transformer.final_layernorm.weight", ["model.norm.weight"]))
    if model_config.get("untie_embeddings_and_output_weights"):
        pairs.append(("output_layer.weight", ["lm_head.weight"]))
    return pairs


def _row_blocks(model_config, ours):
    """The row sizes of a fused parameter's HF pieces: q/k/v (n d, n_kv d, n_kv d) or gate/up (f, f)."""
    if ours.endswith("query_key_value.weight"):
        h, heads = model_config["hidden_size"], model_config["num_attention_heads"]
        kv = h // heads * (model_config.get("num_key_value_heads") or heads)
        return [h, kv, kv]
    f = model_config["ffn_hidden_size"]
    return [f, f]


def from_hf_llama_state_dict(hf_state, hf_config):
    """LlamaForCausalLM tensors + its config.json -> (our full weights, model_config); q/k/v and gate/up fused
    (concatenated rows), tensors keep their dtype."""
    model_config = check_llama_config(hf_config)
    weights = {}
    for ours, theirs in llama_name_pairs(model_config):
        missing = [name for name in theirs if name not in hf_state]
        if missing:
            raise InterchangeError(f"the weights lack {missing[0]} (config.json has num_hidden_layers "
                                   f"{model_config['num_layers']}, tie_word_embeddings "
                                   f"{not model_config['untie_embeddings_and_output_weights']})")
        tensors = [hf_state[name] for name in theirs]
        if len(tensors) > 1 and [t.shape[0] for t in tensors] != _row_blocks(model_config, ours):
            raise InterchangeError(f"{', '.join(theirs)} have {[t.shape[0] for t in tensors]} rows, expected "
                                   f"{_row_blocks(model_config, ours)} from config.json")
        weights[ours] = torch.cat(tensors).contiguous() if len(tensors) > 1 else tensors[0].contiguous()
    rows = tuple(weights["word_embeddings.weight"].shape)
    if rows != (model_config["vocab_size"], model_config["hidden_size"]):
        raise InterchangeError(f"model.embed_tokens.weight is {list(rows)} but config.json has vocab_size "
                               f"{model_config['vocab_size']} and hidden_size {model_config['hidden_size']}")
    return weights, model_config


# Our LoRA targets -> the LlamaForCausalLM projections PEFT adapts (target_modules, matched as name suffixes).
LLAMA_PEFT_TARGET_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "dense": ("o_proj",),
                             "fc1": ("gate_proj", "up_proj"), "fc2": ("down_proj",)}


def to_peft_llama_state_dict(weights, model_config):
    """The adapters of our full Llama weights under PEFT's names for LlamaForCausalLM, contiguous copies. A fused
    linear's adapter (query_key_value: one A [r, h] and B [(n + 2 n_kv) d, r]; dense_h_to_4h: A and B [2f, r])
    becomes one adapter per HF projection, each with that same A and its row block of B: the updates
    [B_q; B_k; B_v] A = B A are exactly ours (the same r and alpha, so the same scale). The converse holds only for
    projections that share A, so an adapter trained in PEFT does not map back in general."""
    num_layers = model_config["num_layers"]
    rank_targets = lora_layout(weights, num_layers)
    if rank_targets is None:
        raise InterchangeError("the checkpoint has no LoRA adapters (train with --lora-rank)")
    hf_names = dict(llama_name_pairs(model_config))
    state = {}
    for i in range(num_layers):
        for target in rank_targets[1]:
            ours = f"transformer.layers.{i}.{_LORA_LINEARS[target]}."
            theirs = hf_names[ours + "weight"]
            lora_a, lora_b = weights[ours + "lora_A"], weights[ours + "lora_B"]
            blocks = lora_b.split(_row_blocks(model_config, ours + "weight")) if len(theirs) > 1 else [lora_b]
            for name, block in zip(theirs, blocks, strict=True):
                module = PEFT_PREFIX + name[:-len(".weight")]
                state[f"{module}.lora_A.weight"] = lora_a.contiguous().clone()
                state[f"{module}.lora_B.weight"] = block.contiguous().clone()
    return state


def to_hf_llama_state_dict(weights, model_config):
    """Our full weights -> LlamaForCausalLM's state dict (q/k/v and gate/up cut back into their projections);
    contiguous copies."""
    state = {}
    for ours, theirs in llama_name_pairs(model_config):
        if ours not in weights:
            raise InterchangeError(f"the checkpoint lacks {ours}")
        tensor = weights[ours]
        pieces = tensor.split(_row_blocks(model_config, ours)) if len(theirs) > 1 else [tensor]
        for name, piece in zip(theirs, pieces, strict=True):
            state[name] = piece.contiguous().clone()
    return state


def to_hf_llama_config_dict(model_config, bos_id=None, eos_id=None):
    """Keyword arguments of transformers.LlamaConfig for our model with the Llama options."""
    heads = model_config["num_attention_heads"]
    return {"vocab_size": model_config["vocab_size"], "hidden_size": model_config["hidden_size"],
            "intermediate_size": model_config["ffn_hidden_size"], "num_hidden_layers": model_config["num_layers"],
            "num_attention_heads": heads, "num_key_value_heads": model_config.get("num_key_value_heads") or heads,
            "head_dim": model_config["hidden_size"] // heads, "hidden_act": "silu",
            "max_position_embeddings": model_config["max_sequence_length"],
            "rms_norm_eps": model_config["layernorm_epsilon"],
            "rope_parameters": {"rope_type": "default", "rope_theta": model_config["rotary_theta"]},
            "tie_word_embeddings": not model_config["untie_embeddings_and_output_weights"],
            "attention_bias": False, "mlp_bias": False, "bos_token_id": bos_id, "eos_token_id": eos_id,
            "model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def is_llama_config(model_config):
    """Our model_config has the Llama options (converted as LlamaForCausalLM, not GPT2LMHeadModel)."""
    return not missing_llama_flags(model_config)
