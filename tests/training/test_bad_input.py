"""Bad input to every entry point is one line and a non-zero exit, never a traceback (issue 23, item 4).

Flags are checked in-process through the same parsers the entry points use (megatron.arguments for pretrain_gpt.py,
generation and tasks/main.py; each tool's own parser), and generation's sampling options through the function the
tool calls; one subprocess per entry point then shows the command line itself prints the one line and exits
non-zero (bad input found after start-up goes through megatron.initialize.run_main)."""
import os
import subprocess
import sys

import pytest

from megatron.text_generation.generation import check_sampling_options
from tests.helpers import parser_error, REPO, TINY_SHAPE, write_config
from tests import warm_python

sys.path.insert(0, os.path.join(REPO, "tools"))

TINY = TINY_SHAPE + ["--mock-data"]


@pytest.mark.parametrize("flag,value,wanted", [
    ("--seq-length", "0", "a positive number"), ("--seq-length", "-5", "a positive number"),
    ("--num-layers", "0", "a positive number"), ("--hidden-size", "0", "a positive number"),
    ("--num-attention-heads", "-4", "a positive number"), ("--batch-size", "0", "a positive number"),
    ("--global-batch-size", "-8", "a positive number"), ("--max-position-embeddings", "0", "a positive number"),
    ("--log-interval", "0", "a positive number"), ("--save-interval", "0", "a positive number"),
    ("--eval-interval", "-1", "a positive number"), ("--vocab-size", "0", "a positive number"),
    ("--make-vocab-size-divisible-by", "0", "a positive number"), ("--lr-decay-iters", "0", "a positive number"),
    ("--train-iters", "-1", "zero or a positive number"), ("--eval-iters", "-2", "zero or a positive number"),
    ("--clip-grad", "-1.0", "zero or a positive number"),
    # the optimizer's numbers (issue 67: they trained silently, or died in a traceback when the optimizer was built)
    ("--lr", "-0.1", "a positive number"), ("--lr", "0.0", "a positive number"), ("--lr", "nan", "a positive number"),
    ("--muon-lr", "-1.0", "a positive number"), ("--muon-lr", "0.0", "a positive number"),
    ("--min-lr", "-0.5", "zero or a positive number"), ("--weight-decay", "-0.1", "zero or a positive number"),
    ("--adam-eps", "0.0", "a positive number"), ("--adam-eps", "-0.5", "a positive number"),
    ("--adam-beta1", "1.0", "a number in [0, 1)"), ("--adam-beta1", "-0.1", "a number in [0, 1)"),
    ("--adam-beta2", "1.0", "a number in [0, 1)"), ("--adam-beta2", "1.5", "a number in [0, 1)"),
    ("--muon-momentum", "1.0", "a number in [0, 1)"), ("--muon-momentum", "-0.5", "a number in [0, 1)"),
])
def test_megatron_flags_out_of_range_are_one_line(flag, value, wanted, capsys):
    from megatron.arguments import parse_args
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + [flag, value], capsys)
    assert line.split(": error: ", 1)[1] == f"{flag} is {value}: it must be {wanted} (see --help)"


def test_the_edges_of_the_optimizer_ranges_are_accepted():
    from megatron.arguments import parse_args
    edges = ["--adam-beta1", "0", "--adam-beta2", "0.9999", "--muon-momentum", "0", "--weight-decay", "0",
             "--min-lr", "0", "--lr", "1e-9", "--muon-lr", "1e-9", "--adam-eps", "1e-30"]
    args = parse_args(args_list=TINY + edges)
    assert (args.adam_beta1, args.adam_beta2, args.muon_momentum, args.weight_decay, args.min_lr, args.lr,
            args.muon_lr, args.adam_eps) == (0.0, 0.9999, 0.0, 0.0, 0.0, 1e-9, 1e-9, 1e-30)


@pytest.mark.parametrize("optimizer,message", [
    ({"type": "AdamW", "params": {"lr": 0.0}}, "optimizer.params.lr is 0.0 in {}: it must be a positive number (it "
                                               "sets --lr)"),
    ({"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.0}}, "optimizer.params.adam_lr is 0.0 in {}: it must be a "
                                                               "positive number (it sets --lr)"),
    ({"type": "Muon", "params": {"muon_lr": 0.0}}, "optimizer.params.muon_lr is 0.0 in {}: it must be a positive "
                                                   "number (it sets --muon-lr)"),
    ({"type": "Muon", "params": {"adam_lr": -0.001}}, "--deepspeed_config: optimizer.params.adam_lr is -0.001: it "
                                                      "must be zero or a positive number"),
    ({"type": "Muon", "params": {"momentum": 1.0}}, "--deepspeed_config: optimizer.params.momentum is 1.0: it must "
                                                    "be a number in [0, 1)"),
])
def test_json_optimizer_numbers_are_one_line(tmp_path, capsys, optimizer, message):
    """Under --deepspeed the JSON's lr, adam_lr and muon_lr set --lr and --muon-lr after their check ran: a rate of 0
    (which the engine's config allows, as torch does) is held to the flags' range and named by its key; a negative
    rate or a momentum outside [0, 1) the config refuses itself."""
    from megatron.arguments import parse_args
    config = write_config(str(tmp_path), optimizer=optimizer)
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + ["--deepspeed", "--deepspeed_config", config],
                        capsys)
    assert line.split(": error: ", 1)[1] == message.format(config) + " (see --help)"


