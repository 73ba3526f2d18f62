"""Convert a local Hugging Face GPT2LMHeadModel or LlamaForCausalLM directory into a checkpoint that training loads
with --finetune.

    python tools/convert_from_hf.py --hf hf/gpt2 --save checkpoints/from_hf --model-parallel-size 2 [--deepspeed]
    python pretrain_gpt.py ... --model-parallel-size 2 --load checkpoints/from_hf --finetune [--deepspeed ...]

Reads config.json and model.safetensors (or a sharded model.safetensors.index.json, or pytorch_model.bin, loaded
with weights_only=True); no hub access. Maps the names back (Conv1D weights transposed, the fused c_attn to
query_key_value's rows) and writes a 'release' checkpoint through megatron.checkpoint.full_checkpoint.write_full_checkpoint: the
Megatron layout, or the ZeRO layout with --deepspeed, split for --model-parallel-size, the vocabulary padded to a
multiple of --make-vocab-size-divisible-by x model-parallel size (train with the same flag). Any vocabulary size
is accepted. A Llama directory (model_type "llama") becomes our model with the Llama options (docs/models.md: q/k/v
and gate/up fused, grouped-query attention, RMSNorm, rotary, untied head), a Mixtral one (model_type "mixtral") that
model with MoE MLPs (--num-experts, --moe-router-topk); the printed flags build it.
Bad input: one line, exit status 1.
"""
import argparse
import json
import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
from megatron import cli  # noqa: E402
from megatron.model.hf_interchange import (InterchangeError, check_hf_config, check_llama_config,  # noqa: E402
                                           from_hf_llama_state_dict, from_hf_state_dict)
from megatron.model.hf_mixtral import check_mixtral_config, from_hf_mixtral_state_dict  # noqa: E402
from megatron.checkpoint.layout import CheckpointError  # noqa: E402

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PYTORCH_BIN, PYTORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
INSTALL_HINT = "pip install safetensors (or: pip install -r requirements-test.txt)"


class ConversionError(cli.UserError):
    """Bad input; the message is one line."""


def read_hf_config(hf_dir):
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir} is not a directory (pass a local Hugging Face model directory)")
    if not os.path.isfile(path):
        raise ConversionError(f"{hf_dir} has no config.json: not a Hugging Face model directory")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} is not a JSON object")
    return config


def _weight_files(hf_dir):
    """(kind, [paths]) of the model weights, safetensors preferred."""
    for kind, single, index in (("safetensors", SAFETENSORS, SAFETENSORS_INDEX),
                                ("bin", PYTORCH_BIN, PYTORCH_BIN_INDEX)):
        if os.path.isfile(os.path.join(hf_dir, single)):
            return kind, [os.path.join(hf_dir, single)]
        index_path = os.path.join(hf_dir, index)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            paths = [os.path.join(hf_dir, shard) for shard in shards]
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise ConversionError(f"{index_path} names {missing[0]}, which does not exist")
            return kind, paths
    raise ConversionError(f"{hf_dir} has no weights file: expected {SAFETENSORS} (or {SAFETENSORS_INDEX}, "
                          f"{PYTORCH_BIN})")


