"""What a run leaves under ``<storage_dir>/<name>/`` (a local directory or an ``s3://`` prefix).

- ``config.yaml``: the resolved job, written by the launcher before any worker starts;
- ``metrics.jsonl``: one JSON record per logged step and per epoch, already aggregated over
  ranks; appended to, so a second attempt under the same name never erases the first;
- ``summary.json``: final metrics, wall time, throughput, data-wait fraction, peak memory.
Only rank 0 writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from convoy.config import Job, job_to_yaml
from convoy.storage import RunStorage

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TOKENIZER_FILE = "tokenizer.json"
"""A text run's tokenizer (HuggingFace ``tokenizers`` JSON): the BPE it trained, or the model
folder's (``data.tokenizer: model``; ``config.yaml`` records the folder as
``data.tokenizer_path``); exports copy it."""


def write_config(job: Job) -> RunStorage:
    """Save the resolved config in the run directory; returns the run's storage."""
    storage = RunStorage.at(job.run_uri)
    storage.write_text(CONFIG_FILE, job_to_yaml(job))
    return storage


def read_summary(run: str | Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(RunStorage.at(run).read_text(SUMMARY_FILE))
    return summary


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    storage = RunStorage.at(run)
    if not storage.exists(METRICS_FILE):
        return []
    text = storage.read_text(METRICS_FILE)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class RunOutputs:
    """Rank 0's writer for ``metrics.jsonl`` and ``summary.json`` (no-op on other ranks)."""

    def __init__(self, storage: RunStorage, enabled: bool) -> None:
        self.storage = storage
        self.enabled = enabled

    def log(self, record: dict[str, Any]) -> None:
        if self.enabled:
            line = json.dumps({"time": time.time(), **record}) + "\n"
            self.storage.append_text(METRICS_FILE, line)

    def write_file(self, name: str, text: str) -> None:
        """A file of the run directory that the data or model hands over (a tokenizer)."""
        if self.enabled:
            self.storage.write_text(name, text)

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.enabled:
            self.storage.write_text(SUMMARY_FILE, json.dumps(summary, indent=2))
