"""What the KubeRay operator checks at reconcile time (v1.7.0,
``controllers/ray/utils/validation.go``): the checks that otherwise only end in
``jobDeploymentStatus: ValidationFailed`` after the object was created.
"""

from __future__ import annotations

from typing import Any

import yaml

from convoy.k8s import naming
from convoy.k8s.quantities import version_tuple

SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode")
GATED_CLUSTER_FIELDS = {
    "networkPolicy": "RayClusterNetworkPolicy",
    "tlsOptions": "RayClusterMTLS",
    "historyServerOptions": "RayHistoryServer",
}


def operator_problems(obj: dict[str, Any]) -> list[str]:
    kind = obj["kind"]
    name = obj.get("metadata", {}).get("name", "")
    limit = naming.MAX_NAME[kind.lower()]
    problems = []
    if not naming.is_dns1035(name, limit):
        problems.append(
            f"metadata.name: got {name!r} ({len(name)} characters); a {kind} name must be a "
            f"DNS-1035 label of at most {limit} characters"
        )
    spec = obj.get("spec", {})
    if kind == "RayJob":
        problems += rayjob_spec_problems(spec)
        if isinstance(spec.get("rayClusterSpec"), dict):
            problems += cluster_spec_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
    else:
        problems += cluster_spec_problems(spec, "spec")
    return problems


def rayjob_spec_problems(spec: dict[str, Any]) -> list[str]:
    problems = []
    shutdown = spec.get("shutdownAfterJobFinishes", False)
    mode = spec.get("submissionMode", "K8sJobMode")
    selector = spec.get("clusterSelector") or {}
    backoff = spec.get("backoffLimit")
    if mode not in SUBMISSION_MODES:
        allowed = ", ".join(repr(m) for m in SUBMISSION_MODES)
        problems.append(f"spec.submissionMode: got {mode!r}; allowed: {allowed}")
    if spec.get("suspend") and not shutdown:
        problems.append(
            "spec.suspend: a RayJob can be suspended only with shutdownAfterJobFinishes"
        )
    if spec.get("ttlSecondsAfterFinished", 0) > 0 and not shutdown:
        problems.append(
            "spec.ttlSecondsAfterFinished: needs spec.shutdownAfterJobFinishes: true "
            "(the TTL is when the cluster is shut down)"
        )
    strategy = spec.get("deletionStrategy") or {}
    if strategy.get("deletionRules") and shutdown:
        problems.append(
            "spec.deletionStrategy.deletionRules: cannot be used with "
            "spec.shutdownAfterJobFinishes: true; use one of them"
        )
    if ("rayClusterSpec" in spec) == bool(selector):
        problems.append("spec: exactly one of rayClusterSpec and clusterSelector must be set")
    if selector and not selector.get("ray.io/cluster"):
        problems.append("spec.clusterSelector.ray.io/cluster: the cluster name must not be empty")
    if selector and spec.get("suspend"):
        problems.append("spec.suspend: not supported with spec.clusterSelector")
    if selector and mode == "SidecarMode":
        problems.append("spec.clusterSelector: not supported in SidecarMode")
    if mode == "InteractiveMode" and backoff is not None and backoff > 0:
        problems.append("spec.backoffLimit: must be 0 in InteractiveMode (kuberay#3525)")
    if selector and backoff:
        problems.append("spec.backoffLimit: retries need a new cluster; not with clusterSelector")
    if mode == "SidecarMode":
        for key in ("submitterPodTemplate", "submitterConfig"):
            if key in spec:
                problems.append(f"spec.{key}: not supported in SidecarMode")
        head = spec.get("rayClusterSpec", {}).get("headGroupSpec", {})
        if _restart_policy(head) not in ("", "Never"):
            problems.append(
                "spec.rayClusterSpec.headGroupSpec.template.spec.restartPolicy: must be "
                "Never or unset in SidecarMode"
            )
    try:
        yaml.safe_load(spec.get("runtimeEnvYAML") or "")
    except yaml.YAMLError as exc:
        problems.append(f"spec.runtimeEnvYAML: not valid YAML ({str(exc).splitlines()[0]})")
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if key in spec and isinstance(spec[key], int) and spec[key] <= 0:
            problems.append(f"spec.{key}: got {spec[key]}; must be a positive integer")
    if isinstance(backoff, int) and backoff < 0:
        problems.append(f"spec.backoffLimit: got {backoff}; must be 0 or more")
    if spec.get("rayClusterSpec", {}).get("authOptions", {}).get("enableK8sTokenAuth"):
        problems.append(
            "spec.rayClusterSpec.authOptions.enableK8sTokenAuth: not supported for a RayJob"
        )
    return problems


