"""Submit, follow, read logs of, delete and clean up Convoy's workloads on a cluster.

Everything here talks to an ``Api`` (``convoy.k8s.client``), never to the ``kubernetes``
package, so the same functions run against a fake in unit tests and a real API server in
cluster tests.

``gc`` deletes only what Convoy labelled (``app.kubernetes.io/managed-by: convoy``) and left
behind, by this rule:

1. a RayJob or PyTorchJob that finished (``Complete`` / ``Failed`` / ``ValidationFailed``,
   ``Succeeded`` / ``Failed``) longer ago than its own ``ttlSecondsAfterFinished`` (KubeRay
   deletes the cluster at the TTL but keeps the RayJob; a ValidationFailed job, which never
   ended, counts from its creation), together with its recipe ConfigMap;
2. a recipe ConfigMap whose run (``convoy.io/run-id``) has no RayJob, RayCluster or
   PyTorchJob left;
3. a RayCluster made for a RayJob (``convoy.io/kind: rayjob``, copied by KubeRay from the
   RayJob) whose RayJob is gone.
Objects of rules 2 and 3 must also be older than ``grace_s``: a submission in progress
creates its ConfigMap a moment before its workload. A RayCluster rendered on purpose
(``convoy.io/kind: raycluster``) is long-lived by choice and is never collected.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from convoy.k8s import K8sError, naming
from convoy.k8s.client import (
    BY_KIND,
    CONFIGMAP,
    POD,
    PYTORCHJOB,
    RAYCLUSTER,
    RAYJOB,
    AlreadyExists,
    Api,
    MissingKind,
    NotFound,
    Resource,
)
from convoy.k8s.status import WorkloadState, workload_state
from convoy.k8s.validate import check_manifests


def workload_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    workloads = [m for m in manifests if m.get("kind") != "ConfigMap"]
    if len(workloads) != 1:
        kinds = [m.get("kind") for m in manifests]
        raise K8sError(f"manifests: got kinds {kinds}; expected one workload and its ConfigMap")
    return workloads[0]


def submit(api: Api, manifests: list[dict[str, Any]], dry_run: bool = False) -> dict[str, Any]:
    """Validate, then create the recipe ConfigMap and the workload; returns the workload as
    created. The ConfigMap is then owned by the workload, so deleting one deletes both. A
    workload the server refuses takes its just-created ConfigMap back with it."""
    check_manifests(manifests)
    workload = workload_of(manifests)
    resource = BY_KIND[workload["kind"]]
    namespace = workload["metadata"]["namespace"]
    config_maps = [m for m in manifests if m.get("kind") == "ConfigMap"]
    created = []
    try:
        for config_map in config_maps:
            _create_recipe(api, namespace, config_map, workload, dry_run)
            created.append(config_map["metadata"]["name"])
        result = api.create(resource, namespace, workload, dry_run)
    except K8sError:
        for name in [] if dry_run else created:
            _delete_quietly(api, CONFIGMAP, namespace, name)
        raise
    if not dry_run:
        owner = {
            "apiVersion": resource.api_version,
            "kind": resource.kind,
            "name": result["metadata"]["name"],
            "uid": result["metadata"]["uid"],
        }
        for name in created:
            api.patch(CONFIGMAP, namespace, name, {"metadata": {"ownerReferences": [owner]}})
    return result


def _create_recipe(
    api: Api, namespace: str, config_map: dict[str, Any], workload: dict[str, Any], dry_run: bool
) -> None:
    try:
        api.create(CONFIGMAP, namespace, config_map, dry_run)
    except AlreadyExists:
        name = workload["metadata"]["name"]
        raise AlreadyExists(
            f"ConfigMap {namespace}/{config_map['metadata']['name']} already exists (409): a run "
            f"named {name} was submitted before; delete it (convoy k8s delete {name} -n "
            f"{namespace}) or rename the run (-o k8s.name=NEW or -o run.name=NEW)"
        ) from None


def _delete_quietly(api: Api, resource: Resource, namespace: str, name: str) -> None:
    with contextlib.suppress(K8sError):  # best effort: gc collects what is left
        api.delete(resource, namespace, name)


def state(api: Api, resource: Resource, namespace: str, name: str) -> WorkloadState:
    return workload_state(api.get(resource, namespace, name))


def follow(
    api: Api,
    resource: Resource,
    namespace: str,
    name: str,
    on_change: Callable[[WorkloadState], None],
    timeout_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> WorkloadState:
    """Watch one workload until it is terminal, calling ``on_change`` on every new state;
    returns the terminal state. Raises ``K8sError`` if it is deleted or time runs out."""
    deadline = None if timeout_s is None else clock() + timeout_s
    obj = api.get(resource, namespace, name)
    current = workload_state(obj)
    on_change(current)
    while not current.terminal:
        if deadline is not None and clock() >= deadline:
            raise K8sError(
                f"{resource.kind} {namespace}/{name}: still {current.phase} after {timeout_s:g} s"
            )
        left = 300 if deadline is None else max(1, int(deadline - clock()))
        version = obj["metadata"]["resourceVersion"]
        for event, new in api.watch(resource, namespace, name, version, min(left, 300)):
            if event == "DELETED":
                raise K8sError(
                    f"{resource.kind} {namespace}/{name} was deleted while {current.phase}"
                )
            if event == "ERROR":
                break  # the watched version expired: read the object again
            obj = new
            current = _changed(current, workload_state(obj), on_change)
            if current.terminal:
                return current
        obj = api.get(resource, namespace, name)  # the stream ended: resync, then watch on
        current = _changed(current, workload_state(obj), on_change)
    return current


def _changed(
    old: WorkloadState, new: WorkloadState, on_change: Callable[[WorkloadState], None]
) -> WorkloadState:
    if new != old:
        on_change(new)
    return new


# Where each workload's logs come from: a RayJob's submitter Job (``ray job submit`` tails
# the driver's output), a PyTorchJob's worker 0, a RayCluster's head.
LOG_PODS = {
    "RayJob": ("submitter", "job-name={name}"),
    "PyTorchJob": (
        "worker 0",
        "training.kubeflow.org/job-name={name},training.kubeflow.org/replica-index=0",
    ),
    "RayCluster": ("head", "ray.io/cluster={name},ray.io/node-type=head"),
}


def logs(
    api: Api, resource: Resource, namespace: str, name: str, tail_lines: int | None = None
) -> str:
    """The logs of the pod that shows the run's output (the newest, after retries)."""
    role, selector = LOG_PODS[resource.kind]
    pods = api.list(POD, namespace, selector.format(name=name))
    if not pods:
        now = state(api, resource, namespace, name)  # NotFound if the workload is gone too
        raise K8sError(
            f"no {role} pod for {resource.kind} {namespace}/{name} yet ({now.phase}); the "
            f"operator starts it once the Ray cluster is up; see convoy k8s status {name}"
        )
    newest = max(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""))
    pod = newest["metadata"]["name"]
    status = newest.get("status") or {}
    if status.get("phase", "Pending") == "Pending":
        waiting = [
            c["state"]["waiting"].get("reason", "")
            for c in status.get("containerStatuses") or []
            if (c.get("state") or {}).get("waiting")
        ]
        why = f" ({', '.join(waiting)})" if any(waiting) else ""
        raise K8sError(
            f"no logs from pod {namespace}/{pod} yet: it is Pending{why}, not started; "
            f"see kubectl describe pod {pod} -n {namespace}"
        )
    return api.pod_logs(namespace, pod, tail_lines)


