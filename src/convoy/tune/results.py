"""A finished (or interrupted) sweep's outputs: the ranked table, ``best.yaml``, the report.

Each trial's row comes from Ray Tune's record of it (its sampled values, the last value of
the metric, the last epoch it reported, its status) and from its run directory: a trial that
trained to the end has ``summary.json``, with the test metrics.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convoy.config import job_to_yaml, set_field
from convoy.errors import ConvoyError
from convoy.imports import installed, missing_extra
from convoy.outputs import METRICS_FILE, SUMMARY_FILE
from convoy.report import make_report
from convoy.tune.space import job_with
from convoy.tune.sweep import Sweep, SweepOutcome

BEST_FILE = "best.yaml"
RESULTS_FILE = "results.json"
REPORT_DIR = "report"
COUNTS = ("samples", "tokens", "bytes")
TEST_COLUMNS = 3


@dataclass(frozen=True)
class TrialRow:
    """One trial as the table shows it."""

    trial_id: str
    values: dict[str, Any]
    metric: float | None
    epochs: int
    status: str
    """finished, stopped (by ASHA), error, interrupted (started, ended by an interruption),
    or not started."""
    test: dict[str, float]
    run_dir: Path
    error: str | None = None

    @property
    def stopped_early(self) -> bool:
        return self.status == "stopped"


def collect_rows(sweep: Sweep, trials: list[Any]) -> list[TrialRow]:
    """The trials' rows, best first by the sweep's metric (trials without it last)."""
    stops = sweep.asha_stops
    stopped = set(stops.read_text().split()) if stops.is_file() else set()
    rows = [_row(sweep, trial, stopped) for trial in trials]
    sign = 1.0 if sweep.mode == "min" else -1.0

    def order(row: TrialRow) -> tuple[int, float]:
        if row.metric is None or math.isnan(row.metric):
            return 1, 0.0
        return 0, sign * row.metric

    return sorted(rows, key=order)


def _row(sweep: Sweep, trial: Any, stopped: set[str]) -> TrialRow:
    run_dir = sweep.sweep_dir / trial.trial_id
    analysis = trial.metric_analysis or {}
    last = analysis.get(sweep.metric, {}).get("last")
    epochs = int(analysis.get("epoch", {}).get("max", 0) or 0)
    summary_file = run_dir / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    status = trial_status(trial.status, summary is not None, trial.trial_id in stopped, analysis)
    metrics = (summary or {}).get("metrics", {})
    test = {
        k: float(v)
        for k, v in metrics.items()
        if k.startswith("test/") and k.partition("/")[2] not in COUNTS
    }
    if summary is not None and sweep.metric in metrics:
        last = metrics[sweep.metric]  # the run's own final value
    return TrialRow(
        trial_id=trial.trial_id,
        values={d.key: trial.config.get(d.key) for d in sweep.dims},
        metric=None if last is None else float(last),
        epochs=epochs,
        status=status,
        test=dict(sorted(test.items(), key=lambda kv: kv[0] != "test/loss")[:TEST_COLUMNS]),
        run_dir=run_dir,
        error=_error_line(trial) if status == "error" else None,
    )


def trial_status(tune_status: str, summary: bool, asha_stopped: bool, analysis: dict) -> str:
    """A trial's status for the table, from Tune's and the run's records.

    Only a trial ASHA recorded stopping is "stopped": one that Ctrl+C or SIGTERM ended is
    "interrupted" (Tune marks both TERMINATED), and one that never reported is "not started".
    ASHA's decision wins over the run's summary: a trial's workers may finish a short run
    while the stop is still on its way to them.
    """
    if tune_status == "ERROR":
        return "error"
    if asha_stopped:
        return "stopped"
    if summary:
        return "finished"
    if tune_status == "PENDING" and not analysis:
        return "not started"
    return "interrupted"


def unfinished(sweep: Sweep, rows: list[TrialRow]) -> bool:
    """Whether trials are left to run: one interrupted or not started, or one Tune never
    created (it creates them lazily, so an interrupted sweep may have fewer trials than
    planned). Tune marks a trial that an interruption ended TERMINATED, as one that
    finished; its run's summary tells them apart (``trial_status``)."""
    return len(rows) < sweep.trials or any(
        row.status in ("interrupted", "not started") for row in rows
    )


def interrupted(sweep: Sweep, outcome: SweepOutcome, rows: list[TrialRow]) -> bool:
    """Whether the sweep is to be resumed: Tune left a trial pending or running, or the rows
    say a trial did not finish (``unfinished``)."""
    return outcome.unended or unfinished(sweep, rows)


