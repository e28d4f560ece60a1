"""The numbers a job asks of a cluster, and the numbers a manifest spells as text.

Worker pods, CPUs and GPUs per pod are read from the job here, once, so that rendering a
manifest and checking a job (``job_checks``) or a rendered set (``consistency``) count
alike; Kubernetes quantities (``500m``, ``8Gi``) and Ray versions are parsed here too.
"""

from __future__ import annotations

import math
import re

from convoy.config import Job

_SUFFIXES = {
    "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}  # fmt: skip


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (``500m``, ``8Gi``, ``2``) as a number."""
    value = str(text)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(value)


def quantity(value: float) -> str:
    """A number as a Kubernetes quantity: whole numbers as they are, others in thousandths."""
    return str(int(value)) if float(value).is_integer() else f"{round(value * 1000)}m"


def version_tuple(text: str) -> tuple[int, ...]:
    """A version's first three numbers (``"2.52.0"`` -> ``(2, 52, 0)``); ``(0,)`` for none."""
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if parts else (0,)


def pod_range(job: Job) -> tuple[int, int]:
    """(min, max) worker pods for the (possibly elastic) number of train workers."""
    per_pod = job.k8s.workers_per_pod
    low = math.ceil(job.scaling.min_workers / per_pod)
    high = math.ceil(job.scaling.max_workers / per_pod)
    return low, high


def worker_cpu(job: Job) -> float:
    """CPUs of one worker pod: ``k8s.worker_cpu``, or what its train workers ask for."""
    return job.k8s.worker_cpu or job.scaling.cpus_per_worker * job.k8s.workers_per_pod


def worker_gpus(job: Job) -> int:
    """GPUs of one worker pod: ``k8s.worker_gpus``, or what its train workers ask for."""
    if job.k8s.worker_gpus is not None:
        return job.k8s.worker_gpus
    if not job.scaling.use_gpu:
        return 0
    return math.ceil((job.scaling.gpus_per_worker or 1.0) * job.k8s.workers_per_pod)
