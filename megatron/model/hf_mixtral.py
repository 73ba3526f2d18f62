"""Hugging Face MixtralForCausalLM <-> our model with the Llama options and MoE MLPs (docs/models.md), both ways.

Mixtral is Llama (hf_interchange's mapping for attention, norms, embeddings and head) with every MLP a top-k of E
SwiGLU experts behind a softmax router that renormalizes the k weights: our MoEMLP with the softmax router (softmax
over the top-k logits, the same weights). Names, layer i, expert j (transformers 5 keeps the experts fused per
layer; its older checkpoints, block_sparse_moe.experts.j.w1/w2/w3, are read too):

    ours (full, unsharded)                               MixtralForCausalLM
    transformer.layers.i.mlp.router.weight [E, h]        model.layers.i.mlp.gate.weight
    ...mlp.experts.j.dense_h_to_4h.weight [2f, h]        model.layers.i.mlp.experts.gate_up_proj[j]  ([gate; up])
    ...mlp.experts.j.dense_4h_to_h.weight [h, f]         model.layers.i.mlp.experts.down_proj[j]

The router's training options (aux-loss coefficient, capacity) are not part of the model: an import is dropless
with no aux loss until the training flags say otherwise.
"""
import torch

import mpu
from megatron.model.hf_interchange import (InterchangeError, _llama_layer_pairs, check_llama_config,
                                           missing_llama_flags, to_hf_llama_config_dict)

LEGACY = "block_sparse_moe"      # transformers 4's per-expert names


def check_mixtral_config(hf_config):
    """The model_config (Llama options plus `moe`, an mpu.MoEConfig) of a Mixtral config.json (dict or
    MixtralConfig); InterchangeError (one line) for what our model cannot express."""
    if not isinstance(hf_config, dict):
        hf_config = hf_config.to_dict()
    if hf_config.get("model_type") != "mixtral":
        raise InterchangeError(f"config.json has model_type {hf_config.get('model_type')!r}, not 'mixtral'")
    for key in ("num_local_experts", "num_experts_per_tok"):
        if key not in hf_config:
            raise InterchangeError(f"config.json has model_type 'mixtral' but lacks {key}")
    window = hf_config.get("sliding_window")
    if window is not None and window < hf_config.get("max_position_embeddings", 0):
        raise InterchangeError(f"config.json has sliding_window {window}: our attention is full causal attention "
                               "(set sliding_window to null)")
    llama = {key: value for key, value in hf_config.items() if not (key == "head_dim" and value is None)}
    model_config = check_llama_config({**llama, "model_type": "llama"})     # Mixtral's head_dim None: h / heads
    model_config.update(num_experts=hf_config["num_local_experts"], moe_router_topk=hf_config["num_experts_per_tok"])
    model_config["moe"] = moe_config(model_config)
    return model_config


def moe_config(model_config):
    """The mpu.MoEConfig of a model_config: its `moe`, or what a checkpoint's record holds (num_experts,
    moe_router_topk; the router's training options are not recorded: softmax, dropless)."""
    if model_config.get("moe") is not None:
        return model_config["moe"]
    return mpu.MoEConfig(num_experts=model_config["num_experts"], topk=model_config["moe_router_topk"])


def is_mixtral_config(model_config):
    """A model_config (or a checkpoint's record) with MoE MLPs: converted as MixtralForCausalLM."""
    return model_config.get("moe") is not None or bool(model_config.get("num_experts"))


def _moe_pairs(i, num_experts):
    """[(our name, HF name, expert index or None)] of layer i's router and experts (transformers 5's names)."""
    ours, theirs = f"transformer.layers.{i}.mlp.", f"model.layers.{i}.mlp."
    pairs = [(ours + "router.weight", theirs + "gate.weight", None)]
    for j in range(num_experts):
        pairs += [(ours + f"experts.{j}.dense_h_to_4h.weight", theirs + "experts.gate_up_proj", j),
                  (ours + f"experts.{j}.dense_4h_to_h.weight", theirs + "experts.down_proj", j)]
    return pairs


def _dense_pairs(model_config):
    """[(our name, [HF names fused along rows])] of everything but the MLPs (Llama's)."""
    pairs = [("word_embeddings.weight", ["model.embed_tokens.weight"])]
    for i in range(model_config["num_layers"]):
        pairs += [(ours, theirs) for ours, theirs in _llama_layer_pairs(i) if ".mlp." not in ours]
    pairs.append(("transformer.final_layernorm.weight", ["model.norm.weight"]))
    if model_config.get("untie_embeddings_and_output_weights"):
        pairs.append(("output_layer.weight", ["lm_head.weight"]))
    return pairs


