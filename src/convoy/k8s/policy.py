"""Convoy's floor for pods: no privileged containers, host namespaces or root, and a
dashboard that is not exposed outside the cluster; plus ``pod_templates``, every pod
template of a RayJob, RayCluster or PyTorchJob with its path.
"""

from __future__ import annotations

from typing import Any

from convoy.k8s.schema import CRD_FILES


def pod_policy_problems(obj: dict[str, Any]) -> list[str]:
    """No privileged containers, host namespaces or root; the dashboard stays in-cluster."""
    problems = []
    for where, pod in pod_templates(obj):
        spec = pod.get("spec", {})
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(key):
                problems.append(f"{where}.spec.{key}: got true; pods share no host namespace")
        if spec.get("securityContext", {}).get("runAsNonRoot") is not True:
            problems.append(f"{where}.spec.securityContext.runAsNonRoot: must be true")
        for i, container in enumerate(spec.get("containers", [])):
            context = container.get("securityContext", {})
            at = f"{where}.spec.containers[{i}].securityContext"
            if context.get("privileged"):
                problems.append(f"{at}.privileged: got true; containers run unprivileged")
            if context.get("allowPrivilegeEscalation", True):
                problems.append(f"{at}.allowPrivilegeEscalation: must be false")
            if "ALL" not in context.get("capabilities", {}).get("drop", []):
                problems.append(f"{at}.capabilities.drop: must include 'ALL'")
    cluster = obj.get("spec", {})
    cluster = cluster.get("rayClusterSpec", cluster) if obj.get("kind") == "RayJob" else cluster
    service = cluster.get("headGroupSpec", {}).get("serviceType", "ClusterIP")
    if obj.get("kind") in CRD_FILES and service != "ClusterIP":
        problems.append(
            f"headGroupSpec.serviceType: got {service!r}; the dashboard runs any code it is "
            "sent, so it stays ClusterIP (reach it with kubectl port-forward)"
        )
    return problems


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template of a RayJob, RayCluster or PyTorchJob, with its path in ``obj``."""
    spec = obj.get("spec", {})
    if obj.get("kind") == "PyTorchJob":
        return [
            (f"spec.pytorchReplicaSpecs.{role}.template", replica.get("template", {}))
            for role, replica in spec.get("pytorchReplicaSpecs", {}).items()
        ]
    templates = []
    if obj.get("kind") == "RayJob":
        if "submitterPodTemplate" in spec:
            templates.append(("spec.submitterPodTemplate", spec["submitterPodTemplate"]))
        at, spec = "spec.rayClusterSpec", spec.get("rayClusterSpec", {})
    else:
        at = "spec"
    head = spec.get("headGroupSpec", {})
    templates.append((f"{at}.headGroupSpec.template", head.get("template", {})))
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        templates.append((f"{at}.workerGroupSpecs[{i}].template", group.get("template", {})))
    return templates
