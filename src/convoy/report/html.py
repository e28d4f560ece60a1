"""The report's page: the summary table, ``report.html`` with the figures inline, and
``make_report`` (read, draw, write).
"""

from __future__ import annotations

import base64
import html
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from convoy.report.figures import Report, _figure_class, build_report, figure_names
from convoy.report.runs import (
    COUNT_METRICS,
    HTML_FILE,
    PERCENT_METRICS,
    SPLITS,
    ReportError,
    RunData,
    default_out_dir,
    load_runs,
)

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
        # A figure an earlier report into this folder drew, and this one does not, would be
        # taken for part of this report.
        drawn = {plot.name for plot in report.plots}
        for name in set(figure_names()) - drawn:
            (out / f"{name}.png").unlink(missing_ok=True)
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
