"""What state a Convoy workload is in, read from its ``status`` as its operator writes it.

A RayJob has no ``status.conditions``: its source of truth is ``jobDeploymentStatus`` plus
``reason`` (KubeRay can leave ``jobStatus: RUNNING`` on a job whose deployment ``Failed``,
kuberay#2314), so ``jobStatus`` is shown second. While the job is Initializing the operator
copies the RayCluster's status in, and its conditions (``HeadPodReady``,
``RayClusterProvisioned``, ``ReplicaFailure``) say why it is stuck. ``ValidationFailed`` is
terminal in practice: the operator never leaves it, the job must be deleted and recreated.
A PyTorchJob is read from its last true condition; a RayCluster from ``state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RAYJOB_TERMINAL = {"Complete": True, "Failed": False, "ValidationFailed": False}
"""Terminal deployment statuses, and whether each means success."""
PYTORCHJOB_TERMINAL = {"Succeeded": True, "Failed": False}


@dataclass(frozen=True)
class WorkloadState:
    kind: str
    name: str
    phase: str
    """jobDeploymentStatus (RayJob), the last true condition (PyTorchJob), state (RayCluster);
    "New" before the operator has written anything."""
    reason: str = ""
    message: str = ""
    job_status: str = ""
    """Ray's own status of the job (RayJob only), secondary to ``phase``."""
    terminal: bool = False
    succeeded: bool = False
    details: tuple[str, ...] = field(default_factory=tuple)
    """Conditions that explain a stall (the RayCluster's, while Initializing)."""

    def line(self) -> str:
        """One status line, e.g. ``RayJob digits: Failed (DeadlineExceeded), job FAILED``."""
        text = f"{self.kind} {self.name}: {self.phase}"
        if self.reason:
            text += f" ({self.reason})"
        if self.job_status:
            text += f", job {self.job_status}"
        if self.message:
            text += f": {self.message}"
        return text

    def lines(self) -> list[str]:
        return [self.line(), *(f"  {d}" for d in self.details)]


def workload_state(obj: dict[str, Any]) -> WorkloadState:
    kind = obj.get("kind", "")
    if kind == "RayJob":
        return rayjob_state(obj)
    if kind == "PyTorchJob":
        return pytorchjob_state(obj)
    return raycluster_state(obj)


def rayjob_state(obj: dict[str, Any]) -> WorkloadState:
    status = obj.get("status") or {}
    phase = status.get("jobDeploymentStatus") or "New"
    details: tuple[str, ...] = ()
    if phase in ("New", "Initializing", "Waiting"):
        details = _conditions((status.get("rayClusterStatus") or {}).get("conditions", []))
    if phase == "ValidationFailed":
        name = obj["metadata"]["name"]
        details = (
            "the operator never retries this: fix the manifest (convoy k8s validate FILE), "
            f"then convoy k8s delete {name} and submit again",
        )
    return WorkloadState(
        kind="RayJob",
        name=obj["metadata"]["name"],
        phase=phase,
        reason=status.get("reason", ""),
        message=status.get("message", ""),
        job_status=status.get("jobStatus", ""),
        terminal=phase in RAYJOB_TERMINAL,
        succeeded=RAYJOB_TERMINAL.get(phase, False),
        details=details,
    )


def pytorchjob_state(obj: dict[str, Any]) -> WorkloadState:
    conditions = (obj.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    last = true[-1] if true else {}
    phase = last.get("type", "New")
    return WorkloadState(
        kind="PyTorchJob",
        name=obj["metadata"]["name"],
        phase=phase,
        reason=last.get("reason", ""),
        message=last.get("message", ""),
        terminal=phase in PYTORCHJOB_TERMINAL,
        succeeded=PYTORCHJOB_TERMINAL.get(phase, False),
    )


def raycluster_state(obj: dict[str, Any]) -> WorkloadState:
    status = obj.get("status") or {}
    return WorkloadState(
        kind="RayCluster",
        name=obj["metadata"]["name"],
        phase=status.get("state") or "New",
        reason=status.get("reason", ""),
        details=_conditions(status.get("conditions", [])),
    )


def _conditions(conditions: list[dict[str, Any]]) -> tuple[str, ...]:
    return tuple(
        f"{c.get('type')}={c.get('status')}"
        + (f" ({c['reason']})" if c.get("reason") else "")
        + (f": {c['message']}" if c.get("message") else "")
        for c in conditions
    )
