"""``convoy report``: plots of one run, or of several overlaid, in one self-contained HTML file.

A run directory (local or ``s3://``) is read through ``RunStorage``: ``metrics.jsonl`` for the
curves and ``summary.json`` for the comparison table. Each figure is a matplotlib ``Figure``
drawn on the Agg canvas (no pyplot, no display, no global state), saved as a PNG and embedded
in ``report.html`` as base64, so the HTML needs no network and no other file.

A resumed run appends a second attempt to ``metrics.jsonl``, repeating the steps after its
checkpoint. The report keeps the *last* record per step (and per epoch): the curves show the
history the final model actually went through, without the abandoned attempt's tail.

Per-rank series (``rank_step_seconds``, ``rank_data_wait_seconds``, ``rank_memory_bytes``),
throughput and TFLOP/s appear only in runs whose step records carry them; a figure with no
data in any run is left out and the report says why, and a run missing from a per-run figure
is named in a note.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from convoy.errors import ConvoyError
from convoy.outputs import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from convoy.storage import RunStorage, is_remote

REPORT_DIR = "report"
HTML_FILE = "report.html"
COUNT_METRICS = ("samples", "tokens", "bytes")
PERCENT_METRICS = ("acc", "top5")
SPLITS = ("train", "val", "test")
MANY_RANKS = 8
"""Above this many ranks, per-rank figures draw a band and the slowest rank, not a legend."""

RUN_FILES = (
    f"a run directory (<run.storage_dir>/<run.name>) holds {CONFIG_FILE}, {METRICS_FILE} "
    f"and, once the run ends, {SUMMARY_FILE}"
)


class ReportError(ConvoyError):
    """A path given to ``convoy report`` is not a run with metrics to plot."""


@dataclass(frozen=True)
class RunData:
    """What the report reads from one run directory."""

    name: str
    location: str
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    epochs: list[dict[str, Any]]
    test: dict[str, Any]
    unreadable_lines: int = 0


@dataclass(frozen=True)
class Plot:
    """One rendered figure: its file name (without ``.png``), title and PNG bytes."""

    name: str
    title: str
    png: bytes


@dataclass
class Report:
    """The runs, their rendered figures, and notes on what could not be drawn."""

    runs: list[RunData]
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- reading runs


def load_run(location: str | Path) -> RunData:
    """Read one run; ``ReportError`` when it does not exist, is not a run, or has no metrics."""
    where = str(location)
    storage = RunStorage.at(where)
    _check_is_run(storage, where)
    if not storage.exists(METRICS_FILE):
        raise ReportError(
            f"{where}: no metrics to plot: {METRICS_FILE} is missing, no step records yet (a run "
            "that failed before its first logged step, or one that is still starting)"
        )
    records, unreadable = parse_metrics(storage.read_text(METRICS_FILE))
    if not records:
        raise ReportError(
            f"{where}: no metrics to plot: {METRICS_FILE} holds no records (a run that failed "
            "before its first logged step, or one that is still starting)"
        )
    summary = json.loads(storage.read_text(SUMMARY_FILE)) if storage.exists(SUMMARY_FILE) else {}
    tests = [r for r in records if r.get("kind") == "test"]
    return RunData(
        name=str(summary.get("run_name") or where.rstrip("/").rsplit("/", 1)[-1]),
        location=storage.uri,
        summary=summary,
        steps=last_per(records, "step", "step"),
        epochs=last_per(records, "epoch", "epoch"),
        test=tests[-1] if tests else {},
        unreadable_lines=unreadable,
    )


def _check_is_run(storage: RunStorage, where: str) -> None:
    local = storage.local_path("")
    if local is not None and not local.exists():
        raise ReportError(f"{where}: no such directory ({RUN_FILES})")
    if local is not None and not local.is_dir():
        raise ReportError(f"{where}: a file, not a run directory ({RUN_FILES})")
    if not any(storage.exists(name) for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE)):
        inside, example = _runs_inside(local) if local is not None else ([], None)
        hint = (
            f"; it holds runs: {', '.join(inside[:5])}{', ...' if len(inside) > 5 else ''}"
            + (f" (e.g. convoy report {where.rstrip('/')}/{example})" if example else "")
            if inside
            else f" ({RUN_FILES})"
        )
        raise ReportError(
            f"{where}: not a run directory: no {CONFIG_FILE}, {METRICS_FILE} or {SUMMARY_FILE}"
            + hint
        )


def _runs_inside(folder: Path) -> tuple[list[str], str | None]:
    """Names of the run directories directly inside ``folder`` (a storage_dir given by
    mistake), sorted, and the first with metrics to plot (for an example command)."""
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return [], None
    runs = [
        p
        for p in children
        if any((p / name).is_file() for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE))
    ]
    example = next((p.name for p in runs if (p / METRICS_FILE).is_file()), None)
    return [p.name for p in runs], example


def parse_metrics(text: str) -> tuple[list[dict[str, Any]], int]:
    """The JSON records of a ``metrics.jsonl`` and how many lines were not JSON objects (a
    line cut short by a crash mid-write)."""
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def last_per(records: Iterable[dict[str, Any]], kind: str, key: str) -> list[dict[str, Any]]:
    """The records of ``kind``, the last one for each value of ``key``, sorted by ``key``."""
    latest: dict[Any, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == kind and isinstance(record.get(key), int | float):
            latest[record[key]] = record
    return [latest[k] for k in sorted(latest)]


def load_runs(locations: Sequence[str | Path]) -> list[RunData]:
    """Read every run; names shared by several runs get their parent folder to tell them apart."""
    runs = [load_run(location) for location in locations]
    seen: dict[str, int] = {}
    named = []
    for run in runs:
        name = run.name
        if sum(r.name == name for r in runs) > 1:
            name = "/".join(run.location.rstrip("/").rsplit("/", 2)[-2:])
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name} #{seen[name]}"
        named.append(replace(run, name=name))
    return named


def default_out_dir(first_run: str | Path) -> Path:
    """``<run>/report/`` for a local run; ``./report-<run name>/`` for one on ``s3://``."""
    where = str(first_run)
    if is_remote(where):
        return Path(f"report-{where.rstrip('/').rsplit('/', 1)[-1]}")
    return Path(where) / REPORT_DIR


