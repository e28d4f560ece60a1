"""Reading runs for ``convoy report``: ``load_run(s)`` (``metrics.jsonl`` and
``summary.json`` through ``RunStorage``), the last record per step, where the report goes,
and the series the figures draw.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
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
