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


def cached(kind: str, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON value, kept in the cache under a digest of ``key``; computed once
    per machine at a time (other processes wait on the lock, then read it)."""
    path = _entry(kind, key, ".json")
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(value))
        partial.replace(path)
        return value


def cached_arrays(
    kind: str, key: Any, compute: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """``compute()``'s named arrays (numbers or strings, no objects), kept as an ``.npz``
    under a digest of ``key``. Where the cache cannot be written (a read-only home), they are
    computed in this process instead: the cache saves time, it is never needed."""
    try:
        path = _entry(kind, key, ".npz")
        lock = FileLock(str(path) + ".lock")
        lock.acquire()
    except OSError:
        return compute()
    try:
        if path.is_file():
            with np.load(path, allow_pickle=False) as stored:
                return {name: stored[name] for name in stored.files}
        arrays = compute()
        partial = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(partial, allow_pickle=False, **arrays)
        partial.replace(path)
        return arrays
    finally:
        lock.release()
