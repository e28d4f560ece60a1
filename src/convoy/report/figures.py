"""The report's figures: matplotlib ``Figure`` objects on the Agg canvas (no pyplot), one per
kind of curve, rendered to PNG by ``build_report``.
"""

from __future__ import annotations

import functools
import io
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from convoy.imports import missing_extra
from convoy.outputs import METRICS_FILE, SUMMARY_FILE
from convoy.report.runs import (
    PERCENT_METRICS,
    SMOOTH_FROM_POINTS,
    SPLITS,
    ReportError,
    RunData,
    ema,
    epoch_metric_names,
    rank_series,
    series,
)

MANY_RANKS = 8
"""Above this many ranks, per-rank figures draw a band and the slowest rank, not a legend."""


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


# ---------------------------------------------------------------------------- figures


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


def _figure_class() -> Any:
    """matplotlib's ``Figure`` on the Agg canvas; a one-line error when it is not installed."""
    try:
        from matplotlib.figure import Figure  # the plot extra
    except ImportError:
        raise ReportError(missing_extra("convoy report", "matplotlib", "plot")) from None
    return Figure


def _new_figure(rows: int, cols: int = 1, height: float = 3.0, width: float = 9.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # the plot extra

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
    from matplotlib.lines import Line2D  # the plot extra

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


def figure_names() -> list[str]:
    """Every figure a report may hold, by file name (without ``.png``)."""
    return [
        "train_loss",
        "metrics",
        "lr",
        "throughput",
        *(spec.name for spec in RANK_FIGURES),
        "peak_memory",
    ]


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
