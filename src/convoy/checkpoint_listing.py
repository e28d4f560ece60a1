"""A run's checkpoints as files: their names and paths, which of them committed (their
``meta.json`` is there), what their meta says, and a local copy of one. Saving and loading
them is ``convoy.checkpoint``'s; this module imports no torch, so that a command that only
looks at a run's checkpoints (``convoy k8s validate``'s grace-period check, the resume hint
after a failed Ray run) does not pay torch's distributed checkpointing's import.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from convoy.storage import RunStorage

CHECKPOINT_DIR = "checkpoints"
META_FILE = "meta.json"
_STEP_NAME = re.compile(r"^step_(\d{8})$")

RunLocation = str | Path | RunStorage


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_path(name: str) -> str:
    """A checkpoint's path relative to the run directory."""
    return f"{CHECKPOINT_DIR}/{name}"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def storage_of(run: RunLocation) -> RunStorage:
    """The run's storage, from its directory, its URI or the storage itself."""
    return run if isinstance(run, RunStorage) else RunStorage.at(run)


def _saved_steps(storage: RunStorage) -> list[str]:
    return [n for n in storage.list_dirs(CHECKPOINT_DIR) if _STEP_NAME.match(n)]


def committed_checkpoints(run: RunLocation) -> list[str]:
    """Names of the committed checkpoints of a run, oldest first."""
    storage = storage_of(run)
    return [n for n in _saved_steps(storage) if storage.exists(f"{checkpoint_path(n)}/{META_FILE}")]


def partial_checkpoints(run: RunLocation) -> list[str]:
    """Names of checkpoints whose save never committed."""
    storage = storage_of(run)
    return [
        n for n in _saved_steps(storage) if not storage.exists(f"{checkpoint_path(n)}/{META_FILE}")
    ]


def read_meta(run: RunLocation, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads(
        storage_of(run).read_text(f"{checkpoint_path(name)}/{META_FILE}")
    )
    return meta


@contextlib.contextmanager
def local_copy(run: RunLocation, name: str) -> Iterator[Path]:
    """A checkpoint as a local directory: in place on local disk, downloaded from S3."""
    storage = storage_of(run)
    path = storage.local_path(checkpoint_path(name))
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=f"convoy-{name}-") as tmp:
        storage.download(checkpoint_path(name), Path(tmp))
        yield Path(tmp)
