"""Consolidate a checkpoint into one fp32 state dict (DeepSpeed's zero_to_fp32.py, for both of our paths).

    python tools/zero_to_fp32.py CHECKPOINT_DIR OUTPUT_FILE [-t TAG]
    state = torch.load(OUTPUT_FILE, weights_only=True)   # {parameter name: full fp32 tensor}

CHECKPOINT_DIR is a training run's --save directory, of either path (ZeRO --deepspeed or Megatron), any ZeRO
stage, model-parallel, pipeline, data-parallel and expert-parallel size. TAG is a tag directory inside it (iter_0000006, release, ...);
default: the one `latest` / latest_checkpointed_iteration.txt names. The output holds our GPT2Model's parameter
names with full, unsharded tensors (the fused query_key_value in q, k, v row order; the word embedding trimmed to
the real vocabulary), fp32: the fp32 master weights when the checkpoint has them (ZeRO, fp16/bf16 training),
else the weights as float. Bad input: one line, exit status 1.
"""
import argparse
import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, REPO)
from megatron import cli  # noqa: E402
from megatron.checkpoint.layout import LATEST_FILE, TRACKER_FILENAME, CheckpointError  # noqa: E402


class ConversionError(cli.UserError):
    """Bad input; the message is one line."""


def _one_line(error):
    return " ".join((str(error).strip() or type(error).__name__).split())


def _tags(checkpoint_dir):
    return sorted(name for name in os.listdir(checkpoint_dir) if os.path.isdir(os.path.join(checkpoint_dir, name))
                  and not name.startswith("."))


def _read(checkpoint_dir, tag=None):
    from megatron.checkpoint.full_checkpoint import read_full_checkpoint
    try:
        return read_full_checkpoint(checkpoint_dir, tag)
    except (CheckpointError, OSError, ValueError, KeyError) as error:
        where = f"{checkpoint_dir}/{tag}" if tag else f"the checkpoint in {checkpoint_dir}"
        raise ConversionError(f"cannot read {where}: {_one_line(error)}") from None


def consolidate(checkpoint_dir, output_file, tag=None):
    """Write torch.save({name: full fp32 tensor}) to output_file; returns (tensors, parameters)."""
    import torch
    if not os.path.isdir(checkpoint_dir):
        raise ConversionError(f"{checkpoint_dir} is not a checkpoint directory: it does not exist")
    if tag is None:
        if not any(os.path.isfile(os.path.join(checkpoint_dir, name)) for name in (TRACKER_FILENAME, LATEST_FILE)):
            raise ConversionError(f"{checkpoint_dir} is not a checkpoint directory: it has neither {LATEST_FILE} "
                                  f"nor {TRACKER_FILENAME} (pass a training run's --save directory, or -t TAG)")
        full = _read(checkpoint_dir)
    else:
        if "/" in tag or tag in (".", "..") or not os.path.isdir(os.path.join(checkpoint_dir, tag)):
            raise ConversionError(f"{checkpoint_dir} has no tag directory {tag!r} (it has: "
                                  f"{', '.join(_tags(checkpoint_dir)) or 'none'})")
        full = _read(checkpoint_dir, tag)
    state = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in
             full.fp32_weights().items()}
    from megatron.checkpoint.atomic_io import atomic_torch_save
    try:
        os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
        atomic_torch_save(state, output_file)
    except OSError as error:
        raise ConversionError(f"cannot write {output_file}: {_one_line(error)}") from None
    return len(state), sum(t.numel() for t in state.values())


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="a training run's --save directory (holding `latest` or "
                        f"{TRACKER_FILENAME})")
    parser.add_argument("output_file", help="where to torch.save the consolidated fp32 state dict")
    parser.add_argument("-t", "--tag", default=None, help="tag directory to read (e.g. iter_0000006); default: "
                        "the one the tracker names")
    return parser.parse_args(argv)


def main(argv=None):
    """Returns the exit status (0, or 1 after printing one line to stderr)."""
    args = parse_args(argv)
    try:
        tensors, parameters = consolidate(args.checkpoint_dir, args.output_file, args.tag)
    except cli.UserError as error:     # ConversionError, or a CheckpointError met while reading the tensors
        print(f"error: {_one_line(error)}", file=sys.stderr, flush=True)
        return 1
    print(f"wrote {tensors} fp32 tensors ({parameters:,} parameters) to {args.output_file}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