def delete(api: Api, resource: Resource, namespace: str, name: str) -> list[str]:
    """Delete the workload and its recipe ConfigMap (only if Convoy made it)."""
    deleted = []
    try:
        api.delete(resource, namespace, name)
        deleted.append(f"{resource.kind} {namespace}/{name}")
    except NotFound:
        pass
    config_map = naming.recipe_configmap_name(name)
    try:
        labels = api.get(CONFIGMAP, namespace, config_map)["metadata"].get("labels") or {}
        if labels.get(naming.MANAGED_BY) == naming.CONVOY:
            api.delete(CONFIGMAP, namespace, config_map)
            deleted.append(f"ConfigMap {namespace}/{config_map}")
    except NotFound:
        pass
    if not deleted:
        raise NotFound(f"{resource.kind} {namespace}/{name} not found (nor its recipe ConfigMap)")
    return deleted


# ---------------------------------------------------------------------------------------------
# gc


@dataclass(frozen=True)
class Leftover:
    resource: Resource
    name: str
    why: str

    def line(self) -> str:
        return f"{self.resource.kind} {self.name}: {self.why}"


def leftovers(api: Api, namespace: str, now: datetime, grace_s: float = 600) -> list[Leftover]:
    """What ``gc`` would delete in ``namespace`` (the rule is in this module's docstring)."""
    mine = naming.selector()
    found = {r.kind: _list_known(api, r, namespace, mine) for r in (RAYJOB, RAYCLUSTER, PYTORCHJOB)}
    config_maps = api.list(CONFIGMAP, namespace, mine)
    out = []
    for resource in (RAYJOB, PYTORCHJOB):
        for obj in found[resource.kind]:
            why = _expired(obj, now)
            if why:
                out.append(Leftover(resource, obj["metadata"]["name"], why))
    expired = {(item.resource.kind, item.name) for item in out}
    job_runs = {
        _run_id(obj)
        for obj in found["RayJob"]
        if ("RayJob", obj["metadata"]["name"]) not in expired
    }
    for obj in found["RayCluster"]:
        made_by_job = obj["metadata"].get("labels", {}).get(naming.KIND) == "rayjob"
        if made_by_job and _run_id(obj) not in job_runs and _age_s(obj, now) > grace_s:
            out.append(Leftover(RAYCLUSTER, obj["metadata"]["name"], "its RayJob is gone"))
    gone = {(item.resource.kind, item.name) for item in out}
    live_runs = {
        _run_id(obj)
        for kind, objs in found.items()
        for obj in objs
        if (kind, obj["metadata"]["name"]) not in gone
    }
    for obj in config_maps:
        if _run_id(obj) not in live_runs and _age_s(obj, now) > grace_s:
            out.append(Leftover(CONFIGMAP, obj["metadata"]["name"], "its run has no workload left"))
    return out


