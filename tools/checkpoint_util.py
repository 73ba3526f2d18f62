"""Resize a checkpoint offline: write it at another tensor-parallel size and/or in the other path's layout
(Megatron-LM's tool name and flags). Training does not need this: --load reshards any checkpoint at load time with
the same code (megatron.checkpoint.reshard). Use it for files at the new size, e.g. to ship a model.

    python tools/checkpoint_util.py --load-dir CKPT --save-dir CKPT_MP4 --target-tensor-parallel-size 4
    python tools/checkpoint_util.py --load-dir CKPT --save-dir CKPT_ZERO --target-path zero

What is written: the weights (vocabulary re-padded for the target size), the iteration, consumed samples and lr
scheduler; for the ZeRO layout (--target-path zero) also the fp32 master weights, Adam moments and loss scaler, as
a data-parallel-1 checkpoint that loads at any data-parallel size. The Megatron layout carries no optimizer state
(as Megatron-LM's tool): resume from it with --no-load-optim, or load the original checkpoint directly. Bad input:
one line, exit status 1.
"""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron import cli  # noqa: E402
from megatron.checkpoint.layout import CheckpointError  # noqa: E402


def resize(load_dir, save_dir, target_tensor_parallel_size, target_path=None, make_vocab_size_divisible_by=128,
           progress=None):
    """Returns (source description, directory written). `progress`: a cli.ProgressLine counting the tensors
    written (main's prints a line on stderr at most once a second)."""
    from megatron.checkpoint.full_checkpoint import resize_checkpoint
    from megatron.checkpoint.reshard import SavedCheckpoint
    if os.path.abspath(load_dir) == os.path.abspath(save_dir):
        raise CheckpointError(f"--save-dir {save_dir} is the --load-dir: write the resized copy elsewhere")
    saved = SavedCheckpoint(load_dir)
    heads = saved.model_shape.get("num_attention_heads")
    if heads is not None and heads % target_tensor_parallel_size:
        raise CheckpointError(f"--target-tensor-parallel-size {target_tensor_parallel_size} does not divide the "
                              f"model's {heads} attention heads")
    deepspeed = (target_path or saved.path) == "zero"
    written = resize_checkpoint(saved, save_dir, target_tensor_parallel_size, deepspeed, make_vocab_size_divisible_by,
                                progress)
    return saved.describe(), written


def main(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-dir", required=True, help="a training run's --save directory (either path)")
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--target-tensor-parallel-size", "--target-model-parallel-size", type=int, required=True)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1, choices=[1],
                        help="pipeline parallelism is not built yet: 1")
    parser.add_argument("--target-path", choices=["megatron", "zero"], default=None,
                        help="layout to write (default: the source's)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="as the training run that will load it uses")
    parser.add_argument("--model-type", default="GPT", choices=["GPT"])
    parser.add_argument("--loader", default="megatron", choices=["megatron"])
    parser.add_argument("--saver", default="megatron", choices=["megatron"])
    args = parser.parse_args(argv)
    if args.target_tensor_parallel_size < 1:
        parser.error("--target-tensor-parallel-size must be at least 1")
    try:
        source, written = resize(args.load_dir, args.save_dir, args.target_tensor_parallel_size, args.target_path,
                                 args.make_vocab_size_divisible_by, cli.ProgressLine("Wrote", "tensors"))
    except (CheckpointError, OSError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    target = "zero" if (args.target_path or ("zero" if "zero" in source else "megatron")) == "zero" else "megatron"
    print(f"resized checkpoint saved at {source} to mp{args.target_tensor_parallel_size} ({target}): {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