def cluster_spec_problems(spec: dict[str, Any], at: str) -> list[str]:
    problems = []
    head = spec.get("headGroupSpec", {})
    if not head.get("template", {}).get("spec", {}).get("containers"):
        problems.append(f"{at}.headGroupSpec.template.spec.containers: needs at least one")
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    names = set()
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        where = f"{at}.workerGroupSpecs[{i}]"
        if group.get("groupName") in names:
            problems.append(f"{where}.groupName: {group.get('groupName')!r} is used twice")
        names.add(group.get("groupName"))
        if not group.get("template", {}).get("spec", {}).get("containers"):
            problems.append(f"{where}.template.spec.containers: needs at least one")
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"{where}.minReplicas: got {low}, above maxReplicas {high}")
        replicas = group.get("replicas")
        if not autoscaling and isinstance(replicas, int) and not low <= replicas <= high:
            problems.append(f"{where}.replicas: got {replicas}; must be within [{low}, {high}]")
        problems += _group_problems(group, where, autoscaling and _autoscaler_v2(spec))
    problems += _group_problems(head, f"{at}.headGroupSpec", autoscaling and _autoscaler_v2(spec))
    if spec.get("authOptions", {}).get("mode") == "token":
        version = spec.get("rayVersion", "")
        if not version or version_tuple(version) < (2, 52, 0):
            problems.append(
                f"{at}.rayVersion: got {version!r}; authOptions.mode 'token' needs 2.52.0 or later"
            )
    env = _env(head)
    if not autoscaling and env.get("RAY_enable_autoscaler_v2") in ("1", "true"):
        problems.append(
            f"{at}.headGroupSpec: RAY_enable_autoscaler_v2 is set but enableInTreeAutoscaling "
            "is false"
        )
    if (
        autoscaling
        and "version" in spec.get("autoscalerOptions", {})
        and "RAY_enable_autoscaler_v2" in env
    ):
        problems.append(
            f"{at}.autoscalerOptions.version: set both here and as RAY_enable_autoscaler_v2 "
            "on the head; keep only this one"
        )
    for key, gate in GATED_CLUSTER_FIELDS.items():
        if key in spec:
            problems.append(
                f"{at}.{key}: needs the operator's alpha feature gate {gate}, off by default"
            )
    return problems


def _group_problems(group: dict[str, Any], where: str, autoscaler_v2: bool) -> list[str]:
    problems = []
    params = group.get("rayStartParams", {})
    if "labels" in params:
        problems.append(f"{where}.rayStartParams.labels: not supported; use {where}.labels")
    sized = any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources"))
    if sized and group.get("resources"):
        problems.append(
            f"{where}.resources: set in both rayStartParams and resources; use one of them"
        )
    if autoscaler_v2 and _restart_policy(group) not in ("", "Never"):
        problems.append(
            f"{where}.template.spec.restartPolicy: must be Never or unset with autoscaler v2"
        )
    return problems


def _autoscaler_v2(spec: dict[str, Any]) -> bool:
    version = spec.get("autoscalerOptions", {}).get("version")
    if version:
        return bool(version == "v2")
    env = _env(spec.get("headGroupSpec", {}))
    if "RAY_enable_autoscaler_v2" in env:
        return env["RAY_enable_autoscaler_v2"] in ("1", "true")
    # Unset: Ray 2.47 and later default to v2.
    return version_tuple(spec.get("rayVersion", "")) >= (2, 47, 0)


def _restart_policy(group: dict[str, Any]) -> str:
    return str(group.get("template", {}).get("spec", {}).get("restartPolicy", ""))


def _env(group: dict[str, Any]) -> dict[str, str]:
    containers = group.get("template", {}).get("spec", {}).get("containers") or [{}]
    return {e.get("name"): str(e.get("value", "")) for e in containers[0].get("env", [])}
