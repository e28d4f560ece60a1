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

The ``jsonschema`` and ``cel-python`` packages are imported only when a manifest is checked.
"""

from __future__ import annotations

import difflib
import functools
import posixpath
import re
from importlib import resources
from pathlib import PurePosixPath
from typing import Any

import yaml

from convoy.config import Job
from convoy.errors import ConfigError
from convoy.k8s import K8sError, naming, require

# ---------------------------------------------------------------------------------------------
# The job against its pods


def check_job(job: Job, kind: str, name: str) -> None:
    """Raise ``ConfigError`` for the first thing that stops ``job`` running as ``kind``."""
    checks = (
        _check_image,
        _check_names,
        _check_labels,
        _check_storage,
        _check_fit,
        _check_scaling,
        _check_recipe,
    )
    for check in checks:
        check(job, kind, name)


def _check_image(job: Job, kind: str, name: str) -> None:
    image = job.k8s.image
    example = "e.g. registry.example.com/convoy:0.1.0 or an @sha256: digest"
    if not image:
        raise ConfigError(
            "k8s.image",
            image,
            f"set an image with Convoy and Ray {job.k8s.ray_version} installed, pinned by a "
            f"tag or digest ({example})",
        )
    reference = naming.IMAGE_REFERENCE.match(image)
    if not reference or len(reference["name"]) > 255:
        raise ConfigError(
            "k8s.image",
            image,
            "an image reference: [registry[:port]/]repository[:tag][@sha256:<64 hex>], the "
            "repository in lowercase letters, digits and separators (. _ __ -), one tag of "
            f"letters, digits, '_', '.' and '-' ({example})",
        )
    digest, tag = reference["digest"], reference["tag"]
    if digest:
        if not naming.SHA256_DIGEST.match(digest):
            raise ConfigError(
                "k8s.image",
                image,
                "a digest is sha256: and 64 lowercase hex digits (docker inspect --format "
                "'{{index .RepoDigests 0}}' IMAGE prints it)",
            )
        return
    if not tag:
        raise ConfigError("k8s.image", image, f"the image needs a version tag ({example})")
    if tag == "latest":
        raise ConfigError(
            "k8s.image",
            image,
            "':latest' is refused: it moves, so a retried or late-joining pod may run other "
            f"code than the rest, and IfNotPresent keeps whatever a node pulled first; pin a "
            f"version tag or a digest ({example})",
        )


def _check_names(job: Job, kind: str, name: str) -> None:
    k8s = job.k8s
    limit = naming.MAX_NAME[kind]
    if not naming.is_dns1035(name, limit):
        field = "k8s.name" if k8s.name else "run.name"
        shown = k8s.name or job.run.name
        raise ConfigError(
            field,
            shown,
            f"the {kind} would be named {name!r} ({len(name)} characters); KubeRay and "
            f"Kubernetes allow a DNS-1035 label of at most {limit} characters (lowercase "
            "letters, digits and '-', starting with a letter and ending with a letter or "
            "digit, e.g. 'my-run'); set k8s.name to such a name",
        )
    if not naming.is_dns1123_label(k8s.namespace):
        raise ConfigError("k8s.namespace", k8s.namespace, "a DNS-1123 label, e.g. 'ml-team'")
    for field, value in [
        ("k8s.pvc", k8s.pvc),
        ("k8s.service_account", k8s.service_account),
        *[("k8s.env_secrets", s) for s in k8s.env_secrets],
        *[("k8s.image_pull_secrets", s) for s in k8s.image_pull_secrets],
    ]:
        if value is not None and not naming.is_dns1123_subdomain(value):
            raise ConfigError(
                field,
                value,
                "a DNS-1123 name: at most 253 lowercase letters, digits, '-' and '.', "
                "starting and ending with a letter or digit",
            )


LABEL_KEY = (
    "a label key: [prefix/]name, the name at most 63 letters, digits, '-', '_' and '.' "
    "starting and ending with a letter or digit, the prefix a DNS-1123 subdomain "
    "(e.g. node.kubernetes.io/instance-type)"
)
LABEL_VALUE = (
    "a label value: at most 63 letters, digits, '-', '_' and '.', starting and ending with a "
    "letter or digit (no spaces; e.g. NVIDIA-H100-80GB-HBM3)"
)
RESOURCE_NAME = (
    "an extended resource name, domain/name as the device plugin advertises it (e.g. "
    "nvidia.com/gpu, amd.com/gpu, vpc.amazonaws.com/efa)"
)


def _check_labels(job: Job, kind: str, name: str) -> None:
    """What lands in pod labels, node selectors and resource limits: a bad one is accepted
    by the API server's schema only to leave the pod Pending until the deadline."""
    k8s = job.k8s
    for field, mapping in [("k8s.labels", k8s.labels), ("k8s.node_selector", k8s.node_selector)]:
        for key, value in mapping.items():
            if not naming.is_qualified_name(key):
                raise ConfigError(f"{field}", key, LABEL_KEY)
            if not naming.is_label_value(value):
                raise ConfigError(f"{field}.{key}", value, LABEL_VALUE)
    if not naming.is_qualified_name(k8s.gpu_node_label):
        raise ConfigError("k8s.gpu_node_label", k8s.gpu_node_label, LABEL_KEY)
    if k8s.gpu_type is not None and not naming.is_label_value(k8s.gpu_type):
        raise ConfigError(
            "k8s.gpu_type",
            k8s.gpu_type,
            f"{LABEL_VALUE}; it must equal the node label {k8s.gpu_node_label} (kubectl get "
            f"nodes -L {k8s.gpu_node_label})",
        )
    if not naming.is_extended_resource(k8s.gpu_resource):
        raise ConfigError("k8s.gpu_resource", k8s.gpu_resource, RESOURCE_NAME)
    for key in k8s.extra_resources:
        if key in ("cpu", "memory") or not naming.is_resource_name(key):
            raise ConfigError(
                "k8s.extra_resources",
                key,
                f"{RESOURCE_NAME}, ephemeral-storage or hugepages-<size> (cpu and memory are "
                "k8s.worker_cpu and k8s.worker_memory)",
            )