# ---------------------------------------------------------------------------- series


def series(records: Iterable[dict[str, Any]], key: str, x: str = "step") -> tuple[list, list]:
    """(x, y) of the records that carry a finite number under ``key``."""
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and math.isfinite(value) and x in record:
            xs.append(record[x])
            ys.append(float(value))
    return xs, ys


def rank_series(
    steps: Iterable[dict[str, Any]], value: Callable[[dict[str, Any]], list[float] | None]
) -> list[tuple[list[int], list[float]]]:
    """One (steps, values) pair per rank; ``value`` gives a record's per-rank list or None.

    Ranks are ragged where a resumed attempt ran at another world size."""
    ranks: list[tuple[list[int], list[float]]] = []
    for record in steps:
        values = value(record)
        if not values:
            continue
        while len(ranks) < len(values):
            ranks.append(([], []))
        for rank, v in enumerate(values):
            if v is not None and math.isfinite(v):
                ranks[rank][0].append(record["step"])
                ranks[rank][1].append(v)
    return ranks


def _rank_list(key: str, scale: float = 1.0) -> Callable[[dict[str, Any]], list[float] | None]:
    def value(record: dict[str, Any]) -> list[float] | None:
        values = record.get(key)
        if not isinstance(values, list):
            return None
        return [v * scale if isinstance(v, int | float) else math.nan for v in values]

    return value


def _data_wait_fraction(record: dict[str, Any]) -> list[float] | None:
    waits, steps = record.get("rank_data_wait_seconds"), record.get("rank_step_seconds")
    if not isinstance(waits, list) or not isinstance(steps, list):
        return None
    return [100 * w / s if s else math.nan for w, s in zip(waits, steps, strict=False)]


