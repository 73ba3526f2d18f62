"""Plot training runs from their --log-jsonl files: one figure, a panel per quantity, the runs overlaid.

    python tools/plot_run.py checkpoints/gpt2_zero2/log.jsonl --output run.png
    python tools/plot_run.py fp32/log.jsonl bf16/log.jsonl --labels fp32 bf16 --output runs.png --html runs.html

Panels (x: iteration): training loss (the validation loss as points), validation perplexity, learning rate, loss
scale, skipped steps, gradient norm, tokens/s, TFLOP/s per rank, memory; train_rlhf.py's runs also reward (the
validation rewards as points), policy loss, value loss, KL to the reference, clipped fraction, completion length,
PTX loss, and with --ft-replica-groups the replica groups in each step's quorum and the heals (left out without a
word when no run logs them); and a panel per downstream task and metric (--eval-tasks:
'TASK acc', 'TASK word_perplexity', ...; stderrs not drawn). A run without a panel's field leaves the
panel to the other runs; a panel no run has is omitted (one line names it). The legend shows the file names (the
shortest distinct path ends) or --labels. --html writes one self-contained page: the same charts as inline SVG and
a table of each run's settings (its header record; a log without one: its first record). A resumed run appends to
the same log: the last record written for an iteration is the one plotted. The records: docs/operations-jsonl.md.
Needs matplotlib (a requirement: requirements.txt). Bad input: one line naming it, exit status 1.
"""
import dataclasses
import html
import io
import json
import math
import os
import sys
from typing import Callable, Optional, Tuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))
from megatron import cli  # noqa: E402

INSTALL_HINT = "pip install -r requirements.txt (or: pip install matplotlib)"
RECORD_TYPES = ("header", "train", "validation", "downstream", "ft")


class PlotError(cli.UserError):
    """Bad input or an unwritable output; the message is one line."""


# ---- the logs -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """One --log-jsonl file, read."""
    path: str
    label: str
    header: Optional[dict]    # the first header record (a resumed run appends more), None in an older log
    resumed_at: list          # the starting iterations of the later headers (each resumption of the run)
    first: dict               # the first record of the file (the settings shown without a header)
    train: list               # training records by iteration (the last written for each)
    validation: list          # validation records of the 'valid' split by iteration (the last written for each
                              # iteration and place: the periodic one and the one at the end of training)
    downstream: list = dataclasses.field(default_factory=list)   # --eval-tasks records (the last written for each
                              # iteration and task)

    ft: list = dataclasses.field(default_factory=list)   # --ft-replica-groups records: each step's quorum, heals

    def records(self, kind):
        return {"train": self.train, "validation": self.validation, "downstream": self.downstream, "ft": self.ft}[kind]


