"""Everything Convoy checks before it sends a manifest, so no mistake waits for the cluster.

Two layers:

- ``check_job(job, kind, name)``: the job against what its pods can hold and what the
  objects may be called; raises the first ``ConfigError`` (field, value, what is allowed).
  ``render`` calls it, so no manifest is ever written for a job that cannot run.
- ``manifest_problems(obj)``: a manifest (rendered, or edited by hand) against
  1. the KubeRay v1.7.0 CRD schema shipped in ``crds/``, made strict as ``kubectl
     --validate=strict`` is: unknown fields are refused unless the schema preserves them
     (a 1.20-1.24 API server would drop them silently), ``int-or-string`` is either;
  2. the CRD's CEL rules (``x-kubernetes-validations``; rules on ``oldSelf`` only apply to
     updates and are skipped), evaluated with cel-python;
  3. the checks the operator makes only after creation, which otherwise end in
     ``jobDeploymentStatus: ValidationFailed`` (``controllers/ray/utils/validation.go``);
  4. Convoy's own floor for pods: no privileged containers or host network, non-root, and
     a dashboard that is not exposed outside the cluster.
  A PyTorchJob (no CRD shipped) is checked field by field against the training operator's
  own v1 models (``PYTORCHJOB_FIELDS``), its pod templates against the PodTemplateSpec schema
  in KubeRay's CRD. ``check_manifests`` also checks the file as a whole: the recipe in the
  ConfigMap loads as a Job, the workload mounts that ConfigMap and reads a key it has, and
  the worker pods hold the recipe's workers.
  Each problem is one line that starts with the field's path.

Where each part lives (all of it importable from here, as before):

- ``job_checks``: ``check_job`` and its checks of the job and its ``k8s`` section;
- ``schema``: the shipped CRDs, ``strict``, ``schema_problems`` and ``cel_problems``;
- ``operator``: KubeRay's reconcile-time checks (``operator_problems``);
- ``policy``: Convoy's floor for pods (``pod_policy_problems``);
- ``pytorchjob``: ``PYTORCHJOB_FIELDS`` and ``pytorchjob_problems``;
- ``configmap``: the recipe ConfigMap (``configmap_problems``, ``recipe_job``);
- ``consistency``: the file as a whole (``cross_problems``);
- this module: ``check_manifests`` and ``manifest_problems``, which run them all.

The ``jsonschema`` and ``cel-python`` packages are imported only when a manifest is checked.
"""

from __future__ import annotations

import re
from typing import Any

from convoy.config import Job
from convoy.k8s import K8sError
from convoy.k8s.configmap import RECIPE_PATH, configmap_problems, recipe_job
from convoy.k8s.consistency import cross_problems
from convoy.k8s.job_checks import (
    LABEL_KEY,
    LABEL_VALUE,
    QUANTITY,
    RESOURCE_NAME,
    SYSTEM_DIRS,
    check_job,
)
from convoy.k8s.operator import (
    GATED_CLUSTER_FIELDS,
    SUBMISSION_MODES,
    cluster_spec_problems,
    operator_problems,
    rayjob_spec_problems,
)
from convoy.k8s.policy import pod_policy_problems
from convoy.k8s.pytorchjob import (
    PYTORCHJOB_FIELDS,
    pytorchjob_field_problems,
    pytorchjob_problems,
)
from convoy.k8s.schema import (
    CRD_FILES,
    cel_problems,
    crd_schema,
    json_path,
    schema_problems,
    strict,
)

__all__ = [
    "CRD_FILES",
    "GATED_CLUSTER_FIELDS",
    "LABEL_KEY",
    "LABEL_VALUE",
    "POD_TEMPLATE",
    "PYTORCHJOB_FIELDS",
    "QUANTITY",
    "RECIPE_PATH",
    "RECIPE_SECTIONS",
    "RESOURCE_NAME",
    "SUBMISSION_MODES",
    "SYSTEM_DIRS",
    "cel_problems",
    "check_job",
    "check_manifests",
    "cluster_spec_problems",
    "configmap_problems",
    "crd_schema",
    "cross_problems",
    "json_path",
    "manifest_problems",
    "merge_pod_problems",
    "operator_problems",
    "pod_policy_problems",
    "pytorchjob_field_problems",
    "pytorchjob_problems",
    "rayjob_spec_problems",
    "recipe_job",
    "schema_problems",
    "strict",
]

# ---------------------------------------------------------------------------------------------
# A manifest, and the file as a whole, against everything above


def check_manifests(manifests: list[dict[str, Any]]) -> None:
    """Raise ``K8sError`` listing every problem of every manifest, one per line (a problem
    that several pods share, such as a toleration typo, once)."""
    if not manifests:
        raise K8sError("no manifests: the file holds no YAML documents")
    problems = [p for m in manifests for p in manifest_problems(m)]
    problems += cross_problems(manifests)
    problems = merge_pod_problems(list(dict.fromkeys(problems)))
    if problems:
        raise K8sError("the manifest would be refused:\n  " + "\n  ".join(problems))


POD_TEMPLATE = re.compile(
    r"^(?P<pod>spec\.submitterPodTemplate|spec(?:\.rayClusterSpec)?\.headGroupSpec\.template"
    r"|spec(?:\.rayClusterSpec)?\.workerGroupSpecs\[\d+\]\.template"
    r"|spec\.pytorchReplicaSpecs\.\w+\.template)(?P<rest>\.spec\..*)$"
)


def merge_pod_problems(problems: list[str]) -> list[str]:
    """One line for a problem every pod template shares (a toleration typo in ``k8s``
    lands in the submitter, head and worker pods alike), naming the others."""
    first: dict[str, int] = {}
    also: dict[int, list[str]] = {}
    merged: list[str] = []
    for line in problems:
        match = POD_TEMPLATE.match(line)
        if not match:
            merged.append(line)
            continue
        if match["rest"] in first:
            also[first[match["rest"]]].append(match["pod"])
            continue
        first[match["rest"]] = len(merged)
        also[len(merged)] = []
        merged.append(line)
    return [
        f"{line} (the same in {', '.join(also[i])})" if also.get(i) else line
        for i, line in enumerate(merged)
    ]


def manifest_problems(obj: dict[str, Any]) -> list[str]:
    """Every problem of one manifest, each ``path: what is wrong``."""
    kind = obj.get("kind")
    problems: list[str] = []
    if kind in CRD_FILES:
        schema = crd_schema(kind)
        problems += schema_problems(obj, schema)
        problems += cel_problems(obj, schema)
        problems += operator_problems(obj)
        problems += pod_policy_problems(obj)
    elif kind == "PyTorchJob":
        problems += pytorchjob_problems(obj)
        problems += pod_policy_problems(obj)
    elif kind == "ConfigMap":
        problems += configmap_problems(obj)
    elif kind is None and isinstance(obj, dict) and set(obj) & RECIPE_SECTIONS:
        problems.append(
            "kind: missing; this looks like a recipe, not a manifest; use convoy k8s render "
            "RECIPE (or convoy k8s submit RECIPE)"
        )
    else:
        problems.append(f"kind: got {kind!r}; allowed: 'ConfigMap', 'PyTorchJob', {_kinds()}")
    return problems


RECIPE_SECTIONS = set(Job.model_fields)


def _kinds() -> str:
    return ", ".join(repr(k) for k in CRD_FILES)
