"""The control logic of ``convoy k8s`` (submit, follow, logs, delete, gc) against a scriptable
fake ``Api``; the same functions run against a real API server in tests/cluster/k8s."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from convoy.config import load_job
from convoy.k8s import K8sError, control
from convoy.k8s.client import (
    CONFIGMAP,
    POD,
    PYTORCHJOB,
    RAYCLUSTER,
    RAYJOB,
    AlreadyExists,
    MissingKind,
    NotFound,
    Resource,
    explain,
)
from convoy.k8s.render import render
from convoy.k8s.status import rayjob_state

REPO = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 11, 23, 12, 0, tzinfo=timezone.utc)


class FakeApi:
    """Objects in a dict; ``watch`` plays queued event lists, one per call."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.streams: list[list[tuple[str, dict[str, Any]]]] = []
        self.refuse: dict[str, K8sError] = {}
        self.missing: set[str] = set()
        self.logs: dict[str, str] = {}
        self.uids = itertools.count()

    def create(self, resource: Resource, namespace: str, body: dict[str, Any], dry_run=False):
        if resource.kind in self.refuse:
            raise self.refuse[resource.kind]
        key = (resource.kind, namespace, body["metadata"]["name"])
        if key in self.objects:
            raise AlreadyExists(f"{key} exists")
        stored = {**body, "kind": resource.kind}
        stored["metadata"] = {
            **body["metadata"],
            "uid": f"uid-{next(self.uids)}",
            "resourceVersion": "1",
        }
        if not dry_run:
            self.objects[key] = stored
        return stored

    def get(self, resource: Resource, namespace: str, name: str):
        if resource.kind in self.missing:
            raise MissingKind(resource.kind)
        try:
            return self.objects[(resource.kind, namespace, name)]
        except KeyError:
            raise NotFound(f"{resource.kind} {namespace}/{name} not found") from None

    def list(self, resource: Resource, namespace: str, label_selector: str = ""):
        if resource.kind in self.missing:
            raise MissingKind(resource.kind)
        wanted = dict(p.split("=", 1) for p in label_selector.split(",") if p)
        return [
            o
            for (kind, ns, _), o in self.objects.items()
            if kind == resource.kind
            and ns == namespace
            and wanted.items() <= (o["metadata"].get("labels") or {}).items()
        ]

    def patch(self, resource: Resource, namespace: str, name: str, body: dict[str, Any]):
        obj = self.get(resource, namespace, name)
        obj["metadata"].update(body.get("metadata", {}))
        return obj

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        self.get(resource, namespace, name)
        del self.objects[(resource.kind, namespace, name)]

    def watch(self, resource, namespace, name, resource_version, timeout_s) -> Iterator:
        yield from self.streams.pop(0) if self.streams else []

    def pod_logs(self, namespace: str, pod: str, tail_lines=None) -> str:
        return self.logs[pod]


def manifests(name: str = "digits-vit", kind: str = "rayjob", *overrides: str):
    job = load_job(
        REPO / "recipes" / "default.yaml",
        [
            "k8s.image=registry.example.com/convoy:0.1.0",
            "k8s.pvc=runs",
            f"run.name={name}",
            *overrides,
        ],
    )
    return render(job, kind)


def rayjob(status: dict[str, Any], name: str = "digits-vit") -> dict[str, Any]:
    return {"kind": "RayJob", "metadata": {"name": name, "resourceVersion": "2"}, "status": status}


def test_submit_creates_the_recipe_first_and_hands_it_to_the_workload():
    api = FakeApi()
    created = control.submit(api, manifests())
    config_map = api.get(CONFIGMAP, "default", "digits-vit-recipe")
    assert config_map["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "name": "digits-vit",
            "uid": created["metadata"]["uid"],
        }
    ]
    assert created["metadata"]["uid"] == "uid-1"  # the ConfigMap was uid-0: created first


def test_submit_validates_before_sending_anything():
    api = FakeApi()
    bad = manifests()
    bad[1]["spec"]["shutdownAfterJobFinishes"] = False
    with pytest.raises(
        K8sError, match=r"ttlSecondsAfterFinished: needs spec\.shutdownAfterJobFinishes"
    ):
        control.submit(api, bad)
    assert api.objects == {}


def test_a_refused_workload_takes_its_configmap_back():
    api = FakeApi()
    api.refuse["RayJob"] = K8sError("forbidden (403)")
    with pytest.raises(K8sError, match="403"):
        control.submit(api, manifests())
    assert api.objects == {}


def test_an_existing_recipe_says_which_run_to_delete():
    api = FakeApi()
    control.submit(api, manifests())
    with pytest.raises(
        AlreadyExists,
        match=r"a run named digits-vit was submitted before; delete it \(convoy k8s delete digits-vit",
    ):
        control.submit(api, manifests())


