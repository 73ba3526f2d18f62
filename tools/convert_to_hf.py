"""Convert a checkpoint of either path (Megatron or --deepspeed ZeRO, any model-parallel / data-parallel size) into
a Hugging Face GPT2LMHeadModel directory with its tokenizer.

    python tools/convert_to_hf.py --load checkpoints/gpt2 --output hf/gpt2 \
        [--vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt]

    from transformers import AutoTokenizer, GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained("hf/gpt2"); tokenizer = AutoTokenizer.from_pretrained("hf/gpt2")

Writes config.json (GPT2Config: the real, unpadded vocabulary, activation_function "gelu_new" = our tanh GELU,
tied LM head, bos/eos = our <|endoftext|> id), generation_config.json, model.safetensors (fp32: the fp32 master
weights when the checkpoint has them), and the tokenizer (vocab.json, merges.txt, tokenizer.json,
tokenizer_config.json, special_tokens_map.json). Reads the checkpoint the tracker (or ZeRO's `latest`) names.
Needs transformers and safetensors (pip install -r requirements-test.txt). Bad input: one line, exit status 1.

Note: transformers' tokenizer treats a literal "<|endoftext|>" in the text as the special token (its id), while
megatron.tokenizer encodes it as ordinary text (callers append the eod id); every other text gets the same ids.
"""
import argparse
import json
import os
import shutil
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
from megatron import cli  # noqa: E402
from megatron.model.hf_interchange import InterchangeError, to_hf_config_dict, to_hf_state_dict  # noqa: E402
from megatron.tokenizer.gpt2_tokenization import EOD_TOKEN, TokenizerFileError  # noqa: E402
from megatron.zero.checkpoint import LATEST_FILE, TRACKER_FILENAME, CheckpointError  # noqa: E402

DEFAULT_VOCAB_FILE = os.path.join(REPO, "data", "webtext", "vocab.json")
DEFAULT_MERGE_FILE = os.path.join(REPO, "data", "webtext", "merges.txt")
INSTALL_HINT = "pip install transformers safetensors (or: pip install -r requirements-test.txt)"
# A probe the exported tokenizer must encode exactly as megatron.tokenizer does.
_PROBE = "Hello world! It's a test: def f(x): return x**2  東京 😀 e\u0301\n\n  end."


class ConversionError(Exception):
    """Bad input for a conversion tool; the message is one line."""


def require_hf_packages():
    """Import transformers and safetensors, or a ConversionError naming the install command."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        raise ConversionError(f"this tool needs Hugging Face transformers and safetensors ({error}): "
                              f"{INSTALL_HINT}") from None


def check_checkpoint_dir(load_dir):
    """A directory with Megatron's tracker file or ZeRO's `latest`, or ConversionError."""
    if not os.path.isdir(load_dir):
        raise ConversionError(f"{load_dir} is not a checkpoint directory: it does not exist")
    if not any(os.path.isfile(os.path.join(load_dir, name)) for name in (TRACKER_FILENAME, LATEST_FILE)):
        raise ConversionError(f"{load_dir} is not a checkpoint directory: it has neither {TRACKER_FILENAME} nor "
                              f"{LATEST_FILE} (pass the --save directory of a training run)")


def read_checkpoint(load_dir):
    """megatron.full_checkpoint.read_full_checkpoint with one-line errors."""
    check_checkpoint_dir(load_dir)
    from megatron.full_checkpoint import read_full_checkpoint
    try:
        return read_full_checkpoint(load_dir)
    except (CheckpointError, OSError, ValueError, KeyError) as error:
        raise ConversionError(f"cannot read the checkpoint in {load_dir}: {_one_line(error)}") from None


def _one_line(error):
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def load_tokenizer(vocab_file, merge_file, vocab_size):
    """Our GPT2BPETokenizer for the files, checked against the checkpoint's vocabulary size."""
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    for kind, path in (("vocab", vocab_file), ("merge", merge_file)):
        if not os.path.isfile(path):
            raise ConversionError(f"{kind} file {path} does not exist (pass --{kind}-file)")
    try:
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    except TokenizerFileError as error:
        raise ConversionError(_one_line(error)) from None
    if tokenizer.vocab_size != vocab_size:
        raise ConversionError(f"vocab file {vocab_file} has {tokenizer.vocab_size} tokens but the checkpoint's "
                              f"vocabulary is {vocab_size}: pass the --vocab-file/--merge-file it was trained with")
    return tokenizer