@pytest.mark.parametrize("flags", [["--reset-attention-mask"], ["--eod-mask-loss", "--reset-position-ids"]])
def test_mock_data_with_document_resets_is_one_line(flags, capsys):
    """--mock-data has no tokenizer, so no end-of-document id: the reset/mask flags that need one are refused by
    name before anything is built (they were an AttributeError traceback in the first batch)."""
    from megatron.arguments import parse_args
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + flags, capsys)
    assert line.split(": error: ", 1)[1].startswith(f"{' and '.join(sorted(flags, key=ORDER.index))} need the "
                                                    "tokenizer's end-of-document id, which --mock-data has not")


ORDER = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]


def test_real_data_without_the_vocabulary_files_is_one_line():
    """--train-data webtext without --vocab-file/--merge-file: one line naming both and the default data's files,
    exit status 1 (it was a ValueError traceback from the tokenizer)."""
    done = warm_python.run([sys.executable, "pretrain_gpt.py", "--train-data", "webtext", "--merge-file",
                            "data/webtext/merges.txt"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: GPT2BPETokenizer needs --vocab-file and --merge-file; --vocab-file not given (the default data's: "
        "data/webtext/vocab.json and data/webtext/merges.txt)")


@pytest.mark.parametrize("cuda,backend,wanted", [(True, "gloo", "nccl"), (False, "nccl", "gloo")])
def test_a_backend_that_does_not_fit_the_device_is_one_line(cuda, backend, wanted, capsys, monkeypatch):
    """gloo on a (mocked) CUDA machine, nccl on one without CUDA: refused naming the fix; the fitting one and the
    default are accepted."""
    import torch
    from megatron.arguments import parse_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    line = parser_error(lambda argv: parse_args(args_list=argv), TINY + ["--distributed-backend", backend], capsys)
    where = "a CUDA machine (tensors on cuda)" if cuda else "a machine without CUDA (tensors on cpu)"
    assert line.split(": error: ", 1)[1] == (f"--distributed-backend {backend} on {where}: pass --distributed-backend "
                                             f"{wanted} or drop the flag (its default) (see --help)")
    assert parse_args(args_list=TINY + ["--distributed-backend", wanted]).distributed_backend == wanted
    assert parse_args(args_list=TINY).distributed_backend is None          # initialize picks mpu.get_backend()


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=-4), "--out-seq-length (max_new_tokens) is -4: give the number of new tokens, at least 1"),
    (dict(max_new_tokens=0), "--out-seq-length (max_new_tokens) is 0: give the number of new tokens, at least 1"),
    (dict(top_p=1.5), "--top_p is 1.5: give a probability mass in (0, 1], e.g. 0.9 (0 turns it off)"),
    (dict(top_p=-0.5), "--top_p is -0.5: give a probability mass in (0, 1], e.g. 0.9 (0 turns it off)"),
    (dict(top_k=-3), "--top_k is -3: give 0 (off) or the number of most likely tokens to sample from"),
    (dict(temperature=0.0), "--temperature is 0.0: it must be positive (or pass --greedy for argmax)"),
    (dict(temperature=-1.0), "--temperature is -1.0: it must be positive (or pass --greedy for argmax)"),
])
def test_bad_sampling_options_are_refused(kwargs, message):
    options = dict(dict(max_new_tokens=8, greedy=False, temperature=1.0, top_k=0, top_p=0.0), **kwargs)
    with pytest.raises(ValueError) as info:
        check_sampling_options(**options)
    assert str(info.value) == message


def test_the_edges_of_the_sampling_ranges_are_accepted():
    for options in (dict(top_p=1.0), dict(top_p=0.0), dict(top_k=0), dict(greedy=True, temperature=0.0),
                    dict(max_new_tokens=1)):
        check_sampling_options(**dict(dict(max_new_tokens=8), **options))


