"""``convoy k8s`` against a real kube-apiserver (k8s-envtest): the same create / get / watch /
patch / delete calls and 403 / 404 / 409 / 422 answers a cluster gives. No operator runs:
each test moves a RayJob's status itself, as KubeRay would."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from convoy.cli import main
from convoy.config import load_job
from convoy.k8s import K8sError, control
from convoy.k8s.client import (
    CONFIGMAP,
    PYTORCHJOB,
    RAYCLUSTER,
    RAYJOB,
    AlreadyExists,
    KubeApi,
    MissingKind,
    NotFound,
)
from convoy.k8s.render import render

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[3]
IMAGE = "registry.example.com/convoy:0.1.0"


def rendered(name: str, kind: str = "rayjob", *overrides: str) -> list[dict[str, Any]]:
    job = load_job(
        REPO / "recipes" / "default.yaml",
        [f"k8s.image={IMAGE}", "k8s.pvc=convoy-runs", f"run.name={name}", *overrides],
    )
    return render(job, kind)


def pruned(sent: Any, stored: Any, path: str = "spec") -> list[str]:
    """Paths of ``sent`` missing from or changed in ``stored`` (server defaults may add)."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        return [p for k, v in sent.items() for p in pruned(v, stored.get(k), f"{path}.{k}")]
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        return [
            p
            for i, (a, b) in enumerate(zip(sent, stored, strict=True))
            for p in pruned(a, b, f"{path}[{i}]")
        ]
    return [] if sent == stored else [path]


def test_submit_creates_the_recipe_and_a_rayjob_that_owns_it(envtest):
    manifests = rendered("submit-owns")
    created = control.submit(envtest.api, manifests)
    config_map = envtest.api.get(CONFIGMAP, "default", "submit-owns-recipe")
    (owner,) = config_map["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "name": "submit-owns",
        "uid": created["metadata"]["uid"],
    }
    # The server prunes fields its schema does not know, silently: every rendered field
    # still there means each is one KubeRay v1.7.0 defines.
    stored = envtest.api.get(RAYJOB, "default", "submit-owns")
    assert pruned(manifests[1]["spec"], stored["spec"]) == []
    recipe = yaml.safe_load(config_map["data"]["recipe.yaml"])
    assert recipe["run"] == {**recipe["run"], "name": "submit-owns", "shared_storage": True}


def test_raycluster_roundtrips_unpruned(envtest):
    manifests = rendered("long-lived", "raycluster")
    control.submit(envtest.api, manifests)
    stored = envtest.api.get(RAYCLUSTER, "default", "long-lived")
    assert pruned(manifests[1]["spec"], stored["spec"]) == []


def test_server_side_dry_run_creates_nothing(envtest):
    control.submit(envtest.api, rendered("dry-run"), dry_run=True)
    with pytest.raises(NotFound):
        envtest.api.get(RAYJOB, "default", "dry-run")
    with pytest.raises(NotFound):
        envtest.api.get(CONFIGMAP, "default", "dry-run-recipe")


def test_a_second_submit_is_409_with_delete_or_rename(envtest):
    control.submit(envtest.api, rendered("twice"))
    with pytest.raises(AlreadyExists, match=r"convoy k8s delete twice -n default.*rename"):
        control.submit(envtest.api, rendered("twice"))
    # The RayJob itself answers 409 the same way once its ConfigMap is out of the way.
    envtest.api.delete(CONFIGMAP, "default", "twice-recipe")
    with pytest.raises(AlreadyExists, match=r"RayJob default/twice already exists \(409\)"):
        control.submit(envtest.api, rendered("twice"))


def test_missing_crd_says_what_to_install_and_rolls_back_the_configmap(envtest):
    with pytest.raises(MissingKind, match="Kubeflow training operator is not installed"):
        control.submit(envtest.api, rendered("no-operator", "pytorchjob"))
    with pytest.raises(NotFound):
        envtest.api.get(CONFIGMAP, "default", "no-operator-recipe")
    with pytest.raises(MissingKind, match=r"PyTorchJob \(pytorchjobs.kubeflow.org/v1\)"):
        control.state(envtest.api, PYTORCHJOB, "default", "no-operator")


def test_the_server_refuses_what_validation_refuses_first(envtest):
    # Sent without Convoy's checks, the CRD's own minimum answers 422; Convoy's validation
    # names the same field before anything is sent.
    manifest = rendered("refused")[1]
    manifest["spec"]["preRunningDeadlineSeconds"] = 0
    with pytest.raises(
        K8sError, match=r"refused RayJob default/refused \(422\).*preRunningDeadline"
    ):
        envtest.api.create(RAYJOB, "default", manifest)
    with pytest.raises(K8sError, match=r"spec.preRunningDeadlineSeconds: got 0"):
        control.submit(envtest.api, [manifest])


