"""--torch-compile / --no-torch-compile, and the default between them.

Default: the fused compute path (mpu/fused.py, each layer's pure-compute pieces compiled per layer between the
tensor-parallel collectives) is on where the run is on CUDA with triton installed (one H200, GPT-2 124M: +20%
tokens/s and -41% memory, docs/gpu.md) and its layers can be compiled; eager otherwise, with one line saying why. On
the CPU eager stays the default: inductor's C++ compile outweighs what a short CPU run gains (50 steps of L4 h128
on 2 cores from a cold cache: 13.4 s eager, 43.8 s compiled) and needs g++. The default is for pretrain_gpt.py; post-training, evaluation and generation stay eager
unless asked (their batches vary in length). `--torch-compile` asks for it anywhere (an option whose layers run eagerly is then refused in
one line); `--no-torch-compile` turns it off.
"""
import importlib.util
import os
import shutil

import mpu


def eager_only_options(args):
    """The options given whose layers the fused path cannot run, each as '<flag> <why>' (empty: it can run all)."""
    options = [(args.sequence_parallel, "--sequence-parallel runs the eager layers (its linears gather the sequence "
                                        "and keep only this rank's slice for backward; compiled pieces would keep "
                                        "the gathered input)"),
               (args.context_parallel_size > 1, "--context-parallel-size runs the eager layers (ring attention)"),
               (bool(args.lora_rank), "--lora-rank runs the eager layers (the adapters wrap the linears the compiled "
                                   "pieces read as plain weights)"),
               (args.recompute_granularity == "selective",
                "--recompute-granularity selective recomputes the eager attention core"),
               (bool(getattr(args, "num_experts", None)), "--num-experts runs the eager layers (the compiled layers "
                                                          "are dense ones)")]
    return [why for given, why in options if given]


def _toolchain_missing():
    """Why inductor cannot compile here (None: it can): triton on CUDA, a C++ compiler (CXX, default g++) on the
    CPU."""
    if mpu.get_backend() == "nccl":
        if importlib.util.find_spec("triton") is None:
            return "--torch-compile on CUDA needs triton (pip install the triton your torch build names)"
        return None
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        return (f"--torch-compile on the CPU needs a C++ compiler for inductor: {compiler!r} (the CXX variable, "
                "default g++) is not on PATH; install g++ (apt install g++), set CXX")
    return None


def resolve_torch_compile(args, parser, pretraining=True):
    """Set args.torch_compile to True or False and args.torch_compile_choice to the one line the run prints.
    pretraining: pretrain_gpt.py, whose batches have one shape; the other entry points (post-training, evaluation,
    generation) default to eager: their batches vary in length, and the compiled pieces are built per shape."""
    eager_only = eager_only_options(args)
    if args.torch_compile:
        if eager_only:
            parser.error(f"{eager_only[0]}: drop --torch-compile")
        missing = _toolchain_missing()
        if missing:
            parser.error(f"{missing}, or drop --torch-compile")
        args.torch_compile_choice = "fused compute path: on (--torch-compile)"
        return
    if args.torch_compile is False:
        args.torch_compile_choice = "fused compute path: off (--no-torch-compile)"
        return
    if mpu.get_backend() != "nccl":
        why = "eager on the CPU (compiling takes longer than a short run gains; --torch-compile turns it on)"
    elif not pretraining:
        why = "eager for this entry point (its batches vary in length: a compile per shape; --torch-compile turns it on)"
    elif eager_only:
        why = f"eager: {eager_only[0]}"
    else:
        why = _toolchain_missing()
    args.torch_compile = why is None
    args.torch_compile_choice = "fused compute path: on (the default on CUDA; --no-torch-compile turns it off)" \
        if why is None else f"fused compute path: off, {why}"