SMOOTH_FROM_POINTS = 50
"""A loss curve with this many points also gets a smoothed line over its raw one."""


def ema(values: Sequence[float], weight: float | None = None) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing); by
    default it spans about 1/25 of the curve, so long and short runs smooth alike."""
    if weight is None:
        weight = 1 - 2 / (max(2, len(values) // 25) + 1)
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = weight * acc + (1 - weight) * v
        out.append(acc / (1 - weight**i))
    return out


def epoch_metric_names(runs: Iterable[RunData]) -> list[str]:
    """Metric names (``loss``, ``acc``, ...) of the epoch and test records, loss first."""
    names = dict.fromkeys(["loss"])
    for run in runs:
        for record in [*run.epochs, run.test]:
            for key in record:
                split, _, name = key.partition("/")
                if split in SPLITS and name and name not in COUNT_METRICS:
                    names.setdefault(name)
    return [n for n in names if any(_has_epoch_metric(r, n) for r in runs)]


def _has_epoch_metric(run: RunData, name: str) -> bool:
    return any(f"{s}/{name}" in r for r in [*run.epochs, run.test] for s in SPLITS)


# ---------------------------------------------------------------------------- figures


def _figure_class() -> Any:
    """matplotlib's ``Figure`` on the Agg canvas; a one-line error when it is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("convoy report needs matplotlib: pip install 'convoy[plot]'") from None
    return Figure


