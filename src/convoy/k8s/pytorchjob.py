"""A Kubeflow ``PyTorchJob`` (no CRD shipped for it): checked field by field against the
training operator's own v1 models (``PYTORCHJOB_FIELDS``), its pod templates against the
PodTemplateSpec schema in KubeRay's CRD, plus what the operator requires of its replicas
and elastic policy.
"""

from __future__ import annotations

import difflib
from typing import Any

from convoy.k8s import naming
from convoy.k8s.schema import crd_schema, schema_problems

PYTORCHJOB_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "": {"apiVersion": str, "kind": str, "metadata": dict, "spec": dict, "status": dict},
    "spec": {
        "elasticPolicy": dict,
        "nprocPerNode": str,
        "pytorchReplicaSpecs": dict,
        "runPolicy": dict,
    },
    "spec.elasticPolicy": {
        "maxReplicas": int,
        "maxRestarts": int,
        "metrics": list,
        "minReplicas": int,
        "nProcPerNode": int,
        "rdzvBackend": str,
        "rdzvConf": list,
        "rdzvHost": str,
        "rdzvId": str,
        "rdzvPort": int,
        "standalone": bool,
    },
    "spec.runPolicy": {
        "activeDeadlineSeconds": int,
        "backoffLimit": int,
        "cleanPodPolicy": str,
        "managedBy": str,
        "schedulingPolicy": dict,
        "suspend": bool,
        "ttlSecondsAfterFinished": int,
    },
    "spec.runPolicy.schedulingPolicy": {
        "minAvailable": int,
        "minResources": dict,
        "priorityClass": str,
        "queue": str,
        "scheduleTimeoutSeconds": int,
    },
    "spec.pytorchReplicaSpecs.*": {"replicas": int, "restartPolicy": str, "template": dict},
}
"""The fields of Kubeflow's ``kubeflow.org/v1`` PyTorchJob, from the training operator's own
Python models (``kubeflow-training`` 1.9.4 on PyPI, ``kubeflow/training/models/
kubeflow_org_v1_{py_torch_job,py_torch_job_spec,elastic_policy,run_policy,scheduling_policy,
replica_spec}.py``: their ``attribute_map`` and ``openapi_types``). No CRD is shipped for it;
pod templates are checked against the PodTemplateSpec schema in KubeRay's CRD."""


def pytorchjob_field_problems(obj: dict[str, Any]) -> list[str]:
    """Unknown fields (with a "did you mean") and wrong types down to the pod templates,
    which are checked against the PodTemplateSpec schema KubeRay's CRD carries."""
    problems: list[str] = []

    def walk(value: Any, at: str, pattern: str) -> None:
        fields = PYTORCHJOB_FIELDS[pattern]
        if not isinstance(value, dict):
            problems.append(f"{at or '(top level)'}: got {value!r}; expected an object")
            return
        for key, child in value.items():
            where = f"{at}.{key}" if at else str(key)
            if key not in fields:
                guess = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
                hint = f" (did you mean {guess[0]!r}?)" if guess else ""
                problems.append(
                    f"{where}: unknown field{hint}; allowed: {', '.join(sorted(fields))}"
                )
                continue
            want = fields[key]
            if not isinstance(child, want) or (want is int and isinstance(child, bool)):
                names = (
                    want.__name__ if isinstance(want, type) else "/".join(t.__name__ for t in want)
                )
                kind = {
                    "dict": "an object",
                    "list": "a list",
                    "str": "a string",
                    "int": "an integer",
                    "bool": "true or false",
                }.get(names, f"a {names}")
                problems.append(f"{where}: got {child!r}; expected {kind}")
                continue
            nested = f"{pattern}.{key}" if pattern else str(key)
            if nested in PYTORCHJOB_FIELDS:
                walk(child, where, nested)
            elif nested == "spec.pytorchReplicaSpecs" and isinstance(child, dict):
                for role, replica in child.items():
                    walk(replica, f"{where}.{role}", "spec.pytorchReplicaSpecs.*")
                    if isinstance(replica, dict) and isinstance(replica.get("template"), dict):
                        problems.extend(_prefixed(f"{where}.{role}.template", replica["template"]))

    walk(obj, "", "")
    return problems


def _prefixed(at: str, template: dict[str, Any]) -> list[str]:
    spec = crd_schema("RayCluster")["properties"]["spec"]["properties"]
    schema = spec["headGroupSpec"]["properties"]["template"]
    lines = schema_problems(template, schema)
    return [
        f"{at}: {line.removeprefix('(top level): ')}" if line.startswith("(top level)")
        else f"{at}.{line}"
        for line in lines
    ]  # fmt: skip


def pytorchjob_problems(obj: dict[str, Any]) -> list[str]:
    problems = pytorchjob_field_problems(obj)
    name = obj.get("metadata", {}).get("name", "")
    if not naming.is_dns1035(name, naming.MAX_NAME["pytorchjob"]):
        problems.append(f"metadata.name: got {name!r}; a DNS-1035 label of at most 63 characters")
    spec = obj.get("spec", {})
    elastic = spec.get("elasticPolicy", {})
    low, high = elastic.get("minReplicas", 1), elastic.get("maxReplicas", 1)
    if not (isinstance(low, int) and isinstance(high, int)):
        return problems  # reported as a wrong type
    if low > high:
        problems.append(f"spec.elasticPolicy.minReplicas: got {low}, above maxReplicas {high}")
    if elastic.get("rdzvBackend", "c10d") not in ("c10d", "etcd", "etcd-v2"):
        problems.append(
            f"spec.elasticPolicy.rdzvBackend: got {elastic['rdzvBackend']!r}; "
            "allowed: 'c10d', 'etcd', 'etcd-v2'"
        )
    replicas = spec.get("pytorchReplicaSpecs", {})
    for role, replica in replicas.items():
        at = f"spec.pytorchReplicaSpecs.{role}"
        if role not in ("Master", "Worker"):
            problems.append(f"{at}: got {role!r}; allowed: 'Master', 'Worker'")
        names = [
            c.get("name") for c in replica.get("template", {}).get("spec", {}).get("containers", [])
        ]
        if "pytorch" not in names:
            problems.append(f"{at}.template.spec.containers: one must be named 'pytorch'")
        policy = replica.get("restartPolicy", "OnFailure")
        if policy not in ("Always", "OnFailure", "Never", "ExitCode"):
            problems.append(
                f"{at}.restartPolicy: got {policy!r}; allowed: 'Always', 'ExitCode', "
                "'Never', 'OnFailure'"
            )
    workers = replicas.get("Worker", {}).get("replicas", 0)
    if elastic and isinstance(workers, int) and not low <= workers <= high:
        problems.append(
            f"spec.pytorchReplicaSpecs.Worker.replicas: got {workers}; must be within "
            f"elasticPolicy [{low}, {high}]"
        )
    return problems
