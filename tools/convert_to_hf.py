"""Convert a checkpoint of either path (Megatron or --deepspeed ZeRO, any model-parallel / data-parallel size) into
a Hugging Face GPT2LMHeadModel directory with its tokenizer.

    python tools/convert_to_hf.py --load checkpoints/gpt2 --output hf/gpt2 \
        [--vocab-file data/webtext/vocab.json --merge-file data/webtext/merges.txt]

    from transformers import AutoTokenizer, GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained("hf/gpt2"); tokenizer = AutoTokenizer.from_pretrained("hf/gpt2")

A LoRA checkpoint (trained with --lora-rank): --output gets the merged model (W + (alpha / r) B A), and
--peft-adapter DIR also writes the adapters in PEFT's format with the unmerged base model in DIR/base:

    python tools/convert_to_hf.py --load checkpoints/sft_lora --output hf/merged --peft-adapter hf/adapter

    from peft import PeftModel
    model = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained("hf/adapter/base"), "hf/adapter")
    # or peft.AutoPeftModelForCausalLM.from_pretrained("hf/adapter") (adapter_config.json names the base's path)

A reward-model checkpoint (train_reward_model.py: it holds score.weight) becomes a GPT2ForSequenceClassification
(num_labels 1, pad_token_id = <|endoftext|>, so HF scores each row's last token that is not end-of-text, as
training did): GPT2ForSequenceClassification.from_pretrained("hf/reward")(input_ids=ids).logits[:, 0]. With the
Llama options it becomes a LlamaForSequenceClassification by the same rule (pass the training run's --vocab-file and
--merge-file: the end-of-text id is its pad_token_id).

Writes config.json (GPT2Config: the real, unpadded vocabulary, activation_function "gelu_new" = our tanh GELU,
tied LM head, bos/eos = our <|endoftext|> id), generation_config.json, model.safetensors (fp32: the fp32 master
weights when the checkpoint has them), and the tokenizer (vocab.json, merges.txt, tokenizer.json,
tokenizer_config.json, special_tokens_map.json). Reads the checkpoint the tracker (or ZeRO's `latest`) names.
Needs transformers and safetensors (pip install -r requirements-test.txt). Bad input: one line, exit status 1.

A checkpoint of our model with the Llama options (docs/models.md; e.g. one tools/convert_from_hf.py imported from
a LlamaForCausalLM) becomes a LlamaForCausalLM directory: config.json, generation_config.json and model.safetensors
(q/k/v and gate/up cut back into their projections; fp32). Its tokenizer is not ours to write: copy the original
directory's tokenizer files next to them. LoRA on it is merged too, and --peft-adapter writes one PEFT adapter per
HF projection (q_proj, k_proj, v_proj share our fused adapter's A and take their rows of its B; gate_proj, up_proj
likewise): PeftModel over LlamaForCausalLM computes exactly the model we trained.

With the Llama options and --num-experts it becomes a MixtralForCausalLM directory (megatron/model/hf_mixtral.py),
at any expert-parallel size it was saved at, with our tokenizer files when --vocab-file has the model's vocabulary
(a model trained here; one imported from Hugging Face keeps its own: the closing line says so). An MoE model without
the Llama options (GeLU experts, biases, learned positions) has no Hugging Face class: refused in one line naming the
flags it lacks, before anything is written.

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
from megatron.model.hf_interchange import (REWARD_HEAD, InterchangeError, lora_layout, merge_lora,  # noqa: E402
                                           peft_adapter_config, to_hf_config_dict, to_hf_state_dict, to_peft_state_dict,
                                           is_llama_config, to_hf_llama_config_dict, to_hf_llama_state_dict,
                                           to_peft_llama_state_dict)
from megatron.model.hf_mixtral import is_mixtral_config, to_hf_mixtral_config_dict, to_hf_mixtral_state_dict  # noqa: E402
from mpu import is_lora_parameter  # noqa: E402
from megatron.tokenizer.gpt2_tokenization import EOD_TOKEN, TokenizerFileError  # noqa: E402
from megatron.checkpoint.layout import LATEST_FILE, TRACKER_FILENAME, CheckpointError  # noqa: E402

DEFAULT_VOCAB_FILE = os.path.join(REPO, "data", "webtext", "vocab.json")
DEFAULT_MERGE_FILE = os.path.join(REPO, "data", "webtext", "merges.txt")
NOT_OURS = "(copy the tokenizer files from the original directory)"   # a Llama export's closing note
INSTALL_HINT = "pip install transformers safetensors (or: pip install -r requirements-test.txt)"
# A probe the exported tokenizer must encode exactly as megatron.tokenizer does.
_PROBE = "Hello world! It's a test: def f(x): return x**2  東京 😀 e\u0301\n\n  end."


class ConversionError(cli.UserError):
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
    """megatron.checkpoint.full_checkpoint.read_full_checkpoint with one-line errors."""
    check_checkpoint_dir(load_dir)
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    try:
        return read_full_checkpoint(load_dir)
    except (CheckpointError, OSError, ValueError, KeyError) as error:
        raise ConversionError(f"cannot read the checkpoint in {load_dir}: {_one_line(error)}") from None


def _one_line(error):
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


def load_tokenizer(vocab_file, merge_file, vocab_size=None):
    """Our GPT2BPETokenizer for the files, checked against the checkpoint's vocabulary size (unless None)."""
    from megatron.tokenizer.tokenizer import GPT2BPETokenizer
    for kind, path in (("vocab", vocab_file), ("merge", merge_file)):
        if not os.path.isfile(path):
            raise ConversionError(f"{kind} file {path} does not exist (pass --{kind}-file)")
    try:
        tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    except TokenizerFileError as error:
        raise ConversionError(_one_line(error)) from None
    if vocab_size is not None and tokenizer.vocab_size != vocab_size:
        raise ConversionError(f"vocab file {vocab_file} has {tokenizer.vocab_size} tokens but the checkpoint's "
                              f"vocabulary is {vocab_size}: pass the --vocab-file/--merge-file it was trained with")
    return tokenizer


