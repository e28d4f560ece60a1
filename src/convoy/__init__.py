"""Convoy: distributed PyTorch training on Ray.

One YAML recipe describes a job; ``strategy.name`` picks how state is split (single, ddp,
fsdp, fsdp2) and ``scaling.launcher`` picks where workers run (local, torchrun, ray). Ray is
optional: this package and the local/torchrun launchers import without it.
"""

from convoy.config import Job, load_job
from convoy.errors import ConfigError, ConvoyError
from convoy.launchers import get_launcher
from convoy.launchers.base import RunResult

__version__ = "0.1.0"


def train(job: Job) -> RunResult:
    """Run ``job`` with the launcher it names and return a ``RunResult``."""
    return get_launcher(job.scaling.launcher).launch(job)


__all__ = ["ConfigError", "ConvoyError", "Job", "RunResult", "__version__", "load_job", "train"]