def footer(sweep: Sweep, rows: list[TrialRow], wall_seconds: float, concurrent: int) -> str:
    """The line under the table: trials run, how they ended, and what did not start."""
    counts = {s: sum(row.status == s for row in rows) for s in ("interrupted", "not started")}
    # Tune creates trials lazily: an interrupted sweep may not have created them all.
    unstarted = counts["not started"] + max(0, sweep.trials - len(rows))
    parts = [
        f"{len(rows) - counts['not started']} trial(s) in {wall_seconds:.0f} s, {concurrent} at once"
    ]
    if sweep.scheduler != "none":
        parts.append(f"{sum(row.stopped_early for row in rows)} stopped early by {sweep.scheduler}")
    if counts["interrupted"]:
        parts.append(f"{counts['interrupted']} interrupted")
    if unstarted:
        parts.append(f"{unstarted} of {sweep.trials} not started")
    return "; ".join(parts)


def _error_line(trial: Any) -> str:
    """The last line of the trial's error (Tune keeps the traceback in a file)."""
    path = getattr(trial, "error_file", None)
    try:
        text = Path(path).read_text() if path else ""
    except OSError:
        text = ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "failed (no error recorded)"


def format_table(sweep: Sweep, rows: list[TrialRow]) -> str:
    """The ranked table: trial, sampled values, metric, epochs, stopped, test metrics."""
    tests = list(dict.fromkeys(k for row in rows for k in row.test))
    head = ["#", "trial", *(d.key for d in sweep.dims), sweep.metric, "epochs", "status", *tests]
    body = [
        [
            str(rank),
            row.trial_id,
            *(_cell(row.values.get(d.key)) for d in sweep.dims),
            _cell(row.metric),
            f"{row.epochs}/{sweep.base.run.epochs}",
            f"stopped at {row.epochs}" if row.stopped_early else row.status,
            *(_cell(row.test.get(k)) for k in tests),
        ]
        for rank, row in enumerate(rows, 1)
    ]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in [head, *body]
    ]
    errors = [f"  {row.trial_id}: {row.error}" for row in rows if row.error]
    return "\n".join([*lines, *(["errors:", *errors] if errors else [])])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def best_row(rows: list[TrialRow]) -> TrialRow | None:
    """The top-ranked trial that has the metric."""
    return next((row for row in rows if row.metric is not None), None)


def write_best(sweep: Sweep, row: TrialRow) -> Path:
    """The best trial's recipe, resolved, as YAML that ``convoy train`` runs.

    It trains as a new run under the recipe's own ``run.storage_dir`` (unnamed: a fresh run
    directory), not in the trial's directory, which holds the trial's finished checkpoints.
    """
    recipe = set_field(sweep.recipe, "run.storage_dir", sweep.origin_storage_dir)
    job = job_with(recipe, row.values)
    shown = ", ".join(f"{k}={v!r}" for k, v in row.values.items())
    header = (
        f"# The best trial of sweep {sweep.name}: {row.trial_id} ({sweep.metric} "
        f"{_cell(row.metric)}, {row.status}).\n# Sampled: {shown}\n"
        f"# Train it: convoy train {sweep.sweep_dir / BEST_FILE}\n"
    )
    path = sweep.sweep_dir / BEST_FILE
    path.write_text(header + job_to_yaml(job))
    return path


def write_results(
    sweep: Sweep, outcome: SweepOutcome, rows: list[TrialRow], interrupted: bool
) -> Path:
    """The table as JSON (``results.json``), with the sweep's figures."""
    path = sweep.sweep_dir / RESULTS_FILE
    record = {
        "sweep": sweep.name,
        "metric": sweep.metric,
        "mode": sweep.mode,
        "wall_seconds": outcome.wall_seconds,
        "concurrent": outcome.concurrent,
        "placement_groups_left": outcome.placement_groups_left,
        "interrupted": interrupted,
        "trials": [
            {
                "trial_id": row.trial_id,
                "values": row.values,
                "metric": row.metric,
                "epochs": row.epochs,
                "status": row.status,
                "test": row.test,
                "error": row.error,
            }
            for row in rows
        ],
    }
    path.write_text(json.dumps(record, indent=2, default=str))
    return path


def _has_records(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def write_sweep_report(sweep: Sweep, rows: list[TrialRow]) -> str:
    """``convoy report`` over the trials that logged metrics, into ``<sweep>/report/``; returns
    the line to print (the page, or why there is none)."""
    if not installed("matplotlib"):
        return f"report: skipped; {missing_extra('the sweep report', 'matplotlib', 'plot')}"
    runs = [str(row.run_dir) for row in rows if _has_records(row.run_dir / METRICS_FILE)]
    if not runs:
        return "report: skipped (no trial logged metrics)"
    try:
        _, paths = make_report(runs, sweep.sweep_dir / REPORT_DIR)
    except ConvoyError as exc:
        return f"report: not written ({exc})"
    return f"report: {paths[-1]}"