def write_model(output_dir, weights, model_config, eod_id):
    """config.json, generation_config.json and model.safetensors (fp32, tied head) of our full `weights` (without
    LoRA adapters: merged or left out) into output_dir; a reward model's (with score.weight): config.json and
    model.safetensors of a GPT2ForSequenceClassification."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, GPT2Config
    os.makedirs(output_dir, exist_ok=True)
    reward = REWARD_HEAD in weights
    config = GPT2Config(**to_hf_config_dict(model_config, eod_id, reward))
    config.save_pretrained(output_dir)
    if not reward:
        GenerationConfig.from_model_config(config).save_pretrained(output_dir)
    state = to_hf_state_dict(weights, model_config)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    return config, state


def refuse_disagreeing_alpha(full, lora_alpha):
    """ConversionError when --lora-alpha contradicts the alpha the checkpoint records: checked before any tensor is
    read, so the error is the only line printed."""
    saved = full.saved.model_shape.get("lora_alpha")
    if saved is not None and lora_alpha is not None and float(saved) != float(lora_alpha):
        raise ConversionError(f"--lora-alpha {lora_alpha} disagrees with the checkpoint's LoRA alpha {saved}: drop "
                              "--lora-alpha")


def lora_alpha_of(full, rank, lora_alpha):
    """The adapters' alpha: the checkpoint's (model_shape "lora_alpha") or --lora-alpha (convert() has refused one
    that disagrees)."""
    saved = full.saved.model_shape.get("lora_alpha")
    alpha = saved if saved is not None else lora_alpha
    if alpha is None:
        raise ConversionError(f"the checkpoint has LoRA adapters (rank {rank}) but does not record their alpha: "
                              "pass --lora-alpha (the training run's)")
    if not alpha > 0:
        raise ConversionError(f"--lora-alpha ({alpha}) must be > 0")
    return alpha


def write_peft_adapter(directory, weights, model_config, tokenizer, rank, alpha, targets):
    """DIR/adapter_config.json + DIR/adapter_model.safetensors (PEFT's LoRA format) and the unmerged base model
    with its tokenizer in DIR/base (the adapter's base_model_name_or_path, as an absolute path)."""
    from safetensors.torch import save_file
    base_dir = os.path.join(directory, "base")
    base = {name: tensor for name, tensor in weights.items() if not is_lora_parameter(name)}
    write_model(base_dir, base, model_config, tokenizer.eod)
    write_tokenizer(base_dir, tokenizer, model_config["max_sequence_length"])
    save_file(to_peft_state_dict(weights, model_config["num_layers"]),
              os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = peft_adapter_config(rank, alpha, targets, base_model_name_or_path=os.path.abspath(base_dir))
    with open(os.path.join(directory, "adapter_config.json"), "w", encoding="utf-8") as handle:
        json.dump(adapter_config, handle, indent=2)
        handle.write("\n")


def write_tokenizer(output_dir, tokenizer, model_max_length):
    """vocab.json + merges.txt (copied), tokenizer_config.json, special_tokens_map.json, then tokenizer.json
    through transformers; checks that the result encodes like ours."""
    from transformers import AutoTokenizer, GPT2Tokenizer
    shutil.copyfile(tokenizer.vocab_file, os.path.join(output_dir, "vocab.json"))
    shutil.copyfile(tokenizer.merge_file, os.path.join(output_dir, "merges.txt"))
    special = {"bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}
    config = {"tokenizer_class": "GPT2Tokenizer", **special, "add_prefix_space": False, "add_bos_token": False,
              "errors": "replace", "model_max_length": model_max_length}
    _write_configs(output_dir, config, special)
    # GPT2Tokenizer by name: AutoTokenizer reads a Mixtral directory only with tokenizer.json, written here
    GPT2Tokenizer.from_pretrained(output_dir).save_pretrained(output_dir)  # adds tokenizer.json (its own file)
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


def convert(load_dir, output_dir, vocab_file=DEFAULT_VOCAB_FILE, merge_file=DEFAULT_MERGE_FILE, progress=None,
            peft_adapter=None, lora_alpha=None):
    """The conversion; returns (model_config, number of tensors, number of parameters, LoRA (rank, alpha, targets)
    or None, None when the tokenizer was written else the closing line's note why not). ConversionError on bad
    input. `progress`: a cli.ProgressLine counting the checkpoint's tensors read.
    A LoRA checkpoint's adapters are merged into output_dir's weights; `peft_adapter`: also write them in PEFT's
    format there, with the unmerged base model in peft_adapter/base. `lora_alpha`: when the checkpoint does not
    record it."""
    check_checkpoint_dir(load_dir)
    for kind, path in (("vocab", vocab_file), ("merge", merge_file)):
        if not os.path.isfile(path):
            raise ConversionError(f"{kind} file {path} does not exist (pass --{kind}-file)")
    require_hf_packages()
    full = read_checkpoint(load_dir)
    refuse_disagreeing_alpha(full, lora_alpha)
    if full.model_config is not None and is_mixtral_config(full.model_config):
        return convert_mixtral(full, output_dir, (vocab_file, merge_file), progress)
    if full.model_config is not None and is_llama_config(full.model_config):
        return convert_llama(full, output_dir, progress, peft_adapter, lora_alpha, (vocab_file, merge_file))
    try:
        full.require_gpt2("a Hugging Face GPT2LMHeadModel")
    except CheckpointError as error:
        raise ConversionError(_one_line(error)) from None
    tokenizer = load_tokenizer(vocab_file, merge_file, full.model_config["vocab_size"])
    num_layers = full.model_config["num_layers"]
    try:
        weights = full.fp32_weights(progress)
        lora = _lora_to_export(full, weights, load_dir, peft_adapter, lora_alpha)
        if lora is not None:
            rank, _, targets = lora
            if peft_adapter is not None:
                write_peft_adapter(peft_adapter, weights, full.model_config, tokenizer, *lora)
            weights = merge_lora(weights, num_layers, lora[1] / rank)
        _, state = write_model(output_dir, weights, full.model_config, tokenizer.eod)
    except InterchangeError as error:
        raise ConversionError(f"{load_dir}: {error}") from None
    write_tokenizer(output_dir, tokenizer, full.model_config["max_sequence_length"])
    return full.model_config, len(state), sum(t.numel() for t in state.values()), lora, None


def _lora_to_export(full, weights, directory, peft_adapter, lora_alpha):
    """(rank, alpha, targets) of the checkpoint's LoRA adapters, or None without any (refused with
    --peft-adapter)."""
    layout = lora_layout(weights, full.model_config["num_layers"])
    if layout is None:
        if peft_adapter is not None:
            raise ConversionError(f"{directory} has no LoRA adapters: --peft-adapter needs a checkpoint trained with "
                                  "--lora-rank")
        return None
    rank, targets = layout
    return rank, lora_alpha_of(full, rank, lora_alpha), targets


def convert_llama(full, output_dir, progress=None, peft_adapter=None, lora_alpha=None, tokenizer_files=None):
    """A checkpoint with the Llama options -> a LlamaForCausalLM directory (no tokenizer); convert's return. LoRA
    as for GPT-2: merged into output_dir's weights, and with `peft_adapter` also in PEFT's format (one adapter per
    HF projection: hf_interchange.to_peft_llama_state_dict) with the unmerged base model in peft_adapter/base. A
    reward model (score.weight) becomes a LlamaForSequenceClassification scoring the last token that is not
    pad_token_id = the end-of-text id of `tokenizer_files` (vocab, merges: the training run's), as for GPT-2 (a
    reward model has no LM head: an older checkpoint's untied output layer is left out)."""
    from safetensors.torch import save_file
    weights = full.fp32_weights(progress)
    model_config, num_layers = full.model_config, full.model_config["num_layers"]
    if REWARD_HEAD in weights:
        eod = load_tokenizer(*tokenizer_files, model_config["vocab_size"]).eod
        trunk = dict(model_config, untie_embeddings_and_output_weights=False)   # the HF names without lm_head
        state = to_hf_llama_state_dict(weights, trunk)
        state[REWARD_HEAD] = weights[REWARD_HEAD].contiguous().clone()
        write_llama_model(output_dir, state, model_config, reward_pad_id=eod)
        return model_config, len(state), sum(t.numel() for t in state.values()), None, NOT_OURS
    try:
        lora = _lora_to_export(full, weights, full.saved.directory, peft_adapter, lora_alpha)
        if lora is not None:
            rank, _, targets = lora
            if peft_adapter is not None:
                base = {name: tensor for name, tensor in weights.items() if not is_lora_parameter(name)}
                write_llama_model(os.path.join(peft_adapter, "base"), to_hf_llama_state_dict(base, model_config),
                                  model_config)
                save_file(to_peft_llama_state_dict(weights, model_config),
                          os.path.join(peft_adapter, "adapter_model.safetensors"), metadata={"format": "pt"})
                adapter_config = peft_adapter_config(rank, lora[1], targets, llama=True,
                                                     base_model_name_or_path=os.path.abspath(
                                                         os.path.join(peft_adapter, "base")))
                with open(os.path.join(peft_adapter, "adapter_config.json"), "w", encoding="utf-8") as handle:
                    json.dump(adapter_config, handle, indent=2)
                    handle.write("\n")
            weights = merge_lora(weights, num_layers, lora[1] / rank)
        state = to_hf_llama_state_dict(weights, model_config)
    except InterchangeError as error:
        raise ConversionError(f"{full.saved.directory}: {error}") from None
    write_llama_model(output_dir, state, model_config)
    return model_config, len(state), sum(t.numel() for t in state.values()), lora, NOT_OURS


def convert_mixtral(full, output_dir, tokenizer_files, progress=None):
    """A checkpoint with the Llama options and MoE MLPs -> a MixtralForCausalLM directory with our tokenizer when
    `tokenizer_files` (vocab, merges) hold the model's vocabulary (a model trained here; else the closing note says
    why there is none: one imported from Hugging Face keeps its own); convert's return. Refused before anything is
    written when the model lacks a Llama option (a GPT-2-shaped MoE). LoRA and reward models are not trained with
    MoE (refused by the flags)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, MixtralConfig
    model_config = full.model_config
    tokenizer = load_tokenizer(*tokenizer_files)
    note = None if tokenizer.vocab_size == model_config["vocab_size"] else (
        f"(no tokenizer: {tokenizer_files[0]} has {tokenizer.vocab_size} tokens, the model "
        f"{model_config['vocab_size']}: pass the --vocab-file/--merge-file it was trained with, or copy the "
        "tokenizer files from the original directory)")
    eod = tokenizer.eod if note is None else None
    try:
        config = MixtralConfig(**to_hf_mixtral_config_dict(model_config, eod, eod))
        state = to_hf_mixtral_state_dict(full.fp32_weights(progress), model_config)
    except InterchangeError as error:
        raise ConversionError(f"{full.saved.directory}: {error}") from None
    os.makedirs(output_dir, exist_ok=True)
    config.save_pretrained(output_dir)
    GenerationConfig.from_model_config(config).save_pretrained(output_dir)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    if note is None:
        write_tokenizer(output_dir, tokenizer, model_config["max_sequence_length"])
    return model_config, len(state), sum(t.numel() for t in state.values()), None, note


def write_llama_model(output_dir, state, model_config, reward_pad_id=None):
    """config.json (LlamaConfig), generation_config.json and model.safetensors of HF's `state`; `reward_pad_id`: a
    LlamaForSequenceClassification's (one label, that pad_token_id), no generation_config.json."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig
    os.makedirs(output_dir, exist_ok=True)
    config = to_hf_llama_config_dict(model_config)
    if reward_pad_id is not None:
        config.update(num_labels=1, pad_token_id=reward_pad_id, architectures=["LlamaForSequenceClassification"])
    config = LlamaConfig(**config)
    config.save_pretrained(output_dir)
    if reward_pad_id is None:
        GenerationConfig.from_model_config(config).save_pretrained(output_dir)
    save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint directory (a training run's --save)")
    parser.add_argument("--output", required=True, help="directory for the Hugging Face files")
    parser.add_argument("--vocab-file", default=DEFAULT_VOCAB_FILE, help="GPT-2 vocab.json the model was trained "
                        "with (default: the embedded default data's)")
    parser.add_argument("--merge-file", default=DEFAULT_MERGE_FILE, help="its merges.txt")
    parser.add_argument("--peft-adapter", default=None, metavar="DIR", help="LoRA checkpoint: also write its "
                        "adapters in PEFT's format to DIR (adapter_config.json, adapter_model.safetensors) with the "
                        "unmerged base model in DIR/base (--output gets the merged model)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA checkpoint: the training run's "
                        "--lora-alpha, when the checkpoint does not record it")
    return parser.parse_args(argv)


def main(argv=None):
    """Returns the exit status (0, or 1 after printing one line to stderr)."""
    args = parse_args(argv)
    try:
        model_config, tensors, parameters, lora, tokenizer_note = convert(args.load, args.output, args.vocab_file, args.merge_file,
                                                          cli.ProgressLine("Read", "tensors"), args.peft_adapter,
                                                          args.lora_alpha)
    except cli.UserError as error:     # ConversionError, or a CheckpointError met while reading the tensors
        print(f"error: {_one_line(error)}", file=sys.stderr, flush=True)
        return 1
    merged = "" if lora is None else f", LoRA rank {lora[0]} alpha {lora[1]:g} on {','.join(lora[2])} merged"
    with open(os.path.join(args.output, "config.json"), encoding="utf-8") as handle:
        architecture = json.load(handle)["architectures"][0]
    print(f"wrote {args.output}: {architecture} ({model_config['num_layers']} layers, hidden "
          f"{model_config['hidden_size']}, {model_config['num_attention_heads']} heads, vocabulary "
          f"{model_config['vocab_size']}; {tensors} tensors, {parameters:,} parameters, fp32 safetensors{merged})"
          + (" and its tokenizer" if tokenizer_note is None else " " + tokenizer_note), flush=True)
    if args.peft_adapter is not None:
        print(f"wrote {args.peft_adapter}: the PEFT LoRA adapter (adapter_config.json, adapter_model.safetensors) and "
              f"its unmerged base model in {os.path.join(args.peft_adapter, 'base')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
