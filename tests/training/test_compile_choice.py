"""--torch-compile's default (megatron/flags/compile_choice.py, issue 54 item 3): on for pretrain_gpt.py on CUDA
(mocked here: torch.cuda.is_available and triton's presence) where every layer can be compiled, eager with one line
saying why otherwise; eager on the CPU; --torch-compile with an option whose layers run eagerly is refused in one
line, --no-torch-compile is off everywhere. The fused path's numbers are tests/model/test_fused_compute.py's."""
import importlib.util

import pytest
import torch

from megatron.arguments import parse_args
from megatron.flags import compile_choice
from tests.helpers import parser_error, TINY_SHAPE

TINY = TINY_SHAPE + ["--mock-data"]
# each option whose layers the fused path cannot run: (flags, WORLD_SIZE, the start of the reason)
EAGER_ONLY = [
    (["--model-parallel-size", "2", "--sequence-parallel"], 2, "--sequence-parallel runs the eager layers"),
    (["--context-parallel-size", "2", "--attention-dropout", "0"], 2, "--context-parallel-size runs the eager layers"),
    (["--lora-rank", "4"], 1, "--lora-rank runs the eager layers"),
    (["--recompute-granularity", "selective"], 1, "--recompute-granularity selective recomputes the eager attention"),
    (["--num-experts", "2"], 1, "--num-experts runs the eager layers"),
]
IDS = [flags[-1].lstrip("-") if not flags[-1].isdigit() else flags[-2].lstrip("-") for flags, _, _ in EAGER_ONLY]


@pytest.fixture
def cuda_with_triton(monkeypatch):
    """A CUDA machine with triton installed, as far as the flag checks can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(compile_choice.importlib.util, "find_spec",
                        lambda name, *rest: object() if name == "triton" else find_spec(name, *rest))


def test_cpu_default_is_eager_and_the_flags_choose():
    args = parse_args(args_list=TINY)
    assert args.torch_compile is False
    assert args.torch_compile_choice.startswith("fused compute path: off, eager on the CPU")
    assert parse_args(args_list=TINY + ["--torch-compile"]).torch_compile is True
    assert parse_args(args_list=TINY + ["--no-torch-compile"]).torch_compile is False


def test_cuda_default_compiles_pretraining_only(cuda_with_triton):
    args = parse_args(args_list=TINY)
    assert args.torch_compile is True and "on (the default on CUDA" in args.torch_compile_choice
    assert parse_args(args_list=TINY + ["--no-torch-compile"]).torch_compile is False
    # an entry point with its own flags (post-training, evaluation, generation): eager unless asked
    post = parse_args(extra_args_provider=lambda parser: parser, args_list=TINY)
    assert post.torch_compile is False and "batches vary in length" in post.torch_compile_choice
    assert parse_args(extra_args_provider=lambda parser: parser, args_list=TINY + ["--torch-compile"]).torch_compile


def test_cuda_without_triton_stays_eager_unless_asked(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(compile_choice.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "triton" else find_spec(name, *rest))
    args = parse_args(args_list=TINY)
    assert args.torch_compile is False and "needs triton" in args.torch_compile_choice
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + ["--torch-compile"], capsys)
    assert "--torch-compile on CUDA needs triton" in line and line.endswith("or drop --torch-compile (see --help)")


@pytest.mark.parametrize("flags,world,reason", EAGER_ONLY, ids=IDS)
def test_an_option_whose_layers_run_eagerly(flags, world, reason, cuda_with_triton, monkeypatch, capsys):
    """By default: eager, the choice line naming the option; with --torch-compile: one line, exit 2."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = parse_args(args_list=TINY + flags)
    assert args.torch_compile is False
    assert args.torch_compile_choice.startswith(f"fused compute path: off, eager: {reason}"), args.torch_compile_choice
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + flags + ["--torch-compile"], capsys)
    assert line.split(": error: ", 1)[1].startswith(reason) and line.endswith(": drop --torch-compile (see --help)")


def test_the_llama_options_compile(cuda_with_triton):
    """The fused pieces run grouped-query attention, rotary embeddings, SwiGLU, RMSNorm and no biases (their numbers:
    tests/model/test_fused_compute.py): the default compiles them on CUDA and --torch-compile is accepted."""
    llama = ["--swiglu", "--normalization", "rmsnorm", "--num-key-value-heads", "2", "--ffn-hidden-size", "48",
             "--disable-bias-linear", "--use-rotary-position-embeddings", "--no-position-embedding",
             "--untie-embeddings-and-output-weights"]
    assert parse_args(args_list=TINY + llama).torch_compile is True
    assert parse_args(args_list=TINY + llama + ["--torch-compile"]).torch_compile is True
