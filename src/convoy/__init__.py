"""Convoy: distributed PyTorch training on Ray.

One YAML recipe describes a job; ``strategy.name`` picks how state is split (single, ddp,
fsdp, fsdp2) and ``scaling.launcher`` picks where workers run (local, torchrun, ray). Ray is
optional: this package and the local/torchrun launchers import without it.

``import convoy`` itself imports nothing heavy: the names below load on first use, so a
process that needs one Convoy module (Ray Train's controller unpickling the run's backend,
``convoy --help``) does not import torch for the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from convoy.config import Job, load_job
    from convoy.errors import ConfigError, ConvoyError
    from convoy.launchers.base import RunResult

__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "Job": "convoy.config",
    "load_job": "convoy.config",
    "ConfigError": "convoy.errors",
    "ConvoyError": "convoy.errors",
    "RunResult": "convoy.launchers.base",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'convoy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def train(job: Job) -> RunResult:
    """Run ``job`` with the launcher it names and return a ``RunResult``."""
    from convoy.launchers import get_launcher

    return get_launcher(job.scaling.launcher).launch(job)


__all__ = ["ConfigError", "ConvoyError", "Job", "RunResult", "__version__", "load_job", "train"]
