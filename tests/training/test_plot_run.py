"""Seeing a run (issue 29): the --log-jsonl header and validation records, tools/plot_run.py's figure and page read
back against the logged values, runs overlaid, one-line errors; the progress lines of the long tools (one
rate-limited printer, megatron.cli.ProgressLine) driven by a fake clock."""
import contextlib
import copy
import functools
import io
import json
import math
import os
import re
import struct
import subprocess
import sys

import pytest

from megatron import cli
from megatron.spawn import run_distributed
from tests.helpers import NO_DROPOUT, REPO, TINY, build_small_corpus, write_jsonl  # also puts tools/ on sys.path

import plot_run  # noqa: E402  (tools/)

ITERS, LOG_INTERVAL, EVAL_INTERVAL, EVAL_ITERS = 6, 2, 3, 2


def _train_logged(args_list):
    """(history, what this rank printed, its arguments that are plain values)."""
    import pretrain_gpt
    from megatron.global_vars import get_args
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        history = pretrain_gpt.main(args_list)
    plain = {k: v for k, v in vars(get_args()).items() if v is None or isinstance(v, (bool, int, float, str))}
    return history, buffer.getvalue(), plain


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A short real run: 2 processes (dp 2), ZeRO-2 (--deepspeed), evaluation every 3 iterations, --log-jsonl."""
    from tests.helpers import write_config
    directory = tmp_path_factory.mktemp("run")
    path = str(directory / "log.jsonl")
    flags = TINY + NO_DROPOUT + [
        "--train-iters", str(ITERS), "--log-interval", str(LOG_INTERVAL), "--eval-interval", str(EVAL_INTERVAL),
        "--eval-iters", str(EVAL_ITERS), "--deepspeed", "--deepspeed_config", write_config(str(directory)),
        "--log-jsonl", path]
    history, stdout, args = run_distributed(_train_logged, 2, args=(flags,))[0]
    with open(path) as handle:
        records = [json.loads(line) for line in handle]
    return {"path": path, "records": records, "history": history, "stdout": stdout, "args": args}


def _of(records, kind):
    return [r for r in records if r["type"] == kind]


# ---- the records the training writes ------------------------------------------------------------------------------
def test_header_record_holds_the_run_arguments_and_layout(logged_run):
    records, args = logged_run["records"], logged_run["args"]
    assert records[0]["type"] == "header" and len(_of(records, "header")) == 1   # written once, first
    header = records[0]
    assert header["iteration"] == 0
    assert header["layout"] == {"world_size": 2, "model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                "data_parallel_size": 2, "zero_stage": 2, "precision": "fp32"}
    for key, value in args.items():          # every plain argument, as the run saw it
        expected = value if not isinstance(value, float) or math.isfinite(value) else None
        assert header["args"][key] == expected, key
    assert header["args"]["lr"] == 1e-3 and header["args"]["eval_interval"] == EVAL_INTERVAL
    assert header["args"]["log_jsonl"] == logged_run["path"]
    zero = header["args"]["zero_config"]["zero_optimization"]              # the parsed ZeRO config, as data
    assert zero["stage"] == 2 and zero["reduce_bucket_size"] == 5000
    json.dumps(header, allow_nan=False)


def test_only_losses_have_a_perplexity():
    """A reward model's and DPO's validation also averages an accuracy, scores and rewards: exp of those is no
    perplexity, so neither the record nor the printed line gives one (the line printed 'accuracy PPL' once)."""
    from megatron.guards import operations
    losses = {"lm loss": 2.0, "accuracy": 0.5, "chosen score": -1.0, "rewards/margins": 0.25}
    record = operations.validation_record("valid", "iteration 1", 1, losses)
    assert record["ppl"] == {"lm loss": math.exp(2.0)} and record["losses"] == losses


def test_validation_records_are_the_printed_validation_lines(logged_run):
    records, history = logged_run["records"], logged_run["history"]
    printed = re.findall(r" validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+)",
                         logged_run["stdout"])
    validation = _of(records, "validation")
    assert [(r["at"], f"{r['losses']['lm loss']:.6E}", f"{r['ppl']['lm loss']:.6E}") for r in validation] == printed
    assert [r["at"] for r in validation] == ["iteration 3", "iteration 6", "the end of training",
                                             "the end of training for test data"]
    assert [r["iteration"] for r in validation] == [3, 6, 6, 6]
    assert [r["split"] for r in validation] == ["valid", "valid", "valid", "test"]
    returned = history["valid"] + [history["final_valid"], history["final_test"]]
    assert [r["losses"] for r in validation] == returned                   # the same floats the loop returned
    for record in validation:
        assert record["ppl"]["lm loss"] == math.exp(record["losses"]["lm loss"])
    train = _of(records, "train")            # training records keep their keys (tests/training/test_metrics.py), typed
    assert [r["iteration"] for r in train] == list(range(LOG_INTERVAL, ITERS + 1, LOG_INTERVAL))
    assert [r["type"] for r in records] == ["header", "train", "validation", "train", "train", "validation",
                                            "validation", "validation"]


# ---- the figure ---------------------------------------------------------------------------------------------------
def _expected_points(records):
    """{panel title: [(label suffix, [(x, y), ...])]} straight from the JSONL records (what each panel must show)."""
    train = _of(records, "train")
    valid = [r for r in _of(records, "validation") if r["split"] == "valid"]

    def of(rows, get):
        return [(r["iteration"], get(r)) for r in rows]
    return {"training loss": [("", of(train, lambda r: r["losses"]["lm loss"])),
                              (" validation", of(valid, lambda r: r["losses"]["lm loss"]))],
            "validation perplexity": [("", of(valid, lambda r: r["ppl"]["lm loss"]))],
            "learning rate": [("", of(train, lambda r: r["learning_rate"]))],
            "loss scale": [("", of(train, lambda r: r["loss_scale"]))],
            "skipped steps": [("", of(train, lambda r: r["skipped_iterations"]))],
            "gradient norm": [("", of(train, lambda r: r["grad_norm"]))],
            "tokens/s": [("", of(train, lambda r: r["tokens_per_second"]))],
            "TFLOP/s per rank": [("", of(train, lambda r: r["tflops_per_rank"]))],
            "memory": [("", of(train, lambda r: r["memory"]["bytes"] / 2 ** 30))]}


def _line_points(line):
    return list(zip(map(int, line.get_xdata()), map(float, line.get_ydata())))


def test_figure_panels_hold_the_logged_values(logged_run, tmp_path, capsys):
    run = plot_run.read_run(logged_run["path"], "log.jsonl")
    figure = plot_run.build_figure([run])
    expected = _expected_points(logged_run["records"])
    assert [ax.get_title() for ax in figure.axes] == list(expected)        # every panel, in order
    for ax in figure.axes:
        want = expected[ax.get_title()]
        assert [line.get_label() for line in ax.get_lines()] == ["log.jsonl" + suffix for suffix, _ in want]
        assert [_line_points(line) for line in ax.get_lines()] == [points for _, points in want], ax.get_title()
        assert ax.get_xlabel() == "iteration"
    assert len(expected["training loss"][1][1]) == 3                       # iteration 3, 6 and the end
    png = str(tmp_path / "run.png")
    assert plot_run.main([logged_run["path"], "--output", png]) == 0
    out = capsys.readouterr().out
    assert "omitted" not in out and out.strip() == f"wrote {png}: 9 panels, 1 run"
    with open(png, "rb") as handle:
        head = handle.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (3 * 500, 3 * 360)         # 3 x 3 panels of 5 x 3.6 in, 100 dpi


def _svg_path_points(svg, gid):
    """The vertices of the <path> (a line) or the <use> positions (markers) inside <g id="gid">."""
    group = re.search(rf'<g id="{re.escape(gid)}">(.*?)\n   </g>', svg, re.S).group(1)
    uses = re.findall(r'<use [^>]*x="([-\d.]+)" y="([-\d.]+)"', group)
    if uses:
        return [(float(x), float(y)) for x, y in uses]
    d = re.search(r'<path d="([^"]*)"', group).group(1)
    return [(float(x), float(y)) for x, y in re.findall(r"[ML] ([-\d.]+) ([-\d.]+)", d)]


def _affine(drawn, values):
    """The drawn coordinates are one affine map of the values (what a linear axis does), to 1e-4 of the span."""
    if len(set(values)) < 2:
        return len(set(drawn)) == 1
    (v0, d0), (v1, d1) = min(zip(values, drawn)), max(zip(values, drawn))
    scale = (d1 - d0) / (v1 - v0)
    return all(abs(d0 + (v - v0) * scale - d) <= 1e-4 * abs(d1 - d0) + 2e-6 for v, d in zip(values, drawn))


def test_html_page_holds_every_panel_and_the_settings(logged_run, tmp_path):
    page = str(tmp_path / "run.html")
    assert plot_run.main([logged_run["path"], "--html", page]) == 0
    with open(page, encoding="utf-8") as handle:
        text = handle.read()
    expected = _expected_points(logged_run["records"])
    figures = re.findall(r"<figure><figcaption>(.*?)</figcaption>\n(<svg.*?</svg>)", text, re.S)
    assert [title for title, _ in figures] == list(expected)
    assert text.count("<svg") == len(expected) == 9
    for (title, svg), panel in zip(figures, plot_run.PANELS):
        assert "<text" in svg and title in svg                              # the title as text
        for series_index, (_, points) in enumerate(expected[title]):
            drawn = _svg_path_points(svg, plot_run.line_id(panel, 0, series_index))
            assert len(drawn) == len(points), title
            assert _affine([x for x, _ in drawn], [x for x, _ in points]), title
            if not panel.log_scale:
                assert _affine([y for _, y in drawn], [y for _, y in points]), title
    assert "<script" not in text and not re.search(r'(src|href)="(?!#)', text)   # nothing fetched
    for setting, value in (("layout: zero_stage", "2"), ("layout: data_parallel_size", "2"), ("lr", "0.001"),
                           ("train_iters", str(ITERS)), ("layout: precision", "fp32")):
        assert f"<tr><td>{setting}</td><td>{value}</td></tr>" in text, setting


def _rewrite(records, path, change):
    with open(path, "w") as handle:
        for record in records:
            record = change(copy.deepcopy(record))
            if record is not None:
                handle.write(json.dumps(record) + "\n")
    return str(path)


def _older_log(record):
    """A log from before the header: no header, no validation, training records without 'type' or 'memory',
    the loss halved."""
    if record["type"] != "train":
        return None
    del record["type"], record["memory"]
    record["losses"]["lm loss"] /= 2
    return record


def test_two_runs_overlay_with_labels_and_a_field_missing_in_one(logged_run, tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = _rewrite(logged_run["records"], tmp_path / "one" / "log.jsonl", lambda r: r)
    second = _rewrite(logged_run["records"], tmp_path / "two" / "log.jsonl", _older_log)
    labels = plot_run.default_labels([first, second])
    assert labels == ["one/log.jsonl", "two/log.jsonl"]
    runs = [plot_run.read_run(p, label) for p, label in zip((first, second), labels)]
    figure = plot_run.build_figure(runs)
    panels = {ax.get_title(): ax for ax in figure.axes}
    loss = panels["training loss"]
    assert [line.get_label() for line in loss.get_lines()] == ["one/log.jsonl", "one/log.jsonl validation",
                                                              "two/log.jsonl"]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [line.get_label() for line in loss.get_lines()]
    expected = _expected_points(logged_run["records"])["training loss"][0][1]
    assert _line_points(loss.get_lines()[2]) == [(x, y / 2) for x, y in expected]
    assert loss.get_lines()[0].get_color() != loss.get_lines()[2].get_color()
    assert [line.get_label() for line in panels["memory"].get_lines()] == ["one/log.jsonl"]   # left to run one
    assert len(panels["learning rate"].get_lines()) == 2
    page = str(tmp_path / "runs.html")
    assert plot_run.main([first, second, "--labels", "fp32", "bf16", "--html", page]) == 0
    with open(page, encoding="utf-8") as handle:
        text = handle.read()
    assert "<th>fp32</th><th>bf16</th>" in text and ">fp32 validation<" in text and ">bf16<" in text
    assert '<tr class="differs"><td>first record: train_iters</td><td></td><td>6</td></tr>' in text  # no header
    assert '<tr class="differs"><td>layout: zero_stage</td><td>2</td><td></td></tr>' in text


def test_a_panel_no_run_has_is_omitted_in_one_line(logged_run, tmp_path, capsys):
    def loss_and_lr_only(record):
        return None if record["type"] != "train" else {"iteration": record["iteration"],
                                                       "losses": record["losses"],
                                                       "learning_rate": record["learning_rate"]}
    path = _rewrite(logged_run["records"], tmp_path / "bare.jsonl", loss_and_lr_only)
    assert plot_run.main([path, "--output", str(tmp_path / "bare.png")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("omitted panels (no run logs them): validation perplexity, loss scale, skipped steps, "
                      "gradient norm, tokens/s, TFLOP/s per rank, memory")
    assert out[1].endswith(": 2 panels, 1 run")
    figure = plot_run.build_figure([plot_run.read_run(path, "bare")])
    assert [ax.get_title() for ax in figure.axes] == ["training loss", "learning rate"]


def test_downstream_records_get_a_panel_per_task_and_metric(logged_run, tmp_path):
    """--eval-tasks records (megatron/trainer/downstream_eval.py's): one panel per task and metric after the
    others, the stderrs not drawn, each task's values at its iterations; a replayed (iteration, task): the last."""
    def downstream(iteration, task, **metrics):
        return {"type": "downstream", "iteration": iteration, "task": task, "metrics": metrics, "seconds": 1.0}
    extra = [downstream(3, "mc", acc=0.25, acc_stderr=0.1, acc_norm=0.5), downstream(3, "ppl", word_perplexity=90.0),
             downstream(6, "mc", acc=0.75, acc_stderr=0.1, acc_norm=0.5), downstream(6, "ppl", word_perplexity=70.0),
             downstream(6, "mc", acc=0.5, acc_stderr=0.1, acc_norm=0.25), downstream(6, "arc", acc=0.125)]
    path = _rewrite(logged_run["records"] + extra, tmp_path / "tasks.jsonl", lambda r: r)
    axes = plot_run.build_figure([plot_run.read_run(path, "tasks")]).axes
    assert [ax.get_title() for ax in axes] == list(_expected_points(logged_run["records"])) + [
        "mc acc", "mc acc_norm", "ppl word_perplexity", "arc acc"]
    assert [[_line_points(line) for line in ax.get_lines()] for ax in axes[-4:]] == [
        [[(3, 0.25), (6, 0.5)]], [[(3, 0.5), (6, 0.25)]], [[(3, 90.0), (6, 70.0)]], [[(6, 0.125)]]]


def test_a_resumed_log_plots_the_last_record_of_a_replayed_iteration(logged_run, tmp_path):
    """A run resumed from its iteration-4 checkpoint after logging iteration 6 appends a header and logs 6 again."""
    records = logged_run["records"] + [dict(logged_run["records"][0], iteration=4)]
    replayed = copy.deepcopy(_of(logged_run["records"], "train")[-1])
    replayed["losses"]["lm loss"] = 1.5
    path = _rewrite(records + [replayed], tmp_path / "resumed.jsonl", lambda r: r)
    run = plot_run.read_run(path, "resumed")
    assert run.resumed_at == [4] and run.header == logged_run["records"][0]
    loss = plot_run.build_figure([run]).axes[0].get_lines()[0]
    expected = _expected_points(logged_run["records"])["training loss"][0][1]
    assert _line_points(loss) == expected[:-1] + [(ITERS, 1.5)]
    assert "<tr><td>resumed at iteration</td><td>4</td></tr>" in plot_run.build_html([run])


BAD = {
    "empty": ("", "{path} is empty"),
    "not JSON": ('{"type": "train", "iteration": 2}\n{"iteration": 4, broken\n', "{path}:2: not JSON"),
    "not an object": ('[1, 2]\n', "{path}:1: not a JSON object"),
    "no iteration": ('{"type": "train", "losses": {"lm loss": 3.0}}\n',
                     "{path}:1: a train record without an integer 'iteration'"),
    "unknown type": ('{"type": "trian", "iteration": 1}\n', "{path}:1: unknown record type 'trian'"),
    "header only": ('{"type": "header", "iteration": 0, "args": {}, "layout": {}}\n',
                    "{path} has no training records (only header)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_log_is_one_line_naming_it(tmp_path, capsys, case):
    content, message = BAD[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert plot_run.main([str(path), "--output", str(tmp_path / "x.png")]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: " + message.format(path=path)), \
        captured.err
    assert not os.path.exists(tmp_path / "x.png")


def test_bad_command_lines_are_one_line(tmp_path, capsys, monkeypatch):
    good = tmp_path / "good.jsonl"
    good.write_text('{"iteration": 1, "losses": {"lm loss": 3.0}}\n')
    cases = [([str(tmp_path / "missing.jsonl"), "--output", "x.png"], 1, "does not exist"),
             ([str(good)], 2, "nothing to write: give --output FILE.png and/or --html FILE.html"),
             ([str(good), "--labels", "a", "b", "--output", "x.png"], 2, "--labels has 2 labels for 1 runs"),
             ([str(good), "--output", str(tmp_path / "no" / "x.png")], 1, "the directory"),
             ([str(good), "--output", str(tmp_path / "x.nosuchformat")], 1, "--output")]
    for argv, status, message in cases:
        with pytest.raises(SystemExit) if status == 2 else contextlib.nullcontext() as raised:
            returned = plot_run.main(argv)
        assert (raised.value.code if status == 2 else returned) == status, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err, (argv, err)
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)      # matplotlib not installed
    assert plot_run.main([str(good), "--output", "x.png"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install -r requirements.txt" in err, err


def test_the_scripts_plot_step_without_matplotlib_is_one_line(tmp_path):
    """plot_log (scripts/_common.sh), the last step of make pretrain and make finetune: matplotlib is a requirement,
    but a Python without it gets one line saying what to install and where the log is, and the script goes on."""
    hidden = tmp_path / "site" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    log = tmp_path / "log.jsonl"
    log.write_text('{"iteration": 1, "losses": {"lm loss": 3.0}}\n')
    env = dict(os.environ, PYTHON=sys.executable, DATA_ARGS="--mock-data", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(["bash", "-c", 'source scripts/_common.sh; plot_log "$0" "$1"; echo next', str(log),
                             str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    assert result.stdout.splitlines() == [f"plot: not written: matplotlib is missing from {sys.executable} "
                                          f"(pip install -r requirements.txt); the log is {log}", "next"]
    assert not (tmp_path / "run.png").exists() and not (tmp_path / "run.html").exists()


# ---- progress lines -----------------------------------------------------------------------------------------------
class FakeClock:
    """Each call returns the previous time + `step` seconds (the first call: 0)."""

    def __init__(self, step):
        self.step, self.calls = step, 0

    def __call__(self):
        self.calls += 1
        return (self.calls - 1) * self.step


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return build_small_corpus(str(tmp_path_factory.mktemp("corpus")), max_mb=0.05, vocab_size=300)


def test_preprocess_progress_at_most_once_a_second_and_a_summary(small, tmp_path, capsys, monkeypatch):
    import preprocess_data
    from megatron.tokenizer import GPT2BPETokenizer
    line_bytes, per_block, documents = 10_000, 2, 20
    texts = []
    for index in range(documents):      # each JSON line exactly line_bytes long (newline included)
        head = json.dumps({"text": f"document {index:02d} "})
        texts.append(f"document {index:02d} " + "x" * (line_bytes - len(head) - 1))
    corpus = write_jsonl(str(tmp_path / "c.json"), texts)
    assert os.path.getsize(corpus) == line_bytes * documents
    monkeypatch.setattr(preprocess_data, "read_blocks",   # 2 documents a block: 10 blocks
                        functools.partial(preprocess_data.read_blocks, block_bytes=line_bytes * per_block))
    clock = FakeClock(0.25)          # start 0 s, then 0.25 s later at each block, the summary after the last
    prefix = str(tmp_path / "out")
    preprocess_data.main(["--input", corpus, "--output-prefix", prefix, "--vocab-file", small["vocab"],
                          "--merge-file", small["merges"], "--tokenizer-type", "GPT2BPETokenizer", "--append-eod",
                          "--log-interval", "1"], clock=clock)
    err = capsys.readouterr().err.splitlines()
    expected = []
    for block in range(1, documents // per_block + 1):
        seconds = 0.25 * block
        if seconds in (1.0, 2.0):    # a line when a full second has passed since the start / the last line
            docs, done = block * per_block, block * per_block * line_bytes
            expected.append(f"Processed {docs} documents ({100 * done / (documents * line_bytes):.0f}%), "
                            f"{docs / seconds:.0f} docs/s, {done / seconds / 1e6:.2f} MB/s")
    tokenizer = GPT2BPETokenizer(small["vocab"], small["merges"])
    tokens = sum(len(tokenizer.tokenize(text)) + 1 for text in texts)
    seconds, total = 0.25 * (documents // per_block + 1), documents * line_bytes
    expected.append(f"Done: {documents} documents, {tokens} tokens, {total / 1e6:.1f} MB in {seconds:.1f} s "
                    f"({documents / seconds:.0f} docs/s, {total / seconds / 1e6:.2f} MB/s, backend "
                    f"{tokenizer.backend}, 1 workers)")
    assert err[:-1] == expected, err
    assert err[-1].startswith("wrote ") and clock.calls == documents // per_block + 2


def test_progress_line_counts_and_rate_limit():
    stream = io.StringIO()
    progress = cli.ProgressLine("Wrote", "tensors", total=5, clock=FakeClock(0.5), stream=stream)
    for _ in range(5):
        progress.advance(1, nbytes=1_000_000)          # at 0.5 s, 1.0 s (a line), 1.5, 2.0 (a line), 2.5
    assert progress.finish() == "Done: 5 tensors, 5.0 MB in 3.0 s (2 tensors/s, 1.67 MB/s)"
    assert stream.getvalue().splitlines() == ["Wrote 2/5 tensors (40%), 2 tensors/s, 2.00 MB/s",
                                              "Wrote 4/5 tensors (80%), 2 tensors/s, 2.00 MB/s",
                                              "Done: 5 tensors, 5.0 MB in 3.0 s (2 tensors/s, 1.67 MB/s)"]


def _counted(stream):
    """A ProgressLine whose clock moves a second per call: one line per tensor."""
    return cli.ProgressLine("Wrote", "tensors", clock=FakeClock(1.0), stream=stream)


def test_converters_and_checkpoint_util_report_tensors_done_of_total(small, tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    import checkpoint_util
    import convert_from_hf
    import convert_to_hf
    from megatron.tokenizer import GPT2BPETokenizer
    from megatron.checkpoint import layout as ckpt
    vocab = GPT2BPETokenizer(small["vocab"], small["merges"]).vocab_size
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=4)).save_pretrained(
        str(tmp_path / "hf"))

    def lines(stream):
        found = [re.fullmatch(r"Wrote (\d+)/(\d+) tensors \((\d+)%\), .*", line) for line in
                 stream.getvalue().splitlines()]
        assert all(found), stream.getvalue()
        return [(int(m.group(1)), int(m.group(2))) for m in found]

    def tensors_in(directory):      # the model tensors of the written checkpoint's rank files, counted
        files = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names
                 if name.endswith(".pt")]
        return sum(len(torch.load(f, weights_only=False)[ckpt.MODEL]) for f in files)

    stream = io.StringIO()
    convert_from_hf.convert(str(tmp_path / "hf"), str(tmp_path / "mp2"), model_parallel_size=2,
                            make_vocab_size_divisible_by=8, progress=_counted(stream))
    total = tensors_in(tmp_path / "mp2")
    assert lines(stream) == [(done, total) for done in range(1, total + 1)]    # 2 ranks x every parameter
    stream = io.StringIO()
    checkpoint_util.resize(str(tmp_path / "mp2"), str(tmp_path / "mp1"), 1, make_vocab_size_divisible_by=8,
                           progress=_counted(stream))
    assert lines(stream) == [(done, total // 2) for done in range(1, total // 2 + 1)]
    stream = io.StringIO()
    convert_to_hf.convert(str(tmp_path / "mp1"), str(tmp_path / "back"), small["vocab"], small["merges"],
                          _counted(stream))
    assert lines(stream) == [(done, total // 2) for done in range(1, total // 2 + 1)]