def write_model(output_dir, full, eod_id):
    """config.json, generation_config.json and model.safetensors (fp32, tied head) into output_dir."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, GPT2Config
    config = GPT2Config(**to_hf_config_dict(full.model_config, eod_id))
    config.save_pretrained(output_dir)
    GenerationConfig.from_model_config(config).save_pretrained(output_dir)
    state = to_hf_state_dict(full.fp32_weights(), full.model_config)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    return config, state


def write_tokenizer(output_dir, tokenizer, model_max_length):
    """vocab.json + merges.txt (copied), tokenizer_config.json, special_tokens_map.json, then tokenizer.json
    through transformers; checks that the result encodes like ours."""
    from transformers import AutoTokenizer
    shutil.copyfile(tokenizer.vocab_file, os.path.join(output_dir, "vocab.json"))
    shutil.copyfile(tokenizer.merge_file, os.path.join(output_dir, "merges.txt"))
    special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}
    config = {"tokenizer_class": "GPT2Tokenizer", **special, "add_prefix_space": False, "add_bos_token": False,
              "errors": "replace", "model_max_length": model_max_length}
    _write_configs(output_dir, config, special)
    hf_tokenizer = AutoTokenizer.from_pretrained(output_dir)
    hf_tokenizer.save_pretrained(output_dir)  # adds tokenizer.json (the fast tokenizer's own file)
    _write_configs(output_dir, config, special)  # ours again, without the loader's run-time keys
    reloaded = AutoTokenizer.from_pretrained(output_dir)
    ids, ours = reloaded(_PROBE, verbose=False)["input_ids"], tokenizer.tokenize(_PROBE)
    if ids != ours or reloaded.eos_token_id != tokenizer.eod:
        raise ConversionError(f"the exported tokenizer encodes differently from megatron.tokenizer (ids {ids[:8]}... "
                              f"vs {ours[:8]}..., eos {reloaded.eos_token_id} vs {tokenizer.eod})")
    return reloaded


def _write_configs(output_dir, config, special):
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as handle:
            json.dump(content, handle, indent=2)
            handle.write("\n")


def convert(load_dir, output_dir, vocab_file=DEFAULT_VOCAB_FILE, merge_file=DEFAULT_MERGE_FILE):
    """The conversion; returns (model_config, number of tensors, number of parameters). ConversionError on bad
    input."""
    check_checkpoint_dir(load_dir)
    for kind, path in (("vocab", vocab_file), ("merge", merge_file)):
        if not os.path.isfile(path):
            raise ConversionError(f"{kind} file {path} does not exist (pass --{kind}-file)")
    require_hf_packages()
    full = read_checkpoint(load_dir)
    tokenizer = load_tokenizer(vocab_file, merge_file, full.model_config["vocab_size"])
    os.makedirs(output_dir, exist_ok=True)
    try:
        _, state = write_model(output_dir, full, tokenizer.eod)
    except InterchangeError as error:
        raise ConversionError(f"{load_dir}: {error}") from None
    write_tokenizer(output_dir, tokenizer, full.model_config["max_sequence_length"])
    return full.model_config, len(state), sum(t.numel() for t in state.values())


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (a training run's --save)")
    parser.add_argument("--output", required=True, help="directory for the Hugging Face files")
    parser.add_argument("--vocab-file", default=DEFAULT_VOCAB_FILE, help="GPT-2 vocab.json the model was trained "
                        "with (default: the embedded default data's)")
    parser.add_argument("--merge-file", default=DEFAULT_MERGE_FILE, help="its merges.txt")
    return parser.parse_args(argv)


def main(argv=None):
    """Returns the exit status (0, or 1 after printing one line to stderr)."""
    args = parse_args(argv)
    try:
        model_config, tensors, parameters = convert(args.load, args.output, args.vocab_file, args.merge_file)
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {args.output}: GPT2LMHeadModel ({model_config['num_layers']} layers, hidden "
          f"{model_config['hidden_size']}, {model_config['num_attention_heads']} heads, vocabulary "
          f"{model_config['vocab_size']}; {tensors} tensors, {parameters:,} parameters, fp32 safetensors) and its "
          "tokenizer", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