def _check_storage(job: Job, kind: str, name: str) -> None:
    storage = job.run.storage_dir
    if storage.startswith("s3://"):
        return
    if not job.k8s.pvc:
        raise ConfigError(
            "run.storage_dir",
            storage,
            "the pods share no filesystem, and Ray Train needs one storage every node "
            "reaches; set k8s.pvc (a ReadWriteMany PVC) or run.storage_dir=s3://bucket/prefix",
        )
    raw = job.k8s.pvc_mount_path
    mount = PurePosixPath(posixpath.normpath(raw))
    if not mount.is_absolute() or _system_path(mount):
        raise ConfigError(
            "k8s.pvc_mount_path",
            raw,
            "an absolute path of its own, e.g. /mnt/shared; not /, a system directory "
            f"({', '.join(SYSTEM_DIRS)} or under them), /tmp, /dev/shm or /etc/convoy",
        )
    if not PurePosixPath(posixpath.normpath(storage)).is_relative_to(mount):
        raise ConfigError(
            "run.storage_dir",
            storage,
            f"with k8s.pvc the run is stored on the PVC: a relative path that stays on it "
            f"(no '..' out of it), or one under k8s.pvc_mount_path {str(mount)!r}",
        )


SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin",
               "/sys", "/usr", "/tmp")  # fmt: skip
"""Mounting the PVC on (or under) one of these hides what the image or kernel put there."""


def _system_path(path: PurePosixPath) -> bool:
    if str(path) in {"/", "/home", "/home/ray", "/opt", "/var", "/root"}:
        return True
    return any(path.is_relative_to(d) for d in SYSTEM_DIRS)


def _check_fit(job: Job, kind: str, name: str) -> None:
    from convoy.k8s.render import parse_quantity, worker_cpu, worker_gpus

    k8s, scaling = job.k8s, job.scaling
    per_pod = k8s.workers_per_pod
    for field, text in [
        ("k8s.worker_memory", k8s.worker_memory),
        ("k8s.head_memory", k8s.head_memory),
        ("k8s.shm_size", k8s.shm_size),
        *[(f"k8s.extra_resources.{key}", v) for key, v in k8s.extra_resources.items()],
    ]:
        if not QUANTITY.match(str(text)):
            raise ConfigError(field, text, "a Kubernetes quantity, e.g. 8Gi, 512Mi or 4")
    cpus_needed = scaling.cpus_per_worker * per_pod
    if cpus_needed > worker_cpu(job) + 1e-9:
        raise ConfigError(
            "k8s.worker_cpu",
            k8s.worker_cpu,
            f"a worker pod holds k8s.workers_per_pod {per_pod} x scaling.cpus_per_worker "
            f"{scaling.cpus_per_worker} = {cpus_needed:g} CPUs; raise k8s.worker_cpu or lower "
            "one of those",
        )
    if parse_quantity(k8s.shm_size) >= parse_quantity(k8s.worker_memory):
        raise ConfigError(
            "k8s.shm_size",
            k8s.shm_size,
            f"/dev/shm is memory the pod's limit counts, so it must be below "
            f"k8s.worker_memory {k8s.worker_memory}",
        )
    gpus = worker_gpus(job)
    if not scaling.use_gpu:
        if gpus:
            raise ConfigError(
                "k8s.worker_gpus",
                gpus,
                "scaling.use_gpu is false, so the GPUs would sit idle; set scaling.use_gpu=true "
                "or k8s.worker_gpus=0",
            )
        return
    if not k8s.gpu_type:
        raise ConfigError(
            "k8s.gpu_type",
            None,
            f"scaling.use_gpu asks for GPUs: name the model worker pods must land on, as the "
            f"node label {k8s.gpu_node_label} spells it (e.g. NVIDIA-H100-80GB-HBM3)",
        )
    gpus_needed = (scaling.gpus_per_worker or 1.0) * per_pod
    if gpus_needed > gpus + 1e-9:
        raise ConfigError(
            "k8s.worker_gpus",
            gpus,
            f"a worker pod holds k8s.workers_per_pod {per_pod} x "
            f"{scaling.gpus_per_worker or 1.0:g} GPU(s) per worker (scaling.gpus_per_worker) = "
            f"{gpus_needed:g}; raise k8s.worker_gpus or lower one of those",
        )