def gc(
    api: Api,
    namespace: str,
    now: datetime | None = None,
    grace_s: float = 600,
    dry_run: bool = False,
) -> list[Leftover]:
    """Delete (or with ``dry_run`` only list) what Convoy left behind in ``namespace``."""
    found = leftovers(api, namespace, now or datetime.now(timezone.utc), grace_s)
    if not dry_run:
        for item in found:
            with contextlib.suppress(NotFound):  # deleted meanwhile (by its owner, a TTL)
                api.delete(item.resource, namespace, item.name)
    return found


def _list_known(
    api: Api, resource: Resource, namespace: str, selector: str
) -> list[dict[str, Any]]:
    try:
        return api.list(resource, namespace, selector)
    except MissingKind:
        return []  # no operator for this kind: nothing of it to collect


def _run_id(obj: dict[str, Any]) -> str:
    return str((obj["metadata"].get("labels") or {}).get(naming.RUN_ID, ""))


def _expired(obj: dict[str, Any], now: datetime) -> str:
    """Why a finished job is past its TTL, or "" if it is not."""
    current = workload_state(obj)
    if not current.terminal:
        return ""
    status, spec = obj.get("status") or {}, obj.get("spec") or {}
    ttl = spec.get(
        "ttlSecondsAfterFinished", spec.get("runPolicy", {}).get("ttlSecondsAfterFinished")
    )
    ended = status.get("endTime") or status.get("completionTime")
    since = _parse_time(ended) if ended else _parse_time(obj["metadata"]["creationTimestamp"])
    age = (now - since).total_seconds()
    if age <= (ttl or 0):
        return ""
    return f"{current.phase} {age:.0f} s ago, past its TTL of {ttl or 0} s"


def _age_s(obj: dict[str, Any], now: datetime) -> float:
    return (now - _parse_time(obj["metadata"]["creationTimestamp"])).total_seconds()


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))