def read_hf_weights(hf_dir):
    """{HF name: tensor} from the directory's weights file(s)."""
    import torch
    kind, paths = _weight_files(hf_dir)
    state = {}
    for path in paths:
        if kind == "safetensors":
            try:
                from safetensors.torch import load_file
            except ImportError as error:
                raise ConversionError(f"reading {path} needs safetensors ({error}): {INSTALL_HINT}") from None
            try:
                state.update(load_file(path))
            except Exception as error:  # safetensors raises its own SafetensorError for damaged files
                raise ConversionError(f"cannot read {path}: {' '.join(str(error).split())}") from None
        else:
            try:
                state.update(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as error:  # unpickling errors of many kinds: one line
                raise ConversionError(f"cannot read {path} with weights_only=True: "
                                      f"{' '.join(str(error).split())[:300]}") from None
    return state


def convert(hf_dir, save_dir, model_parallel_size=1, deepspeed=False, make_vocab_size_divisible_by=128,
            progress=None):
    """Returns (model_config, number of parameters). ConversionError on bad input. `progress`: a cli.ProgressLine
    counting the tensors written (one per model-parallel rank and parameter)."""
    hf_config = read_hf_config(hf_dir)
    check, from_state = {"llama": (check_llama_config, from_hf_llama_state_dict),
                         "mixtral": (check_mixtral_config, from_hf_mixtral_state_dict)}.get(
        hf_config.get("model_type"), (check_hf_config, from_hf_state_dict))
    try:
        model_config = check(hf_config)
    except InterchangeError as error:
        raise ConversionError(f"{hf_dir}: {error}") from None
    heads = model_config["num_attention_heads"]
    if model_parallel_size < 1 or heads % model_parallel_size:
        raise ConversionError(f"--model-parallel-size {model_parallel_size} does not divide the {heads} attention "
                              "heads")
    kv_heads = model_config.get("num_key_value_heads") or heads
    if kv_heads % model_parallel_size and model_parallel_size % kv_heads:
        raise ConversionError(f"--model-parallel-size {model_parallel_size} is neither a divisor nor a multiple of "
                              f"the {kv_heads} key/value heads")
    if make_vocab_size_divisible_by < 1:
        raise ConversionError(f"--make-vocab-size-divisible-by must be at least 1, got {make_vocab_size_divisible_by}")
    try:
        weights, model_config = from_state(read_hf_weights(hf_dir), hf_config)
    except InterchangeError as error:
        raise ConversionError(f"{hf_dir}: {error}") from None
    from megatron.checkpoint.full_checkpoint import write_full_checkpoint
    try:
        write_full_checkpoint(save_dir, weights, model_config, model_parallel_size, deepspeed=deepspeed,
                              make_vocab_size_divisible_by=make_vocab_size_divisible_by, progress=progress)
    except (CheckpointError, OSError, ValueError) as error:
        raise ConversionError(f"writing {save_dir}: {' '.join(str(error).split())}") from None
    return model_config, sum(t.numel() for t in weights.values())


def training_flags(model_config, options):
    """The pretrain_gpt.py flags that build the converted model."""
    flags = ["--model-parallel-size", str(options.model_parallel_size), "--num-layers", str(model_config["num_layers"]),
             "--hidden-size", str(model_config["hidden_size"]), "--num-attention-heads",
             str(model_config["num_attention_heads"]), "--max-position-embeddings",
             str(model_config["max_sequence_length"]), "--make-vocab-size-divisible-by",
             str(options.make_vocab_size_divisible_by)]
    if model_config["layernorm_epsilon"] != 1e-5:
        flags += ["--layernorm-epsilon", repr(model_config["layernorm_epsilon"])]
    flags += architecture_flags(model_config)
    return flags + (["--deepspeed"] if options.deepspeed else [])


def architecture_flags(model_config):
    """The Llama-option flags (docs/models.md) of a model_config; none for GPT-2."""
    flags = []
    for key, flag in (("swiglu", "--swiglu"), ("rotary", "--use-rotary-position-embeddings"),
                      ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights")):
        if model_config.get(key):
            flags.append(flag)
    if model_config.get("rotary"):
        flags += ["--rotary-position-embeddings-theta", repr(model_config["rotary_theta"])]
    if model_config.get("add_bias_linear") is False:
        flags.append("--disable-bias-linear")
    if model_config.get("learned_position_embeddings") is False:
        flags.append("--no-position-embedding")
    if model_config.get("normalization", "layernorm") != "layernorm":
        flags += ["--normalization", model_config["normalization"]]
    for key in ("num_key_value_heads", "ffn_hidden_size", "num_experts", "moe_router_topk"):
        if model_config.get(key):
            flags += [f"--{key.replace('_', '-')}", str(model_config[key])]
    return flags


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="local Hugging Face GPT2LMHeadModel, LlamaForCausalLM or "
                        "MixtralForCausalLM directory")
    parser.add_argument("--save", required=True, help="checkpoint directory to write (for --load ... --finetune)")
    parser.add_argument("--model-parallel-size", "--tensor-model-parallel-size", type=int, default=1,
                        dest="model_parallel_size")
    parser.add_argument("--deepspeed", action="store_true", help="write the ZeRO layout (load with --deepspeed)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return parser.parse_args(argv)


def main(argv=None):
    """Returns the exit status (0, or 1 after printing one line to stderr)."""
    options = parse_args(argv)
    try:
        model_config, parameters = convert(options.hf, options.save, options.model_parallel_size, options.deepspeed,
                                           options.make_vocab_size_divisible_by, cli.ProgressLine("Wrote", "tensors"))
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    layout = "ZeRO (--deepspeed)" if options.deepspeed else "Megatron"
    print(f"wrote {options.save}: {layout} release checkpoint at model-parallel size {options.model_parallel_size} "
          f"({model_config['num_layers']} layers, hidden {model_config['hidden_size']}, "
          f"{model_config['num_attention_heads']} heads, vocabulary {model_config['vocab_size']} padded to a multiple "
          f"of {options.make_vocab_size_divisible_by * options.model_parallel_size}; {parameters:,} parameters). Train "
          f"with --load {options.save} --finetune {' '.join(training_flags(model_config, options))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