def _check_scaling(job: Job, kind: str, name: str) -> None:
    from convoy.k8s.render import pod_range

    k8s, scaling = job.k8s, job.scaling
    _, high = pod_range(job)
    if kind == "pytorchjob":
        if k8s.autoscaling:
            raise ConfigError(
                "k8s.autoscaling",
                True,
                "a PyTorchJob resizes within its elastic range (scaling.num_workers: "
                "[MIN, MAX]), not through the Ray autoscaler; set k8s.autoscaling=false",
            )
        for count in {scaling.min_workers, scaling.max_workers}:
            if count % k8s.workers_per_pod:
                raise ConfigError(
                    "scaling.num_workers",
                    scaling.num_workers,
                    f"torchrun starts k8s.workers_per_pod {k8s.workers_per_pod} workers on "
                    "every pod, so each bound must be a multiple of it",
                )
        return
    if k8s.autoscaling and k8s.max_worker_pods is None:
        raise ConfigError(
            "k8s.max_worker_pods",
            None,
            "with k8s.autoscaling the worker group needs a cap (an uncapped autoscaler can ask "
            f"for hundreds of pods); at least {high} for scaling.num_workers",
        )
    if k8s.autoscaling and k8s.max_worker_pods is not None and k8s.max_worker_pods < high:
        raise ConfigError(
            "k8s.max_worker_pods",
            k8s.max_worker_pods,
            f"scaling.num_workers {scaling.max_workers} at k8s.workers_per_pod "
            f"{k8s.workers_per_pod} needs {high} worker pods",
        )
    if k8s.active_deadline_s < k8s.pre_running_deadline_s:
        raise ConfigError(
            "k8s.active_deadline_s",
            k8s.active_deadline_s,
            f"the whole job's deadline is below k8s.pre_running_deadline_s "
            f"{k8s.pre_running_deadline_s} (the time allowed to start); raise it or lower that",
        )
    if _version(k8s.ray_version) < (2, 52, 0):
        raise ConfigError(
            "k8s.ray_version",
            k8s.ray_version,
            "Ray token auth (always on) needs Ray 2.52.0 or later; Convoy uses 2.60.0",
        )


def _check_recipe(job: Job, kind: str, name: str) -> None:
    if kind == "raycluster" and job.k8s.recipe_in == "inline":
        raise ConfigError(
            "k8s.recipe_in",
            "inline",
            "an inline recipe travels in a RayJob's entrypoint or a PyTorchJob's command, and "
            "a RayCluster has neither; use k8s.recipe_in=configmap (the head mounts it at "
            "/etc/convoy/recipe.yaml) or --kind rayjob",
        )
    for field, text in [("k8s.tmp_size", job.k8s.tmp_size)]:
        if not QUANTITY.match(str(text)):
            raise ConfigError(field, text, "a Kubernetes quantity, e.g. 8Gi, 512Mi or 4")


def _version(text: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", text)[:3]
    return tuple(int(p) for p in parts) if parts else (0,)


QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$"
)


# ---------------------------------------------------------------------------------------------
# A manifest against the CRDs, their CEL rules and the operator's checks


CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


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


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The strict JSON schema of ``kind``'s v1 version in the shipped CRD."""
    text = resources.files("convoy.k8s").joinpath("crds", CRD_FILES[kind]).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(text, Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """An OpenAPI v3 structural schema as the JSON schema an API server enforces, plus
    ``kubectl --validate=strict``: objects with declared properties refuse others unless
    ``x-kubernetes-preserve-unknown-fields``; ``x-kubernetes-int-or-string`` takes either."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def json_path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def schema_problems(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    jsonschema = require("jsonschema")
    validator = jsonschema.Draft7Validator(schema)
    problems = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
        problems += _describe(error)
    return problems


def _describe(error: Any) -> list[str]:
    path = json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(known))
        lines = []
        for key in unknown:
            guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            where = f"{path}.{key}" if error.absolute_path else key
            lines.append(f"{where}: unknown field{hint}; allowed: {', '.join(known)}")
        return lines
    if error.validator == "anyOf" and all(
        s.get("type") in {"integer", "string"} for s in error.validator_value
    ):
        return [
            f"{path}: got {error.instance!r}; expected an integer or a quantity string "
            "(e.g. 500m, 8Gi, 2)"
        ]
    if error.validator == "pattern" and "[numkMGTPE]" in str(error.validator_value):
        return [
            f"{path}: got {error.instance!r}; expected an integer or a quantity string "
            "(e.g. 500m, 8Gi, 2)"
        ]
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in error.validator_value)
        return [f"{path}: got {error.instance!r}; allowed: {allowed}"]
    if error.validator == "required":
        return [f"{path}: {error.message}"]
    return [f"{path}: got {error.instance!r}; {error.message.split(' is ', 1)[-1]}"]


def cel_problems(obj: Any, schema: dict[str, Any], path: tuple[Any, ...] = ()) -> list[str]:
    """Evaluate the schema's CEL rules wherever the manifest has a value."""
    problems = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: only an update has an old object
        if not _cel_holds(rule["rule"], obj):
            message = rule.get("message") or f"must satisfy {rule['rule']}"
            problems.append(f"{json_path(path)}: {message}")
    if isinstance(obj, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child:
                problems += cel_problems(value, child, (*path, key))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            problems += cel_problems(value, schema["items"], (*path, i))
    return problems


@functools.cache
def _cel_program(rule: str) -> Any:
    celpy = require("celpy")
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _cel_holds(rule: str, value: Any) -> bool:
    celpy = require("celpy")
    try:
        result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception:  # an evaluation error fails the rule, as on an API server
        return False
    # celpy's BoolType is an int; an error comes back as a CELEvalError value, not raised.
    return isinstance(result, int) and bool(result)


# ---------------------------------------------------------------------------------------------
# What the KubeRay operator checks at reconcile time (v1.7.0, controllers/ray/utils/validation.go)


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
        if not version or _version(version) < (2, 52, 0):
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
    return _version(spec.get("rayVersion", "")) >= (2, 47, 0)


def _restart_policy(group: dict[str, Any]) -> str:
    return str(group.get("template", {}).get("spec", {}).get("restartPolicy", ""))


def _env(group: dict[str, Any]) -> dict[str, str]:
    containers = group.get("template", {}).get("spec", {}).get("containers") or [{}]
    return {e.get("name"): str(e.get("value", "")) for e in containers[0].get("env", [])}


# ---------------------------------------------------------------------------------------------
# Convoy's floor for pods, and the objects that have no shipped CRD


def pod_policy_problems(obj: dict[str, Any]) -> list[str]:
    """No privileged containers, host namespaces or root; the dashboard stays in-cluster."""
    problems = []
    for where, pod in _pod_templates(obj):
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


def _pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
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


def configmap_problems(obj: dict[str, Any]) -> list[str]:
    problems = []
    name = obj.get("metadata", {}).get("name", "")
    if not naming.is_dns1123_subdomain(name):
        problems.append(f"metadata.name: got {name!r}; a DNS-1123 name")
    data = obj.get("data") or {}
    size = sum(len(str(v).encode()) for v in data.values())
    if size > 1_048_576:
        problems.append(f"data: {size} bytes; a ConfigMap holds at most 1 MiB")
    key = PurePosixPath(RECIPE_PATH).name
    if key in data:
        try:
            recipe_job(str(data[key]))
        except ConfigError as exc:
            problems.append(f"ConfigMap/{name} data.{key}: {exc}")
    return problems


RECIPE_PATH = "/etc/convoy/recipe.yaml"  # convoy.k8s.render.RECIPE_PATH


def recipe_job(text: str) -> Job:
    """The recipe a ConfigMap carries, loaded as ``convoy train`` in the pod will load it."""
    from convoy.config import job_from_dict

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("recipe", "...", f"not valid YAML ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError("recipe", data, "the top level must be a mapping of sections")
    return job_from_dict(data)


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


# ---------------------------------------------------------------------------------------------
# Across the manifests of one file: the workload against its recipe ConfigMap


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
        for where, pod in _pod_templates(obj):
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
    from convoy.k8s.render import pod_range

    pods = dict(_pod_templates(obj))
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
