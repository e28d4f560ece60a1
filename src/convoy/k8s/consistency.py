"""Across the manifests of one file: the workload against its recipe ConfigMap (the
ConfigMap it mounts is in the file, the recipe key it reads is there, and its worker pods
hold the recipe's workers).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import PurePosixPath
from typing import Any

from convoy.errors import ConfigError
from convoy.k8s.configmap import RECIPE_PATH, recipe_job
from convoy.k8s.policy import pod_templates
from convoy.k8s.quantities import pod_range


def cross_problems(manifests: list[dict[str, Any]]) -> list[str]:
    """The workload's ConfigMap volume names a ConfigMap of the file, its entrypoint reads a
    key that ConfigMap has, and its worker pods match the recipe's worker count."""
    configmaps = {
        m.get("metadata", {}).get("name"): m for m in manifests if m.get("kind") == "ConfigMap"
    }
    problems = []
    for obj in manifests:
        if obj.get("kind") not in ("RayJob", "RayCluster", "PyTorchJob") or not configmaps:
            continue
        label = f"{obj['kind']}/{obj.get('metadata', {}).get('name', '')}"
        for where, pod in pod_templates(obj):
            problems += _recipe_mount_problems(obj, label, where, pod, configmaps)
        problems += _worker_count_problems(obj, label, configmaps)
    return problems


def _configmap_mounts(pod: dict[str, Any]) -> dict[str, str]:
    """mountPath -> ConfigMap name of the pod's first container."""
    spec = pod.get("spec", {})
    volumes = {
        v.get("name"): v["configMap"].get("name")
        for v in spec.get("volumes") or []
        if isinstance(v.get("configMap"), dict)
    }
    containers = spec.get("containers") or [{}]
    return {
        m.get("mountPath", ""): volumes[m.get("name")]
        for m in containers[0].get("volumeMounts") or []
        if m.get("name") in volumes
    }


def _recipe_mount_problems(
    obj: dict[str, Any],
    label: str,
    where: str,
    pod: dict[str, Any],
    configmaps: dict[Any, dict[str, Any]],
) -> list[str]:
    problems = []
    mounts = _configmap_mounts(pod)
    for path, cm in mounts.items():
        if cm not in configmaps:
            problems.append(
                f"{label} {where}.spec.volumes: ConfigMap {cm!r} (mounted at {path}) is not in "
                f"this file; it has {', '.join(repr(n) for n in configmaps)}"
            )
    if obj["kind"] == "RayJob" and where.endswith("headGroupSpec.template"):
        command = str(obj.get("spec", {}).get("entrypoint", ""))
        at = "spec.entrypoint"
    elif obj["kind"] == "PyTorchJob":
        containers = pod.get("spec", {}).get("containers") or [{}]
        command = " ".join(map(str, containers[0].get("command") or []))
        at = f"{where}.spec.containers[0].command"
    else:
        return problems
    for read in re.findall(r"(/\S+\.ya?ml)\b", command):
        directory, key = posixpath.split(read)
        mounted = mounts.get(directory)
        if mounted in configmaps and key not in (configmaps[mounted].get("data") or {}):
            keys = ", ".join(repr(k) for k in configmaps[mounted].get("data") or {})
            problems.append(
                f"{label} {at}: reads {read}, but ConfigMap {mounted!r} has no key {key!r} "
                f"(it has {keys or 'none'})"
            )
    return problems


def _worker_count_problems(
    obj: dict[str, Any], label: str, configmaps: dict[Any, dict[str, Any]]
) -> list[str]:
    pods = dict(pod_templates(obj))
    names = {cm for pod in pods.values() for cm in _configmap_mounts(pod).values()}
    key = PurePosixPath(RECIPE_PATH).name
    texts = [configmaps[n].get("data", {}).get(key) for n in names if n in configmaps]
    try:
        job = recipe_job(str(texts[0])) if texts and texts[0] else None
    except ConfigError:
        return []  # reported with the ConfigMap
    if job is None:
        return []
    low, high = pod_range(job)
    spec = obj.get("spec", {})
    workers = (
        f"scaling.num_workers {job.scaling.num_workers} / k8s.workers_per_pod "
        f"{job.k8s.workers_per_pod}"
    )
    if obj["kind"] == "PyTorchJob":
        replicas = spec.get("pytorchReplicaSpecs", {}).get("Worker", {}).get("replicas")
        elastic = spec.get("elasticPolicy", {})
        found = [
            ("spec.pytorchReplicaSpecs.Worker.replicas", replicas, high),
            ("spec.elasticPolicy.maxReplicas", elastic.get("maxReplicas", high), high),
            ("spec.elasticPolicy.minReplicas", elastic.get("minReplicas", low), low),
        ]
        return [
            f"{label} {at}: got {got}; the recipe's {workers} needs {want} worker pod(s)"
            for at, got, want in found
            if got != want
        ]
    cluster = spec.get("rayClusterSpec", spec) if obj["kind"] == "RayJob" else spec
    groups = cluster.get("workerGroupSpecs") or []
    prefix = "spec.rayClusterSpec" if obj["kind"] == "RayJob" else "spec"
    most = sum(
        (g.get("maxReplicas", g.get("replicas", 0)) if cluster.get("enableInTreeAutoscaling")
         else g.get("replicas", 0)) * g.get("numOfHosts", 1)
        for g in groups
    )  # fmt: skip
    if most < high:
        return [
            f"{label} {prefix}.workerGroupSpecs: at most {most} worker pod(s); the recipe's "
            f"{workers} needs {high}, so training would wait for workers forever"
        ]
    return []
