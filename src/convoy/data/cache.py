"""The per-machine cache of derived data (``CONVOY_CACHE_DIR``, default ``~/.cache/convoy``).

Values are computed once per machine and key, under a file lock: the ranks of a machine (and
the runs started together on it) wait for the first, then read its file. ``cached`` keeps JSON
values (token counts, a trained tokenizer); ``cached_arrays`` keeps numpy arrays (the bundled
datasets decoded once, so a worker need not import the library that ships them).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock


def cache_dir() -> Path:
    return Path(os.environ.get("CONVOY_CACHE_DIR") or Path.home() / ".cache" / "convoy")


def _entry(kind: str, key: Any, suffix: str) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    folder = cache_dir() / kind
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{digest}{suffix}"


def _compute_once(
    path: Path,
    compute: Callable[[], Any],
    read: Callable[[Path], Any],
    write: Callable[[Path, Any], object],
) -> Any:
    """``read(path)`` if it exists, else ``compute()`` written there (through a temporary file
    renamed into place), under the path's lock: one process of a machine computes, the others
    wait and read."""
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return read(path)
        value = compute()
        partial = path.with_name(f"{path.stem}.{os.getpid()}.tmp{path.suffix}")
        write(partial, value)
        partial.replace(path)
        return value


def cached(kind: str, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON value, kept in the cache under a digest of ``key``; computed once
    per machine at a time (other processes wait on the lock, then read it)."""
    return _compute_once(
        _entry(kind, key, ".json"),
        compute,
        lambda path: json.loads(path.read_text()),
        lambda path, value: path.write_text(json.dumps(value)),
    )


def cached_arrays(
    kind: str, key: Any, compute: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """``compute()``'s named arrays (numbers or strings, no objects), kept as an ``.npz``
    under a digest of ``key``. Where the cache cannot be written (a read-only home), they are
    computed in this process instead: the cache saves time, it is never needed."""
    try:
        path = _entry(kind, key, ".npz")
    except OSError:
        return compute()
    arrays: dict[str, np.ndarray] = _compute_once(path, compute, _read_arrays, _write_arrays)
    return arrays


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as stored:
        return {name: stored[name] for name in stored.files}


def _write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    np.savez(path, allow_pickle=False, **arrays)
