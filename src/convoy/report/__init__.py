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

Files, by idea:

- ``runs``: reading run directories (``load_run``, ``load_runs``, ``parse_metrics``,
  ``last_per``), where the report goes, and the series the figures draw;
- ``figures``: the matplotlib figures, rendered by ``build_report``;
- ``html``: the summary table, ``report.html`` and ``make_report``.
"""

from __future__ import annotations

from convoy.report.figures import (
    MANY_RANKS,
    RANK_FIGURES,
    SPLIT_STYLES,
    Plot,
    RankFigure,
    Report,
    build_report,
    plot_epoch_metrics,
    plot_lr,
    plot_peak_memory,
    plot_per_rank,
    plot_throughput,
    plot_train_loss,
)
from convoy.report.html import (
    STYLE,
    SUMMARY_ROWS,
    final_metrics,
    make_report,
    render_html,
    summary_table,
    write_report,
)
from convoy.report.runs import (
    COUNT_METRICS,
    HTML_FILE,
    PERCENT_METRICS,
    REPORT_DIR,
    RUN_FILES,
    SMOOTH_FROM_POINTS,
    SPLITS,
    ReportError,
    RunData,
    default_out_dir,
    ema,
    epoch_metric_names,
    last_per,
    load_run,
    load_runs,
    parse_metrics,
    rank_series,
    series,
)

__all__ = [
    "COUNT_METRICS",
    "HTML_FILE",
    "MANY_RANKS",
    "PERCENT_METRICS",
    "RANK_FIGURES",
    "REPORT_DIR",
    "RUN_FILES",
    "SMOOTH_FROM_POINTS",
    "SPLITS",
    "SPLIT_STYLES",
    "STYLE",
    "SUMMARY_ROWS",
    "Plot",
    "RankFigure",
    "Report",
    "ReportError",
    "RunData",
    "build_report",
    "default_out_dir",
    "ema",
    "epoch_metric_names",
    "final_metrics",
    "last_per",
    "load_run",
    "load_runs",
    "make_report",
    "parse_metrics",
    "plot_epoch_metrics",
    "plot_lr",
    "plot_peak_memory",
    "plot_per_rank",
    "plot_throughput",
    "plot_train_loss",
    "rank_series",
    "render_html",
    "series",
    "summary_table",
    "write_report",
]