def _drive(
    envtest, name: str, steps: list[dict[str, Any]], pause_s: float = 0.3
) -> threading.Thread:
    """Play the operator: patch the RayJob's status through ``steps`` in a thread."""

    def play() -> None:
        for status in steps:
            time.sleep(pause_s)
            envtest.set_status("RayJob", name, status)

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread


INITIALIZING = {
    "jobDeploymentStatus": "Initializing",
    "rayClusterStatus": {
        "conditions": [
            {
                "type": "HeadPodReady",
                "status": "False",
                "reason": "ContainersNotReady",
                "message": "image pull back-off",
                "lastTransitionTime": "2026-11-23T00:00:00Z",
            }
        ]
    },
}


def test_watch_follows_the_operator_to_complete(envtest):
    control.submit(envtest.api, rendered("watched"))
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    thread = _drive(
        envtest,
        "watched",
        [
            INITIALIZING,
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterStatus": None},
            {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "endTime": now},
        ],
    )
    seen = []
    final = control.follow(envtest.api, RAYJOB, "default", "watched", seen.append, timeout_s=30)
    thread.join()
    assert [s.phase for s in seen] == ["New", "Initializing", "Running", "Complete"]
    assert seen[1].details == ("HeadPodReady=False (ContainersNotReady): image pull back-off",)
    assert final.succeeded and final.job_status == "SUCCEEDED"


def test_cli_status_watch_exits_1_on_failure_with_the_reason(envtest, capsys):
    control.submit(envtest.api, rendered("deadline"))
    thread = _drive(
        envtest,
        "deadline",
        [
            {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
            # kuberay#2314: jobStatus can stay RUNNING; jobDeploymentStatus decides.
            {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded", "jobStatus": "RUNNING"},
        ],
    )
    code = main(["k8s", "status", "deadline", "--watch", "--timeout", "30",
                 "--kubeconfig", envtest.kubeconfig])  # fmt: skip
    thread.join()
    out = capsys.readouterr().out
    assert code == 1
    assert "RayJob deadline: Failed (DeadlineExceeded), job RUNNING" in out


def test_validation_failed_ends_the_watch(envtest):
    control.submit(envtest.api, rendered("invalid-later"))
    envtest.set_status("RayJob", "invalid-later", {"jobDeploymentStatus": "ValidationFailed",
                                                   "reason": "ValidationFailed"})  # fmt: skip
    final = control.follow(envtest.api, RAYJOB, "default", "invalid-later", lambda s: None, 10)
    assert final.terminal and not final.succeeded


def test_watch_reports_a_deletion(envtest):
    control.submit(envtest.api, rendered("vanishing"))

    def remove() -> None:
        time.sleep(0.5)
        envtest.api.delete(RAYJOB, "default", "vanishing")

    threading.Thread(target=remove, daemon=True).start()
    with pytest.raises(K8sError, match="was deleted while New"):
        control.follow(envtest.api, RAYJOB, "default", "vanishing", lambda s: None, 30)


def test_logs_without_a_submitter_pod_say_why(envtest):
    control.submit(envtest.api, rendered("no-logs-yet"))
    with pytest.raises(
        K8sError, match=r"no submitter pod for RayJob default/no-logs-yet yet \(New\)"
    ):
        control.logs(envtest.api, RAYJOB, "default", "no-logs-yet")
    with pytest.raises(NotFound, match="RayJob default/nobody not found"):
        control.logs(envtest.api, RAYJOB, "default", "nobody")


def test_logs_of_a_pod_that_never_started(envtest):
    control.submit(envtest.api, rendered("pending-pod"))
    envtest.api.core.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": "pending-pod-abcde", "labels": {"job-name": "pending-pod"}},
            "spec": {
                # No token controller here to make the service account's token.
                "automountServiceAccountToken": False,
                "containers": [{"name": "ray-job-submitter", "image": IMAGE}],
            },
        },
    )
    with pytest.raises(K8sError, match="no logs from pod default/pending-pod-abcde yet"):
        control.logs(envtest.api, RAYJOB, "default", "pending-pod")