def _fused_experts(hf_state, i, num_experts):
    """Layer i's (router, gate_up [E, 2f, h], down [E, h, f]) from transformers 5's or 4's names."""
    new = f"model.layers.{i}.mlp."
    if new + "experts.gate_up_proj" in hf_state:
        return hf_state[new + "gate.weight"], hf_state[new + "experts.gate_up_proj"], hf_state[new + "experts.down_proj"]
    old = f"model.layers.{i}.{LEGACY}."
    if old + "gate.weight" not in hf_state:
        raise InterchangeError(f"the weights lack {new}experts.gate_up_proj (and {old}gate.weight)")
    experts = [f"{old}experts.{j}." for j in range(num_experts)]
    gate_up = torch.stack([torch.cat([hf_state[e + "w1.weight"], hf_state[e + "w3.weight"]]) for e in experts])
    down = torch.stack([hf_state[e + "w2.weight"] for e in experts])
    return hf_state[old + "gate.weight"], gate_up, down


def from_hf_mixtral_state_dict(hf_state, hf_config):
    """MixtralForCausalLM tensors + its config.json -> (our full weights, model_config)."""
    model_config = check_mixtral_config(hf_config)
    weights = {}
    for ours, theirs in _dense_pairs(model_config):
        missing = [name for name in theirs if name not in hf_state]
        if missing:
            raise InterchangeError(f"the weights lack {missing[0]}")
        weights[ours] = torch.cat([hf_state[name] for name in theirs]).contiguous()
    num_experts, f = model_config["num_experts"], model_config["ffn_hidden_size"]
    for i in range(model_config["num_layers"]):
        router, gate_up, down = _fused_experts(hf_state, i, num_experts)
        if tuple(gate_up.shape[:2]) != (num_experts, 2 * f):
            raise InterchangeError(f"layer {i}'s experts are {list(gate_up.shape)}, expected [{num_experts}, {2 * f}, "
                                   f"h] from config.json")
        weights[f"transformer.layers.{i}.mlp.router.weight"] = router.contiguous()
        for j in range(num_experts):
            prefix = f"transformer.layers.{i}.mlp.experts.{j}."
            weights[prefix + "dense_h_to_4h.weight"] = gate_up[j].contiguous()
            weights[prefix + "dense_4h_to_h.weight"] = down[j].contiguous()
    return weights, model_config


def to_hf_mixtral_state_dict(weights, model_config):
    """Our full weights -> MixtralForCausalLM's state dict (transformers 5's fused experts); contiguous copies."""
    state = {}
    h, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    kv = h // heads * (model_config.get("num_key_value_heads") or heads)
    for ours, theirs in _dense_pairs(model_config):
        if ours not in weights:
            raise InterchangeError(f"the checkpoint lacks {ours}")
        pieces = weights[ours].split([h, kv, kv]) if len(theirs) == 3 else [weights[ours]]
        for name, piece in zip(theirs, pieces, strict=True):
            state[name] = piece.contiguous().clone()
    num_experts = moe_config(model_config).num_experts
    for i in range(model_config["num_layers"]):
        prefix, theirs = f"transformer.layers.{i}.mlp.", f"model.layers.{i}.mlp."
        state[theirs + "gate.weight"] = weights[prefix + "router.weight"].contiguous().clone()
        state[theirs + "experts.gate_up_proj"] = torch.stack(
            [weights[prefix + f"experts.{j}.dense_h_to_4h.weight"] for j in range(num_experts)]).contiguous()
        state[theirs + "experts.down_proj"] = torch.stack(
            [weights[prefix + f"experts.{j}.dense_4h_to_h.weight"] for j in range(num_experts)]).contiguous()
    return state


def to_hf_mixtral_config_dict(model_config, bos_id=None, eos_id=None):
    """Keyword arguments of transformers.MixtralConfig for our model with the Llama options and MoE;
    InterchangeError naming the flags of the Llama options it lacks (a GPT-2-shaped MoE has no HF class)."""
    missing = missing_llama_flags(model_config)
    if missing:
        raise InterchangeError(f"Mixtral (MixtralForCausalLM) is the Llama options with MoE; this MoE model was "
                               f"trained without {', '.join(missing)}: it has no Hugging Face class")
    config = to_hf_llama_config_dict(model_config, bos_id, eos_id)
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        config.pop(key)
    moe = moe_config(model_config)
    if moe.router != "softmax" or moe.layer_freq != 1:
        raise InterchangeError(f"Mixtral has a softmax router in every layer; this model has a {moe.router} router "
                               f"every {moe.layer_freq} layer(s)")
    return {**config, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.topk, "sliding_window": None,
            "router_jitter_noise": 0.0, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