def read_run(path, label):
    """Run, or PlotError naming the file (and line) for a missing or empty file, a line that is not a JSON object,
    an unknown record type, or a train/validation record without its iteration."""
    if not os.path.isfile(path):
        raise PlotError(f"{path} does not exist (pass the file a run's --log-jsonl wrote)")
    records = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PlotError(f"{path}:{number}: not JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict):
                raise PlotError(f"{path}:{number}: not a JSON object (a --log-jsonl record is one)")
            kind = record.get("type", "train")     # training records had no type before the header existed
            if kind not in RECORD_TYPES:
                raise PlotError(f"{path}:{number}: unknown record type {kind!r} (expected one of "
                                f"{', '.join(RECORD_TYPES)})")
            if kind != "header" and not isinstance(record.get("iteration"), int):
                raise PlotError(f"{path}:{number}: a {kind} record without an integer 'iteration' (not a "
                                "--log-jsonl file?)")
            records.append((kind, record))
    if not records:
        raise PlotError(f"{path} is empty: no records (pass the file a run's --log-jsonl wrote)")
    by_kind = {kind: {} for kind in RECORD_TYPES}
    for kind, record in records:       # a replayed iteration (a run resumed from an earlier checkpoint): the last
        if kind == "validation" and record.get("split", "valid") == "valid":
            by_kind[kind][(record["iteration"], str(record.get("at")))] = record
        elif kind == "train":
            by_kind[kind][record["iteration"]] = record
        elif kind == "downstream":
            by_kind[kind][(record["iteration"], str(record.get("task")))] = record
        elif kind == "ft":
            by_kind[kind][(record["iteration"], str(record.get("event")))] = record
    if not by_kind["train"]:
        raise PlotError(f"{path} has no training records (only {', '.join(sorted({k for k, _ in records}))}): "
                        "the run stopped before its first --log-interval")
    headers = [record for kind, record in records if kind == "header"]
    return Run(path, label, headers[0] if headers else None, [h.get("iteration") for h in headers[1:]],
               records[0][1], [r for _, r in sorted(by_kind["train"].items())],
               [r for _, r in sorted(by_kind["validation"].items())],
               [r for _, r in sorted(by_kind["downstream"].items())], [r for _, r in sorted(by_kind["ft"].items())])


def default_labels(paths):
    """The shortest path ends that tell the files apart: 'a.jsonl', or 'fp32/log.jsonl' beside 'bf16/log.jsonl'."""
    parts = [os.path.normpath(path).split(os.sep) for path in paths]
    for depth in range(1, max(map(len, parts)) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return list(paths)


# ---- the panels ---------------------------------------------------------------------------------------------------
def _field(*keys):
    """record -> the float at record[k0][k1]..., None where missing or null (non-finite values are logged null)."""
    def value(record):
        for key in keys:
            record = record.get(key) if isinstance(record, dict) else None
        return float(record) if isinstance(record, (int, float)) and not isinstance(record, bool) else None
    return value


def _gib(value):
    return lambda record: None if value(record) is None else value(record) / 2 ** 30


@dataclasses.dataclass(frozen=True)
class Series:
    """One quantity of a panel: which records hold it, how to read it, how to draw it."""
    records: str                   # "train" or "validation"
    value: Callable                # record -> float, None when the record lacks it
    suffix: str = ""               # after the run's label in the legend
    points: bool = False           # markers only (sparse evaluations), not a line


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: Tuple[Series, ...]
    log_scale: bool = False
    rlhf: bool = False             # train_rlhf.py's: left out without a word when no run logs it
    ft: bool = False               # --ft-replica-groups': the same


PANELS = (
    Panel("training loss", "lm loss", (Series("train", _field("losses", "lm loss")),
                                       Series("validation", _field("losses", "lm loss"), " validation", True))),
    Panel("validation perplexity", "lm loss PPL", (Series("validation", _field("ppl", "lm loss"), "", True),)),
    Panel("learning rate", "learning rate", (Series("train", _field("learning_rate")),)),
    Panel("loss scale", "loss scale", (Series("train", _field("loss_scale")),), log_scale=True),
    Panel("skipped steps", "skipped iterations (total)", (Series("train", _field("skipped_iterations")),)),
    Panel("gradient norm", "global gradient norm", (Series("train", _field("grad_norm")),)),
    Panel("tokens/s", "tokens/s", (Series("train", _field("tokens_per_second")),)),
    Panel("TFLOP/s per rank", "TFLOP/s per rank", (Series("train", _field("tflops_per_rank")),)),
    Panel("memory", "GiB (CPU RSS / CUDA max allocated)", (Series("train", _gib(_field("memory", "bytes"))),)),
    # --ft-replica-groups': the groups whose gradients each step applied (0: the step was discarded), heals
    Panel("replica groups in the quorum", "groups applied (0: step discarded)", (Series("ft", _field("quorum")),),
          ft=True),
    Panel("heals", "seconds to heal (quorum to state loaded)", (Series("ft", _field("heal_seconds"), "", True),),
          ft=True),
    # train_rlhf.py's (TRL's names): GRPO's, then PPO's
    Panel("reward", "mean reward (score)", (
        Series("train", _field("losses", "reward")), Series("train", _field("losses", "objective/scores"), " scores"),
        Series("validation", _field("losses", "reward"), " validation", True)), rlhf=True),
    Panel("policy loss", "loss (GRPO) / loss/policy_avg (PPO)", (
        Series("train", _field("losses", "loss")), Series("train", _field("losses", "loss/policy_avg"), " policy")),
        rlhf=True),
    Panel("value loss", "loss/value_avg", (Series("train", _field("losses", "loss/value_avg")),), rlhf=True),
    Panel("KL to the reference", "kl (GRPO) / objective/kl (PPO)", (
        Series("train", _field("losses", "kl")), Series("train", _field("losses", "objective/kl"), " objective")),
        rlhf=True),
    Panel("clipped fraction", "clip_ratio/region_mean / policy/clipfrac_avg", (
        Series("train", _field("losses", "clip_ratio/region_mean")),
        Series("train", _field("losses", "policy/clipfrac_avg"), " policy")), rlhf=True),
    Panel("completion length", "completions/mean_length", (
        Series("train", _field("losses", "completions/mean_length")),), rlhf=True),
    Panel("PTX loss", "loss/ptx_avg (the LM loss of PPO-ptx)", (
        Series("train", _field("losses", "loss/ptx_avg")),), rlhf=True),
)


def series_points(run, series):
    """([iterations], [values]) of `series` in `run`, the records without the value left out."""
    points = [(record["iteration"], series.value(record)) for record in run.records(series.records)]
    points = [(x, y) for x, y in points if y is not None]
    return [x for x, _ in points], [y for _, y in points]


def _task_metric(task, metric):
    """downstream record -> its task's `metric`, None for another task's record."""
    read = _field("metrics", metric)
    return lambda record: read(record) if record.get("task") == task else None


def downstream_panels(runs):
    """A panel per (task, metric) some run logged with --eval-tasks (by iteration, then task name; no stderrs)."""
    names = dict.fromkeys((record.get("task"), metric) for run in runs for record in run.downstream
                          for metric in (record.get("metrics") or {}) if not metric.endswith("_stderr"))
    return tuple(Panel(f"{task} {metric}", f"{metric} (downstream: {task})",
                       (Series("downstream", _task_metric(task, metric), "", True),)) for task, metric in names)


def present_panels(runs):
    """(the panels some run has a value for, the titles of the others)."""
    present = [panel for panel in PANELS + downstream_panels(runs)
               if any(series_points(run, series)[0] for run in runs for series in panel.series)]
    return present, [panel.title for panel in PANELS if panel not in present and not (panel.rlhf or panel.ft)]


def line_id(panel, run_index, series_index):
    """The SVG group id of one plotted line: 'training-loss.run1.series0'."""
    return f"{panel.title.replace(' ', '-').replace('/', '-')}.run{run_index}.series{series_index}"


def draw_panel(ax, panel, runs):
    """Each run's series of `panel` on `ax` (colour C<run index> in every panel), with a legend."""
    for run_index, run in enumerate(runs):
        for series_index, series in enumerate(panel.series):
            xs, ys = series_points(run, series)
            if not xs:
                continue
            style = dict(marker="o", linestyle="none", markersize=5) if series.points else dict(linewidth=1.2)
            ax.plot(xs, ys, color=f"C{run_index % 10}", label=run.label + series.suffix,
                    gid=line_id(panel, run_index, series_index), **style)
    from matplotlib.ticker import MaxNLocator
    ax.set_title(panel.title)
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(panel.ylabel)
    if panel.log_scale:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


COLUMNS = 3


def build_figure(runs):
    """One matplotlib Figure, a panel (Axes, titled) per present panel in PANELS order, COLUMNS to a row."""
    from matplotlib.figure import Figure
    panels, _ = present_panels(runs)
    columns = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        draw_panel(ax, panel, runs)
    for ax in axes[len(panels):]:
        figure.delaxes(ax)
    figure.suptitle("runs: " + ", ".join(run.label for run in runs))
    return figure


# ---- the page -----------------------------------------------------------------------------------------------------
def panel_svg(panel, runs):
    """One panel as an <svg> element (text as text, no external references)."""
    import matplotlib
    from matplotlib.figure import Figure
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": panel.title}):
        figure = Figure(figsize=(6.0, 4.0), layout="constrained")
        draw_panel(figure.add_subplot(), panel, runs)
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def settings(run):
    """{setting: value} shown for a run: its header's layout then arguments, else its first record's fields."""
    rows = {"log file": run.path, "iterations logged": f"{run.train[0]['iteration']}-{run.train[-1]['iteration']}"}
    if run.resumed_at:
        rows["resumed at iteration"] = ", ".join(map(str, run.resumed_at))
    if run.header is None:
        return {**rows, **{f"first record: {key}": value for key, value in run.first.items()}}
    layout, args = run.header.get("layout") or {}, run.header.get("args") or {}
    return {**rows, **{f"layout: {key}": value for key, value in layout.items()}, **args}


def _cell(value):
    return html.escape(value if isinstance(value, str) else json.dumps(value))


def settings_table(runs):
    tables = [settings(run) for run in runs]
    keys = list(dict.fromkeys(key for table in tables for key in table))
    lines = ["<table>", "<tr><th>setting</th>" + "".join(f"<th>{html.escape(r.label)}</th>" for r in runs) + "</tr>"]
    for key in keys:
        cells = [_cell(table[key]) if key in table else "" for table in tables]
        differs = len(runs) > 1 and len(set(cells)) > 1 and key not in ("log file", "iterations logged",
                                                                         "resumed at iteration")
        row = '<tr class="differs">' if differs else "<tr>"
        lines.append(f"{row}<td>{html.escape(key)}</td>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return "\n".join(lines + ["</table>"])


STYLE = ("body{font-family:sans-serif;margin:1.5em} .panels{display:flex;flex-wrap:wrap;gap:1em} "
         "figure{margin:0} figcaption{font-weight:bold} svg{width:480px;height:auto} "
         "table{border-collapse:collapse;font-size:small} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left} "
         "tr.differs{background:#fff3c4}")


def build_html(runs):
    """The self-contained page: one <figure> with an inline <svg> per present panel, then the settings table."""
    panels, omitted = present_panels(runs)
    title = "runs: " + ", ".join(run.label for run in runs)
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\">", f"<title>{html.escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>", "<div class=\"panels\">"]
    for panel in panels:
        parts.append(f"<figure><figcaption>{html.escape(panel.title)}</figcaption>\n{panel_svg(panel, runs)}"
                     "</figure>")
    parts.append("</div>")
    if omitted:
        parts.append(f"<p>Omitted (no run logs them): {html.escape(', '.join(omitted))}.</p>")
    parts += ["<h2>Settings</h2>", "<p>Rows that differ between the runs are highlighted.</p>", settings_table(runs),
              "</body></html>"]
    return "\n".join(parts) + "\n"


# ---- the command --------------------------------------------------------------------------------------------------
def _check_output_dir(flag, path):
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise PlotError(f"{flag} {path}: the directory {directory} does not exist")


def write_outputs(runs, output=None, page=None):
    """Write the PNG (or any format matplotlib knows by the extension) and/or the HTML page."""
    if output:
        _check_output_dir("--output", output)
        try:
            build_figure(runs).savefig(output, dpi=100)
        except ValueError as error:      # an extension matplotlib has no writer for
            raise PlotError(f"--output {output}: {' '.join(str(error).split())}") from None
    if page:
        _check_output_dir("--html", page)
        with open(page, "w", encoding="utf-8") as handle:
            handle.write(build_html(runs))


def parse_args(argv=None):
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="--log-jsonl files, one per run")
    parser.add_argument("--labels", nargs="+", help="legend labels, one per run (default: the file names)")
    parser.add_argument("--output", metavar="FILE.png", help="the figure (any matplotlib format by extension)")
    parser.add_argument("--html", metavar="FILE.html", help="a self-contained page: the charts and the settings")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs: give one per run")
    if not args.output and not args.html:
        parser.error("nothing to write: give --output FILE.png and/or --html FILE.html")
    return args


def main(argv=None):
    """Returns the exit status (0, or 1 after one line on stderr)."""
    args = parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"error: plotting needs matplotlib, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 1
    try:
        runs = [read_run(path, label) for path, label in zip(args.runs, args.labels or default_labels(args.runs))]
        panels, omitted = present_panels(runs)
        if omitted:
            print(f"omitted panels (no run logs them): {', '.join(omitted)}")
        write_outputs(runs, args.output, args.html)
    except (PlotError, OSError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    written = " and ".join(path for path in (args.output, args.html) if path)
    print(f"wrote {written}: {len(panels)} panels, {len(runs)} run{'s' if len(runs) > 1 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
