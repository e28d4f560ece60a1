"""Pieces the benchmarks share: byte sizes, step-time statistics, tables, job loading."""

from __future__ import annotations

import math
import re
import secrets
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from convoy.config import Job, ScalingConfig, apply_overrides, job_from_dict, load_job, world_sizes
from convoy.errors import ConfigError
from convoy.storage import check_writable_dir

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"(\d+)\s*([KMGT]?)(I?B)?", re.IGNORECASE)
SIZE_FORMS = (
    "expected bytes as an integer with an optional binary suffix, e.g. 8, 64K, 32M, 1G (K = 1024)"
)


def parse_size(text: str, flag: str) -> int:
    """``"32M"`` -> 33554432 (binary units, as nccl-tests' ``-b``/``-e``); ``flag`` names the
    option in the error."""
    match = _SIZE.fullmatch(str(text).strip())
    if not match:
        raise ConfigError(flag, text, SIZE_FORMS)
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_bytes(size: float) -> str:
    """A byte count in binary units: 8 B, 64 KiB, 32 MiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size:.0f} B"


def parse_int_list(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]: distinct integers >= ``minimum``, in the order given."""
    try:
        values = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values) or len(set(values)) != len(values):
        raise ConfigError(
            flag, text, f"expected distinct integers >= {minimum}, comma-separated, e.g. 1,2,4"
        )
    return values


def check_at_least(value: int, flag: str, minimum: int) -> int:
    """Refuse ``value < minimum`` with an error naming ``flag``."""
    if value < minimum:
        raise ConfigError(flag, value, f"expected an integer >= {minimum}")
    return value


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation, as the engine's summary computes it."""
    if not values:
        raise ValueError("no values")
    return float(np.quantile(values, q))


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, p10 and p90 of ``values``."""
    return {
        "median": statistics.median(values),
        "p10": quantile(values, 0.1),
        "p90": quantile(values, 0.9),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers are expected already formatted as text."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def bench_name(kind: str) -> str:
    """A unique directory name for one benchmark: ``<kind>-<timestamp>-<id>``."""
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def bench_storage(job: Job, out: str | None) -> str:
    """Where a benchmark's runs go: ``--out``, else ``<run.storage_dir>/bench``; a local one is
    checked (it can be created) before anything launches."""
    if out:
        check_writable_dir(out, "--out")
        return out
    storage = job.run.storage_dir
    if storage.startswith("s3://"):
        return f"{storage.rstrip('/')}/bench"
    check_writable_dir(storage, "run.storage_dir")
    return str(Path(storage) / "bench")


def load_job_without_data(recipe: str | None, overrides: list[str]) -> Job:
    """The recipe's job for a benchmark that uses only its scaling section (all-reduce).

    The global batch is irrelevant there, so it is set to split over every world size the
    scaling allows instead of refusing, say, 3 workers for a recipe's batch of 32.
    """
    data = apply_overrides(load_job(recipe).model_dump(mode="json"), overrides)
    try:
        scaling = ScalingConfig.model_validate(data.get("scaling", {}))
    except ValidationError:
        return job_from_dict(data)  # raises the usual one-paragraph error
    data.setdefault("data", {})["batch_size"] = math.lcm(*world_sizes(scaling))
    data.setdefault("optim", {})["grad_accum_steps"] = 1
    return job_from_dict(data)