def _new_figure(rows: int, cols: int = 1, height: float = 3.0, width: float = 9.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = _figure_class()(figsize=(width, 0.8 + height * rows), layout="constrained", dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def _color(index: int) -> str:
    return f"C{index % 10}"


def _line_width(index: int, count: int, step: float = 1.5) -> float:
    """Earlier lines draw wider, so that identical curves (the same job under two strategies,
    ranks in lockstep) still show every color."""
    return 1.5 + step * (count - 1 - index)


def _style_axes(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _run_legend(ax: Any, labels: int) -> None:
    """A legend beside the axes when there is more than one line to tell apart."""
    if labels > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def plot_train_loss(runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """Training loss per logged step (raw, and smoothed when there are many points)."""
    drawn = [(i, r, series(r.steps, "train/loss")) for i, r in enumerate(runs)]
    drawn = [(i, r, s) for i, r, s in drawn if s[0]]
    _note_missing(notes, "training loss per step", runs, [r for _, r, _ in drawn])
    if not drawn:
        return None
    fig = _new_figure(1)
    ax = fig.subplots()
    for index, run, (x, y) in drawn:
        smooth = len(y) >= SMOOTH_FROM_POINTS
        width = _line_width(index, len(runs))
        ax.plot(
            x,
            y,
            color=_color(index),
            alpha=0.35 if smooth else 1.0,
            lw=1 if smooth else width,
            marker="" if len(y) > 1 else "o",
            label=None if smooth else run.name,
        )
        if smooth:
            ax.plot(x, ema(y), color=_color(index), lw=width, label=f"{run.name} (smoothed)")
    _style_axes(ax, "step", "train loss")
    ax.set_title("Training loss per step")
    _run_legend(ax, len(drawn))
    return fig


def plot_lr(runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """Learning rate per logged step."""
    drawn = [(i, r, series(r.steps, "lr")) for i, r in enumerate(runs)]
    drawn = [(i, r, s) for i, r, s in drawn if s[0]]
    _note_missing(notes, "learning rate", runs, [r for _, r, _ in drawn])
    if not drawn:
        return None
    fig = _new_figure(1, height=2.6)
    ax = fig.subplots()
    for index, run, (x, y) in drawn:
        width = _line_width(index, len(runs))
        marker = "" if len(y) > 1 else "o"
        ax.plot(x, y, color=_color(index), lw=width, label=run.name, marker=marker)
    _style_axes(ax, "step", "learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_title("Learning rate")
    _run_legend(ax, len(drawn))
    return fig


SPLIT_STYLES: dict[str, dict[str, Any]] = {
    "train": {"ls": "-", "marker": "o"},
    "val": {"ls": "--", "marker": "s"},
    "test": {"ls": "", "marker": "*", "markersize": 13},
}


def plot_epoch_metrics(runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """One panel per metric (loss, acc, ppl, ...): train and val per epoch, test at the end."""
    names = epoch_metric_names(runs)
    if not names:
        notes.append("metrics per epoch: no run has an epoch or test record yet")
        return None
    cols = 1 if len(names) == 1 else 2
    rows = math.ceil(len(names) / cols)
    fig = _new_figure(rows, cols, height=3.0, width=9.0 if cols == 1 else 11.0)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names, strict=False):
        for index, run in enumerate(runs):
            _draw_epoch_metric(ax, run, name, index, len(runs))
        percent = name in PERCENT_METRICS
        _style_axes(ax, "epoch", f"{name} (%)" if percent else name)
        ax.set_title(name)
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    _split_legend(fig, runs)
    return fig


def _draw_epoch_metric(ax: Any, run: RunData, name: str, index: int, count: int) -> None:
    scale = 100.0 if name in PERCENT_METRICS else 1.0
    color, width = _color(index), _line_width(index, count)
    size = {"lw": width, "markersize": 4 + 2 * width}
    last_epoch = max((r["epoch"] for r in run.epochs), default=1)
    for split in ("train", "val"):
        x, y = series(run.epochs, f"{split}/{name}", x="epoch")
        if x:
            ax.plot(x, [v * scale for v in y], color=color, **{**SPLIT_STYLES[split], **size})
    value = run.test.get(f"test/{name}")
    if isinstance(value, int | float):
        star = {**SPLIT_STYLES["test"], "markersize": 9 + 3 * width}
        ax.plot([last_epoch], [value * scale], color=color, **star)


def _split_legend(fig: Any, runs: Sequence[RunData]) -> None:
    """Colors name the runs and line styles the splits, in one legend below the panels."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="0.3", label=s, **SPLIT_STYLES[s]) for s in SPLITS]
    if len(runs) > 1:
        handles = [
            Line2D([], [], color=_color(i), lw=3, label=r.name) for i, r in enumerate(runs)
        ] + handles
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 6),
        fontsize="small",
        frameon=False,
    )


def plot_throughput(runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """Global samples/s per logged interval, and TFLOP/s and MFU where recorded."""
    panels = [
        ("samples_per_second", "samples/s", 1.0),
        ("tflops", "TFLOP/s", 1.0),
        ("mfu", "MFU (%)", 100.0),
    ]
    present = [p for p in panels if any(series(r.steps, p[0])[0] for r in runs)]
    counted = [r for r in runs if series(r.steps, "samples_per_second")[0]]
    _note_missing(notes, "throughput (samples_per_second in step records)", runs, counted)
    if not present:
        return None
    fig = _new_figure(len(present), height=2.6)
    axes = fig.subplots(len(present), 1, squeeze=False, sharex=True).ravel()
    for ax, (key, label, scale) in zip(axes, present, strict=True):
        for index, run in enumerate(runs):
            x, y = series(run.steps, key)
            if x:
                ax.plot(
                    x,
                    [v * scale for v in y],
                    color=_color(index),
                    lw=_line_width(index, len(runs)),
                    label=run.name,
                    marker="" if len(x) > 1 else "o",
                )
        _style_axes(ax, "step" if ax is axes[-1] else "", label)
        _run_legend(ax, len(runs))
    axes[0].set_title("Throughput")
    return fig


@dataclass(frozen=True)
class RankFigure:
    """A per-rank figure: one panel per run, one line per rank."""

    name: str
    title: str
    ylabel: str
    value: Callable[[dict[str, Any]], list[float] | None]
    needs: str


RANK_FIGURES = (
    RankFigure(
        "step_time",
        "Step time per rank",
        "step time (ms)",
        _rank_list("rank_step_seconds", 1000.0),
        "rank_step_seconds",
    ),
    RankFigure(
        "data_wait",
        "Data-wait fraction per rank",
        "data wait (% of step)",
        _data_wait_fraction,
        "rank_data_wait_seconds",
    ),
    RankFigure(
        "memory",
        "Peak memory per rank over the steps",
        "peak memory (MiB)",
        _rank_list("rank_memory_bytes", 1 / 2**20),
        "rank_memory_bytes",
    ),
)


def plot_per_rank(spec: RankFigure, runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """One panel per run that records ``spec.needs``; ranks as lines, shared y axis."""
    drawn = [(r, rank_series(r.steps, spec.value)) for r in runs]
    drawn = [(r, ranks) for r, ranks in drawn if any(x for x, _ in ranks)]
    what = f"{spec.title.lower()} ({spec.needs} in step records)"
    _note_missing(notes, what, runs, [r for r, _ in drawn])
    if not drawn:
        return None
    fig = _new_figure(len(drawn), height=2.6)
    axes = fig.subplots(len(drawn), 1, squeeze=False, sharey=True).ravel()
    top = _rank_axis_top([ranks for _, ranks in drawn])
    for ax, (run, ranks) in zip(axes, drawn, strict=True):
        _draw_ranks(ax, ranks)
        _style_axes(ax, "step", spec.ylabel)
        ax.set_title(f"{spec.title}: {run.name}" if len(runs) > 1 else spec.title)
        ax.set_ylim(0, top)
        if any(y[0] > top for _, y in ranks if y):
            ax.annotate(
                "first interval (warm-up) above the scale",
                (0.01, 0.97),
                xycoords="axes fraction",
                va="top",
                fontsize="small",
                color="0.35",
            )
    return fig


def _rank_axis_top(runs: list[list[tuple[list[int], list[float]]]]) -> float:
    """The y-axis top shared by the panels: the highest value plus headroom, unless only the
    first interval (compilation, allocator warm-up) is far above the rest."""
    firsts = [y[0] for ranks in runs for _, y in ranks if y]
    rest = [v for ranks in runs for _, y in ranks for v in y[1:]]
    highest = max([*firsts, *rest], default=1.0) or 1.0
    if rest and max(rest) > 0 and max(firsts) > 3 * max(rest):
        return 1.25 * max(rest)
    return 1.12 * highest


def _draw_ranks(ax: Any, ranks: list[tuple[list[int], list[float]]]) -> None:
    """Each rank in its own color; past ``MANY_RANKS``, grey lines and the worst rank in red."""
    if len(ranks) <= MANY_RANKS:
        for rank, (x, y) in enumerate(ranks):
            ax.plot(
                x,
                y,
                color=_color(rank),
                lw=_line_width(rank, len(ranks), step=0.5),
                label=f"rank {rank}",
                marker="" if len(x) > 1 else "o",
            )
    else:
        for rank, (x, y) in enumerate(ranks):
            ax.plot(x, y, color="0.6", lw=0.6, label="other ranks" if rank == 0 else None)
        worst = max(range(len(ranks)), key=lambda r: statistics.fmean(ranks[r][1] or [0.0]))
        ax.plot(*ranks[worst], color="C3", lw=2, label=f"highest: rank {worst}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)


def plot_peak_memory(runs: Sequence[RunData], notes: list[str]) -> Any | None:
    """Bars: each rank's peak memory at the end of each run (``summary.json``)."""
    drawn = [r for r in runs if r.summary.get("peak_memory_bytes_per_rank")]
    _note_missing(notes, "peak memory at the end (summary.json)", runs, drawn)
    if not drawn:
        return None
    fig = _new_figure(1, height=2.8)
    ax = fig.subplots()
    width = 0.8 / len(drawn)
    for index, run in enumerate(drawn):
        peaks = [(v or 0) / 2**20 for v in run.summary["peak_memory_bytes_per_rank"]]
        xs = [rank - 0.4 + width * (index + 0.5) for rank in range(len(peaks))]
        ax.bar(xs, peaks, width=width, color=_color(runs.index(run)), label=run.name)
    ax.set_xticks(range(max(len(r.summary["peak_memory_bytes_per_rank"]) for r in drawn)))
    _style_axes(ax, "rank", "peak memory (MiB)")
    ax.set_title("Peak memory per rank at the end of the run")
    _run_legend(ax, len(drawn))
    return fig


def _note_missing(
    notes: list[str], what: str, runs: Sequence[RunData], drawn: Sequence[RunData]
) -> None:
    missing = [r.name for r in runs if r not in drawn]
    if not drawn:
        notes.append(
            f"{what}: not recorded by {'any run' if len(runs) > 1 else 'this run'}; left out"
        )
    elif missing:
        notes.append(f"{what}: not recorded by {', '.join(missing)}")


def build_report(runs: Sequence[RunData]) -> Report:
    """Render every figure that has data; the notes say what was left out and why."""
    report = Report(list(runs))
    builders: list[tuple[str, str, Callable[[], Any | None]]] = [
        ("train_loss", "Training loss per step", lambda: plot_train_loss(runs, report.notes)),
        ("metrics", "Metrics per epoch", lambda: plot_epoch_metrics(runs, report.notes)),
        ("lr", "Learning rate", lambda: plot_lr(runs, report.notes)),
        ("throughput", "Throughput", lambda: plot_throughput(runs, report.notes)),
    ]
    for spec in RANK_FIGURES:
        builders.append(
            (spec.name, spec.title, functools.partial(plot_per_rank, spec, runs, report.notes))
        )
    builders.append(
        (
            "peak_memory",
            "Peak memory per rank at the end of the run",
            lambda: plot_peak_memory(runs, report.notes),
        )
    )
    for name, title, build in builders:
        fig = build()
        if fig is not None:
            report.plots.append(Plot(name, title, _png(fig)))
    report.notes += _run_notes(runs)
    return report


def _run_notes(runs: Sequence[RunData]) -> list[str]:
    notes = []
    for run in runs:
        if not run.summary:
            notes.append(f"{run.name}: no {SUMMARY_FILE} (the run has not finished, or failed)")
        if run.unreadable_lines:
            notes.append(
                f"{run.name}: {run.unreadable_lines} line(s) of {METRICS_FILE} are "
                "not JSON records (cut short by a crash?) and were skipped"
            )
    return notes


# ---------------------------------------------------------------------------- the table


def _fmt(value: Any, spec: str) -> str | None:
    return None if not isinstance(value, int | float) else format(value, spec)


SUMMARY_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str | None]], ...] = (
    ("strategy", lambda s: s.get("strategy")),
    ("launcher", lambda s: s.get("launcher")),
    ("world size", lambda s: _fmt(s.get("world_size"), "d")),
    ("precision", lambda s: s.get("precision")),
    ("device", lambda s: s.get("device_name")),
    ("steps", lambda s: _fmt(s.get("steps"), ",d")),
    ("wall time (s)", lambda s: _fmt(s.get("wall_seconds"), ",.1f")),
    ("samples/s", lambda s: _fmt(s.get("samples_per_second"), ",.1f")),
    ("tokens/s", lambda s: _fmt(s.get("tokens_per_second"), ",.0f")),
    ("step time, median (ms)", lambda s: _fmt(_times(s.get("step_seconds_median"), 1e3), ".1f")),
    ("data wait (%)", lambda s: _fmt(_times(s.get("data_wait_fraction"), 100), ".1f")),
    ("peak memory, max rank (MiB)", lambda s: _fmt(_peak_mib(s), ",.0f")),
    ("TFLOP/s", lambda s: _fmt(s.get("tflops_per_second"), ".3g")),
    ("MFU (%)", lambda s: _fmt(_times(s.get("mfu"), 100), ".1f")),
)


def _times(value: Any, factor: float) -> float | None:
    return value * factor if isinstance(value, int | float) else None


def _peak_mib(summary: dict[str, Any]) -> float | None:
    peaks = [p for p in summary.get("peak_memory_bytes_per_rank") or [] if p is not None]
    return max(peaks) / 2**20 if peaks else None


def final_metrics(run: RunData) -> dict[str, float]:
    """The summary's final metrics, or (unfinished run) the last epoch and test records'."""
    if run.summary.get("metrics"):
        return dict(run.summary["metrics"])
    merged = {**(run.epochs[-1] if run.epochs else {}), **run.test}
    return {k: v for k, v in merged.items() if k.partition("/")[0] in SPLITS}


def summary_table(runs: Sequence[RunData]) -> list[list[str]]:
    """Rows of ``[field, value per run...]``; a row no run has is left out."""
    rows = [["run", *(r.name for r in runs)]]
    for label, getter in SUMMARY_ROWS:
        cells = [getter(r.summary) for r in runs]
        if any(c is not None for c in cells):
            rows.append([label, *(c if c is not None else "-" for c in cells)])
    finals = [final_metrics(r) for r in runs]
    keys = dict.fromkeys(k for f in finals for k in f if k.partition("/")[2] not in COUNT_METRICS)
    for key in keys:
        rows.append([key, *(_metric_cell(key, f.get(key)) for f in finals)])
    return rows


def _metric_cell(key: str, value: Any) -> str:
    if not isinstance(value, int | float):
        return "-"
    if key.partition("/")[2] in PERCENT_METRICS:
        return f"{100 * value:.2f}%"
    return f"{value:.4f}"


# ---------------------------------------------------------------------------- writing


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr:first-child th { background: #f0f0f0; }
code { font-size: 0.92em; }
figure { margin: 1em 0; } img { max-width: 100%; height: auto; }
.notes { color: #555; font-size: 0.92em; }
"""


def render_html(report: Report) -> str:
    """The report as one HTML document; figures are inline ``data:`` PNGs, nothing external."""
    esc = html.escape
    title = "Convoy report: " + ", ".join(r.name for r in report.runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        "<ul>" + "".join(f"<li><code>{esc(r.location)}</code></li>" for r in report.runs) + "</ul>",
        "<h2>Summary</h2>",
        _table_html(summary_table(report.runs)),
    ]
    for plot in report.plots:
        data = base64.b64encode(plot.png).decode("ascii")
        parts.append(
            f'<h2 id="{plot.name}">{esc(plot.title)}</h2><figure>'
            f'<img src="data:image/png;base64,{data}" alt="{esc(plot.title)}"></figure>'
        )
    if report.notes:
        parts.append('<h2>Not shown</h2><ul class="notes">')
        parts += [f"<li>{esc(note)}</li>" for note in report.notes]
        parts.append("</ul>")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    parts.append(f'<p class="notes">Written by <code>convoy report</code> at {stamp}.</p>')
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _table_html(rows: list[list[str]]) -> str:
    esc = html.escape
    head = "<tr>" + "".join(f"<th>{esc(c)}</th>" for c in rows[0]) + "</tr>"
    body = "".join(
        "<tr>"
        + f"<th>{esc(row[0])}</th>"
        + "".join(f"<td>{esc(c)}</td>" for c in row[1:])
        + "</tr>"
        for row in rows[1:]
    )
    return f"<table>{head}{body}</table>"


def write_report(report: Report, out: Path) -> list[Path]:
    """Write the PNGs and ``report.html`` into ``out`` (created); returns the paths written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for plot in report.plots:
            path = out / f"{plot.name}.png"
            path.write_bytes(plot.png)
            written.append(path)
        page = out / HTML_FILE
        page.write_text(render_html(report), encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"--out {out}: cannot write the report ({exc.strerror or exc})") from None
    return [*written, page]


def make_report(
    locations: Sequence[str | Path], out: Path | None = None
) -> tuple[Report, list[Path]]:
    """Read the runs, render the figures, write them; returns the report and the paths."""
    _figure_class()  # fail before reading anything when matplotlib is missing
    runs = load_runs(locations)
    report = build_report(runs)
    return report, write_report(report, out or default_out_dir(locations[0]))