def test_delete_removes_the_rayjob_and_its_recipe(envtest, capsys):
    control.submit(envtest.api, rendered("deleted"))
    assert main(["k8s", "delete", "deleted", "--kubeconfig", envtest.kubeconfig]) == 0
    assert "deleted RayJob default/deleted" in capsys.readouterr().out
    with pytest.raises(NotFound):
        envtest.api.get(CONFIGMAP, "default", "deleted-recipe")
    assert main(["k8s", "delete", "deleted", "--kubeconfig", envtest.kubeconfig]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_submit_render_and_status(envtest, capsys, tmp_path):
    out = tmp_path / "rayjob.yaml"
    args = ["-o", f"k8s.image={IMAGE}", "-o", "k8s.pvc=convoy-runs", "-o", "run.name=from-cli"]
    assert (
        main(["k8s", "render", str(REPO / "recipes" / "default.yaml"), *args, "--out", str(out)])
        == 0
    )
    assert main(["k8s", "submit", str(out), "--kubeconfig", envtest.kubeconfig]) == 0
    assert "created RayJob default/from-cli" in capsys.readouterr().out
    assert main(["k8s", "status", "from-cli", "--kubeconfig", envtest.kubeconfig]) == 0
    assert capsys.readouterr().out == "RayJob from-cli: New\n"


def _old(hours: float) -> str:
    when = datetime.now(timezone.utc) - timedelta(hours=hours)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_gc_deletes_only_what_convoy_left_behind(envtest):
    api, ns = envtest.api, "gc-test"
    api.core.create_namespace({"metadata": {"name": ns}})
    over = ["-o", f"k8s.namespace={ns}"]
    for name in ("gc-finished", "gc-recent", "gc-running"):
        control.submit(api, rendered(name, "rayjob", *over[1:]))
    envtest.set_status(
        "RayJob", "gc-finished", {"jobDeploymentStatus": "Complete", "endTime": _old(2)}, ns
    )
    envtest.set_status(
        "RayJob", "gc-recent", {"jobDeploymentStatus": "Failed", "endTime": _old(0.1)}, ns
    )
    envtest.set_status("RayJob", "gc-running", {"jobDeploymentStatus": "Running"}, ns)
    control.submit(api, rendered("gc-kept-cluster", "raycluster", *over[1:]))
    # Left behind: a RayJob's RayCluster whose RayJob is gone, and a recipe with no run.
    orphan = rendered("gc-orphan", "rayjob", *over[1:])
    api.create(CONFIGMAP, ns, orphan[0])
    cluster = {**rendered("gc-orphan", "raycluster", *over[1:])[1]}
    cluster["metadata"]["labels"]["convoy.io/kind"] = "rayjob"
    api.create(RAYCLUSTER, ns, cluster)
    api.create(CONFIGMAP, ns, {"metadata": {"name": "not-ours"}, "data": {"a": "b"}})

    planned = control.gc(api, ns, grace_s=0, dry_run=True)
    assert sorted((i.resource.kind, i.name) for i in planned) == [
        ("ConfigMap", "gc-finished-recipe"),
        ("ConfigMap", "gc-orphan-recipe"),
        ("RayCluster", "gc-orphan"),
        ("RayJob", "gc-finished"),
    ]
    assert api.get(RAYJOB, ns, "gc-finished")  # a dry run deletes nothing
    control.gc(api, ns, grace_s=0)
    left = {o["metadata"]["name"] for r in (RAYJOB, RAYCLUSTER) for o in api.list(r, ns)}
    assert left == {"gc-recent", "gc-running", "gc-kept-cluster"}
    maps = {o["metadata"]["name"] for o in api.list(CONFIGMAP, ns)}
    assert "not-ours" in maps and "gc-orphan-recipe" not in maps
    assert control.gc(api, ns, grace_s=0) == []
    # A fresh orphan is spared: its submission may still be creating the workload.
    api.create(CONFIGMAP, ns, orphan[0])
    assert control.gc(api, ns) == []


def _restricted_api(envtest, name: str, rules: list[dict[str, Any]], tmp_path: Path) -> KubeApi:
    """A service account with only ``rules`` in ``default``, as its own kubeconfig."""
    import kubernetes

    core = envtest.api.core
    rbac = kubernetes.client.RbacAuthorizationV1Api(envtest.api.api_client)
    core.create_namespaced_service_account("default", {"metadata": {"name": name}})
    rbac.create_namespaced_role("default", {"metadata": {"name": name}, "rules": rules})
    rbac.create_namespaced_role_binding(
        "default",
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "default"}],
        },
    )
    token = core.create_namespaced_service_account_token(name, "default", {"spec": {}}).status.token
    config = yaml.safe_load(Path(envtest.kubeconfig).read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    path = tmp_path / f"{name}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return KubeApi.connect(str(path))


def test_403_names_the_user_verb_and_resource(envtest, tmp_path):
    nobody = _restricted_api(envtest, "convoy-nobody", [], tmp_path)
    with pytest.raises(
        K8sError,
        match=r"forbidden \(403\): user 'system:serviceaccount:default:convoy-nobody' may not "
        r"create configmaps in namespace 'default'.*verbs \[create\] on resources \[configmaps\]",
    ):
        control.submit(nobody, rendered("forbidden"))
    # Allowed the ConfigMap but not the RayJob: the RayJob's verb and group are named, and
    # the ConfigMap is taken back.
    maps_only = _restricted_api(
        envtest,
        "convoy-maps-only",
        [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create", "delete", "get"]}],
        tmp_path,
    )
    with pytest.raises(K8sError, match=r"may not create rayjobs.ray.io .* apiGroups \[ray.io\]"):
        control.submit(maps_only, rendered("forbidden"))
    with pytest.raises(NotFound):
        envtest.api.get(CONFIGMAP, "default", "forbidden-recipe")
    with pytest.raises(K8sError, match=r"may not get rayjobs.ray.io"):
        control.state(maps_only, RAYJOB, "default", "forbidden")
