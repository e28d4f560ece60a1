"""What a run leaves on disk under ``<storage_dir>/<name>/``.

- ``config.yaml``: the resolved job, written by the launcher before any worker starts;
- ``metrics.jsonl``: one JSON record per logged step and per epoch, already aggregated over
  ranks; appended to, so a second attempt under the same name never erases the first;
- ``summary.json``: final metrics, wall time, throughput, data-wait fraction, peak memory.
Only rank 0 writes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from convoy.config import Job, job_to_yaml

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def write_config(job: Job) -> Path:
    """Create the run directory and save the resolved config; returns the directory."""
    run_dir = job.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / CONFIG_FILE, job_to_yaml(job))
    return run_dir


def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class RunOutputs:
    """Rank 0's writer for ``metrics.jsonl`` and ``summary.json`` (no-op on other ranks)."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with (self.run_dir / METRICS_FILE).open("a") as handle:
            handle.write(json.dumps({"time": time.time(), **record}) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            atomic_write(self.run_dir / SUMMARY_FILE, json.dumps(summary, indent=2))


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary sibling and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
