"""How long a training pod may take to stop: ``terminationGracePeriodSeconds``, from the
planned checkpoint time, and the warning when the last measured save took longer.

On a stop (a spot reclaim, a node drain, ``kubectl delete``) Kubernetes runs the pod's
preStop hook, sends its container SIGTERM, and kills it when the grace period ends. Convoy
saves the step it finished in that time (``convoy.engine.stop``), so the grace period must
hold a save:

- planned: the checkpoint bytes one pod writes (its share of the model and optimizer state;
  a replicated strategy's whole state, as one pod may write all of it), at
  ``PLANNED_WRITE_BYTES_PER_S``, times ``SAFETY``, plus ``STOP_MARGIN_S`` for the step in
  flight, the ranks' agreement and the commit;
- measured: every checkpoint's meta records how long its save took (``save_seconds``);
  ``convoy k8s validate`` compares the rendered grace period with the run's latest one.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from convoy.checkpoint_listing import committed_checkpoints, read_meta
from convoy.config import Job, job_from_dict
from convoy.storage import RunStorage

PLANNED_WRITE_BYTES_PER_S = 100 * 2**20
"""A conservative write rate from one pod to shared storage (a network volume or S3)."""
SAFETY = 2.0
STOP_MARGIN_S = 30.0
"""Kubernetes' own default grace period: the floor."""
PRESTOP_MARGIN_S = 5
"""A Ray worker pod's preStop hook drains its node for the grace period less this, so the
SIGTERM that follows still finds time to end Ray."""
DEFAULT_GRACE_S = 30
"""What Kubernetes gives a pod that sets no grace period."""

OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
"""Optimizer state per fp32 parameter: two moments (Adam), one momentum buffer (SGD)."""


UNPLANNED_GRACE_S = 120
"""The grace period when the model cannot be built where the manifest is rendered (a user
module only the image has): the longest common spot notice (AWS, 2 minutes)."""


def grace_period_s(job: Job) -> int:
    """``k8s.termination_grace_s``, or the planned one."""
    if job.k8s.termination_grace_s is not None:
        return job.k8s.termination_grace_s
    planned = planned_save_seconds(job)
    if planned is None:
        return UNPLANNED_GRACE_S
    return math.ceil(STOP_MARGIN_S + SAFETY * planned)


def planned_save_seconds(job: Job) -> float | None:
    """Seconds one pod takes to write its checkpoint files at the planned write rate; None
    when the model cannot be built here."""
    written = checkpoint_bytes_per_pod(job)
    return None if written is None else written / PLANNED_WRITE_BYTES_PER_S


def checkpoint_bytes_per_pod(job: Job) -> int | None:
    """The model and optimizer state one pod writes: 4 bytes per fp32 parameter plus the
    optimizer's state, split over the pods where the strategy shards it."""
    from convoy.strategies import strategy_class  # torch: see _parameter_count

    count = _parameter_count(job.model_dump_json(include={"model", "data"}))
    if count is None:
        return None
    per_param = 4 + OPTIMIZER_STATE_BYTES.get(job.optim.name, 8)
    total = count * per_param
    pods = max(1, math.ceil(max_workers(job) / job.k8s.workers_per_pod))
    sharded = strategy_class(job.strategy.name).sharding.parameters
    return math.ceil(total / pods) if sharded else total


def max_workers(job: Job) -> int:
    workers = job.scaling.num_workers
    return workers if isinstance(workers, int) else max(workers)


@functools.lru_cache(maxsize=32)
def _parameter_count(model_and_data: str) -> int | None:
    """Parameters of the job's model, built on the meta device from the data's shapes
    (cached: a render builds it once per model and data); None when it cannot be built
    here."""
    # Heavy (torch; the planner's model building loads the tasks and torchmetrics): imported
    # only when a recipe is rendered, so `import convoy.cli` (every `convoy` command, the
    # preStop hook's `convoy k8s drain-node` among them) imports no torch.
    import torch

    from convoy.plan.model import build_raw, load_source

    try:
        job = job_from_dict(json.loads(model_and_data))
        source = load_source(job)
        with torch.device("meta"):
            model = build_raw(job, source.shape)
    except Exception:  # a user module or data only the image has
        return None
    return sum(p.numel() for p in model.parameters())


def grace_warnings(job: Job, manifests: list[dict[str, Any]]) -> list[str]:
    """A line for each pod template whose grace period is shorter than the run's last
    measured save (none when the run has no checkpoint yet, or its storage is out of reach
    from here)."""
    measured = last_measured_save(job)
    if measured is None:
        return []
    name, seconds = measured
    warnings = []
    for path, spec in pod_specs(manifests):
        grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        if grace < seconds:
            warnings.append(
                f"{path}.terminationGracePeriodSeconds: {grace} s is shorter than the last "
                f"measured save of run {job.run_uri} ({name}: {seconds:.1f} s); a stop would "
                "fall back to the checkpoint before it: raise k8s.termination_grace_s"
            )
    return warnings


def last_measured_save(job: Job) -> tuple[str, float] | None:
    """The latest committed checkpoint of the job's run and its save time, if readable."""
    try:
        storage = RunStorage.at(job.run_uri)
        found = committed_checkpoints(storage)
        if not found:
            return None
        seconds = read_meta(storage, found[-1]).get("save_seconds")
    except Exception:  # out of reach from here (no credentials, not mounted): nothing to say
        return None
    return (found[-1], float(seconds)) if seconds is not None else None


def pod_specs(manifests: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(path, pod spec) of every training pod template in the manifests."""
    found = []
    for manifest in manifests:
        spec = manifest.get("spec", {})
        kind = manifest.get("kind")
        if kind == "PyTorchJob":
            for role, replica in spec.get("pytorchReplicaSpecs", {}).items():
                found.append((f"{kind}.spec.pytorchReplicaSpecs.{role}.template.spec", replica))
            continue
        cluster = spec.get("rayClusterSpec", spec) if kind in ("RayJob", "RayCluster") else {}
        prefix = f"{kind}.spec" + (".rayClusterSpec" if kind == "RayJob" else "")
        for index, group in enumerate(cluster.get("workerGroupSpecs", [])):
            found.append((f"{prefix}.workerGroupSpecs[{index}].template.spec", group))
    return [(path, holder.get("template", {}).get("spec", {})) for path, holder in found]