def test_tool_flags_and_missing_files_are_one_line(tmp_path, capsys, webtext_data):
    import estimate_memory
    import preprocess_data
    import train_tokenizer
    corpus = tmp_path / "corpus.json"
    corpus.write_text('{"text": "hello"}\n')
    vocab = os.path.join(REPO, "data", "webtext", "vocab.json")
    merges = os.path.join(REPO, "data", "webtext", "merges.txt")
    preprocess = ["--output-prefix", str(tmp_path / "out"), "--vocab-file", vocab, "--merge-file", merges,
                  "--tokenizer-type", "GPT2BPETokenizer"]
    cases = [
        (preprocess_data.main, ["--input", str(tmp_path / "missing.json")] + preprocess,
         f"preprocess_data.py: error: --input {tmp_path / 'missing.json'}: file not found (see --help)"),
        (preprocess_data.main, ["--input", str(corpus), "--workers", "0"] + preprocess,
         "preprocess_data.py: error: --workers is 0: it must be a positive number (see --help)"),
        (train_tokenizer.main, ["--input", str(tmp_path / "missing.json"), "--output-dir", str(tmp_path / "tok")],
         f"train_tokenizer.py: error: --input {tmp_path / 'missing.json'}: file not found (see --help)"),
        (train_tokenizer.main, ["--input", str(corpus), "--output-dir", str(tmp_path / "tok"), "--vocab-size", "0"],
         "train_tokenizer.py: error: --vocab-size is 0: it must be a positive number (see --help)"),
        (estimate_memory.main, ["--num-layers", "-2", "--hidden-size", "64", "--num-attention-heads", "4",
                                "--seq-length", "16", "--vocab-size", "100"],
         "estimate_memory.py: error: --num-layers is -2: it must be a positive number (see --help)"),
    ]
    for main, argv, expected in cases:
        prog = sys.argv[0]
        sys.argv[0] = main.__module__ + ".py"      # argparse names the program after sys.argv[0]
        try:
            assert parser_error(main, argv, capsys) == expected
        finally:
            sys.argv[0] = prog
    assert not (tmp_path / "tok").exists() and not list(tmp_path.glob("out*"))


def test_entry_points_print_one_line_and_exit_non_zero(tmp_path, webtext_data):
    """The command lines themselves, started together (about 4 s of imports each)."""
    (tmp_path / "wiki.txt").write_text("some text\n")
    webtext = os.path.join(REPO, "data", "webtext")
    vocab = ["--vocab-file", os.path.join(webtext, "vocab.json"), "--merge-file", os.path.join(webtext, "merges.txt")]
    commands = {
        "pretrain: missing data": (["pretrain_gpt.py", *TINY[:-1], "--data-path", str(tmp_path / "nope"), *vocab],
                                   f"error: --data-path {tmp_path / 'nope'}: missing {tmp_path / 'nope'}.idx, "
                                   f"{tmp_path / 'nope'}.bin (run tools/preprocess_data.py; it writes "
                                   "PREFIX_text_document.{bin,idx}, and --data-path takes PREFIX_text_document)"),
        "pretrain: missing vocab": (["pretrain_gpt.py", *TINY[:-1], "--data-path",
                                     os.path.join(webtext, "webtext_text_document"), "--vocab-file",
                                     str(tmp_path / "v.json"), "--merge-file", vocab[3]],
                                    f"error: tokenizer file not found: '{tmp_path / 'v.json'}'"),
        "pretrain: zero length": (["pretrain_gpt.py", *TINY, "--seq-length", "0"],
                                  "pretrain_gpt.py: error: --seq-length is 0: it must be a positive number (see --help)"),
        "generate: top_k": (["tools/generate_samples_gpt.py", *TINY, "--load", str(tmp_path), "--top_k", "-3"],
                            "error: --top_k is -3: give 0 (off) or the number of most likely tokens to sample from"),
        "tasks: stride": (["tasks/main.py", "--task", "WIKITEXT103", *TINY, "--load", str(tmp_path), "--valid-data",
                           str(tmp_path / "wiki.txt"), "--overlapping-eval", "0"],
                          "error: --overlapping-eval is 0: give the window stride, from 1 to --seq-length (16)"),
    }
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "RANK", "WORLD_SIZE")}
    running = {}
    for name, (argv, _) in commands.items():
        from megatron.spawn import free_port
        running[name] = warm_python.Popen([sys.executable, *argv], cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True,
                                          env=dict(env, MASTER_PORT=str(free_port())))
    for name, process in running.items():
        _, stderr = process.communicate(timeout=300)
        lines = [line for line in stderr.strip().splitlines() if not line.startswith("W1")]
        assert process.returncode in (1, 2) and lines == [commands[name][1]], (name, process.returncode, stderr[-2000:])