def test_follow_reports_each_new_state_until_terminal():
    api = FakeApi()
    api.objects[("RayJob", "default", "digits-vit")] = rayjob({})
    api.streams = [
        [
            ("MODIFIED", rayjob({"jobDeploymentStatus": "Initializing"})),
            ("MODIFIED", rayjob({"jobDeploymentStatus": "Initializing"})),  # no change: quiet
            ("MODIFIED", rayjob({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"})),
            ("MODIFIED", rayjob({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"})),
            ("MODIFIED", rayjob({"jobDeploymentStatus": "Complete", "reason": "never read"})),
        ]
    ]
    seen = []
    final = control.follow(api, RAYJOB, "default", "digits-vit", seen.append)
    assert [s.line() for s in seen] == [
        "RayJob digits-vit: New",
        "RayJob digits-vit: Initializing",
        "RayJob digits-vit: Running, job RUNNING",
        "RayJob digits-vit: Complete, job SUCCEEDED",
    ]
    assert final.succeeded


def test_follow_resyncs_after_an_expired_version_or_an_ended_stream():
    api = FakeApi()
    key = ("RayJob", "default", "digits-vit")
    api.objects[key] = rayjob({"jobDeploymentStatus": "Running"})

    class Streams(list):
        def pop(self, index=-1):
            stream = super().pop(index)
            if not self:  # before the last stream, the object moved on without an event
                api.objects[key] = rayjob({"jobDeploymentStatus": "Failed", "reason": "AppFailed"})
            return stream

    api.streams = Streams([[("ERROR", {})], []])
    seen = []
    final = control.follow(api, RAYJOB, "default", "digits-vit", seen.append)
    assert [s.phase for s in seen] == ["Running", "Failed"]
    assert final.reason == "AppFailed" and not final.succeeded


def test_follow_stops_on_deletion_and_on_timeout():
    api = FakeApi()
    api.objects[("RayJob", "default", "digits-vit")] = rayjob({"jobDeploymentStatus": "Running"})
    api.streams = [[("DELETED", rayjob({}))]]
    with pytest.raises(K8sError, match="was deleted while Running"):
        control.follow(api, RAYJOB, "default", "digits-vit", lambda s: None)
    ticks = itertools.chain([0.0, 0.0, 0.0], itertools.repeat(100.0))
    with pytest.raises(K8sError, match=r"still Running after 10 s"):
        control.follow(
            api, RAYJOB, "default", "digits-vit", lambda s: None, 10, clock=lambda: next(ticks)
        )


def test_status_prefers_the_deployment_status_and_explains_initializing():
    state = rayjob_state(
        rayjob(
            {
                "jobDeploymentStatus": "Initializing",
                "jobStatus": "",
                "rayClusterStatus": {
                    "conditions": [
                        {"type": "HeadPodReady", "status": "False", "reason": "Unschedulable"}
                    ]
                },
            }
        )
    )
    assert state.lines() == [
        "RayJob digits-vit: Initializing",
        "  HeadPodReady=False (Unschedulable)",
    ]
    # kuberay#2314: the job says RUNNING, the deployment Failed; the deployment decides.
    failed = rayjob_state(
        rayjob(
            {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded", "jobStatus": "RUNNING"}
        )
    )
    assert failed.terminal and not failed.succeeded


def test_logs_come_from_the_newest_submitter_pod():
    api = FakeApi()
    control.submit(api, manifests())
    for name, created in [
        ("digits-vit-a", "2026-11-23T10:00:00Z"),
        ("digits-vit-b", "2026-11-23T11:00:00Z"),
    ]:
        api.objects[("Pod", "default", name)] = {
            "metadata": {
                "name": name,
                "labels": {"job-name": "digits-vit"},
                "creationTimestamp": created,
            },
            "status": {"phase": "Running"},
        }
        api.logs[name] = f"logs of {name}\n"
    assert control.logs(api, RAYJOB, "default", "digits-vit") == "logs of digits-vit-b\n"


def test_logs_explain_a_missing_or_pending_pod():
    api = FakeApi()
    control.submit(api, manifests())
    with pytest.raises(
        K8sError, match=r"no submitter pod for RayJob default/digits-vit yet \(New\)"
    ):
        control.logs(api, RAYJOB, "default", "digits-vit")
    waiting = {"state": {"waiting": {"reason": "ImagePullBackOff"}}}
    api.objects[("Pod", "default", "digits-vit-x")] = {
        "metadata": {"name": "digits-vit-x", "labels": {"job-name": "digits-vit"}},
        "status": {"phase": "Pending", "containerStatuses": [waiting]},
    }
    with pytest.raises(K8sError, match=r"it is Pending \(ImagePullBackOff\), not started"):
        control.logs(api, RAYJOB, "default", "digits-vit")
    assert POD.kind == "Pod"


def test_delete_removes_only_convoys_configmap():
    api = FakeApi()
    control.submit(api, manifests())
    assert control.delete(api, RAYJOB, "default", "digits-vit") == [
        "RayJob default/digits-vit",
        "ConfigMap default/digits-vit-recipe",
    ]
    api.objects[("ConfigMap", "default", "other-recipe")] = {
        "metadata": {"name": "other-recipe", "labels": {}}
    }
    with pytest.raises(NotFound, match="not found"):
        control.delete(api, RAYJOB, "default", "other")
    assert ("ConfigMap", "default", "other-recipe") in api.objects


def _stamp(obj, created: str, status: dict[str, Any] | None = None):
    obj["metadata"]["creationTimestamp"] = created
    if status is not None:
        obj["status"] = status


def test_gc_rule():
    api = FakeApi()
    api.missing.add("PyTorchJob")  # no Kubeflow operator: nothing of that kind to collect
    for name in ("done", "fresh", "running", "invalid", "job-cluster"):
        control.submit(api, manifests(name))
    control.submit(api, manifests("kept", "raycluster"))
    objs = api.objects
    _stamp(objs[("RayJob", "default", "done")], "2026-11-23T08:00:00Z",
           {"jobDeploymentStatus": "Complete", "endTime": "2026-11-23T10:00:00Z"})  # fmt: skip
    _stamp(objs[("RayJob", "default", "fresh")], "2026-11-23T08:00:00Z",
           {"jobDeploymentStatus": "Failed", "endTime": "2026-11-23T11:30:00Z"})  # fmt: skip
    _stamp(
        objs[("RayJob", "default", "running")],
        "2026-11-23T08:00:00Z",
        {"jobDeploymentStatus": "Running"},
    )
    _stamp(
        objs[("RayJob", "default", "invalid")],
        "2026-11-23T08:00:00Z",
        {"jobDeploymentStatus": "ValidationFailed"},
    )
    # The RayJob "job-cluster" is gone, its cluster (KubeRay copies the labels) is left.
    cluster = manifests("job-cluster", "raycluster")[1]
    cluster["metadata"]["labels"]["convoy.io/kind"] = "rayjob"
    _stamp(cluster, "2026-11-23T08:00:00Z")
    del objs[("RayJob", "default", "job-cluster")]
    objs[("RayCluster", "default", "job-cluster")] = {**cluster, "kind": "RayCluster"}
    for obj in objs.values():
        obj["metadata"].setdefault("creationTimestamp", "2026-11-23T08:00:00Z")
    # A recipe created a moment ago, its workload not yet: spared by the grace period.
    (recipe,) = manifests("submitting")[:1]
    objs[("ConfigMap", "default", "submitting-recipe")] = recipe
    _stamp(recipe, "2026-11-23T11:59:50Z")

    found = control.gc(api, "default", now=NOW, grace_s=600)
    assert sorted(item.line() for item in found) == [
        "ConfigMap done-recipe: its run has no workload left",
        "ConfigMap invalid-recipe: its run has no workload left",
        "ConfigMap job-cluster-recipe: its run has no workload left",
        "RayCluster job-cluster: its RayJob is gone",
        "RayJob done: Complete 7200 s ago, past its TTL of 3600 s",
        "RayJob invalid: ValidationFailed 14400 s ago, past its TTL of 3600 s",
    ]
    left = sorted(name for (kind, _, name) in objs if kind != "ConfigMap")
    assert left == ["fresh", "kept", "running"]
    assert PYTORCHJOB.kind in api.missing and RAYCLUSTER.kind == "RayCluster"


@pytest.mark.parametrize(
    ("status", "body", "verb", "says"),
    [
        (404, '{"message": "the server could not find the requested resource"}', "create",
         "install KubeRay v1.7: helm repo add kuberay"),
        (404, '{"details": {"name": "x", "kind": "rayjobs"}}', "get", "RayJob default/x not found"),
        (404, '{"details": {"name": "nope", "kind": "namespaces"}}', "create",
         "namespace 'default' does not exist; create it"),
        (403, '{"message": "rayjobs.ray.io is forbidden: User \\"alice\\" cannot create resource"}', "create",
         "user 'alice' may not create rayjobs.ray.io in namespace 'default'; ask for an RBAC Role "
         "granting verbs [create] on resources [rayjobs] in apiGroups [ray.io]"),
        (409, "{}", "create", "RayJob default/x already exists (409); delete it (convoy k8s delete x -n default)"),
        (422, '{"details": {"causes": [{"field": "spec.backoffLimit", "message": "Invalid value"}]}}',
         "create", "refused RayJob default/x (422): spec.backoffLimit: Invalid value"),
        (401, "{}", "get", "not authenticated (401)"),
    ],
)  # fmt: skip
def test_api_errors_become_one_line_with_what_to_do(status, body, verb, says):
    error = explain(status, body, verb, RAYJOB, "default", "x")
    assert says in str(error) and "\n" not in str(error)


def test_validation_failed_says_delete_and_resubmit():
    state = rayjob_state(rayjob({"jobDeploymentStatus": "ValidationFailed", "message": "bad spec"}))
    assert state.terminal and not state.succeeded
    assert state.lines() == [
        "RayJob digits-vit: ValidationFailed: bad spec",
        "  the operator never retries this: fix the manifest (convoy k8s validate FILE), then "
        "convoy k8s delete digits-vit and submit again",
    ]
