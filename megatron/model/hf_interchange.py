"""The one mapping between our GPT2Model parameter names and Hugging Face transformers' GPT2LMHeadModel
(used by tools/convert_to_hf.py and tools/convert_from_hf.py; DESIGN.md section 6).

    hf_state = to_hf_state_dict(weights, model_config)          # ours (full, unsharded) -> HF tensors
    hf_config = to_hf_config_dict(model_config, eod_id)          # -> the keyword arguments of GPT2Config
    weights, model_config = from_hf_state_dict(hf_state, hf_config)   # HF -> ours (hf_config: config.json dict)

`weights` are what megatron.reshard returns: {our name: full tensor}, vocabulary rows = the real vocabulary.
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

This module imports neither transformers nor safetensors: the tools do, inside their functions.
"""
import torch

# Our per-layer module name -> (HF per-layer module name, is a Conv1D whose weight is transposed).
_LAYER_MODULES = (
    ("input_layernorm", "ln_1", False),
    ("attention.query_key_value", "attn.c_attn", True),
    ("attention.dense", "attn.c_proj", True),
    ("post_attention_layernorm", "ln_2", False),
    ("mlp.dense_h_to_4h", "mlp.c_fc", True),
    ("mlp.dense_4h_to_h", "mlp.c_proj", True),
)
MODEL_CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "max_sequence_length", "vocab_size",
                     "layernorm_epsilon")
# The tanh-approximated GELU under transformers' names (our MLP's activation).
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
HF_PREFIX = "transformer."


class InterchangeError(ValueError):
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
    rows = state["transformer.wte.weight"].size(0)
    if rows != model_config["vocab_size"]:
        raise InterchangeError(f"word embedding has {rows} rows but the vocabulary is {model_config['vocab_size']}")
    return state


def to_hf_config_dict(model_config, eod_id):
    """Keyword arguments of transformers.GPT2Config for our model (the real vocabulary; tied head; tanh GELU)."""
    return {"n_layer": model_config["num_layers"], "n_embd": model_config["hidden_size"],
            "n_head": model_config["num_attention_heads"], "n_positions": model_config["max_sequence_length"],
            "vocab_size": model_config["vocab_size"], "layer_norm_epsilon": model_config["layernorm_epsilon"],
            "activation_function": "gelu_new", "n_inner": None, "tie_word_embeddings": True,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "bos_token_id": eod_id, "eos_token_id": eod_id, "architectures": ["GPT2LMHeadModel"]}


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
