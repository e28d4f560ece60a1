"""The job against its pods: ``check_job(job, kind, name)`` raises the first ``ConfigError``
(field, value, what is allowed) for a job whose pods could not run or whose objects could
not be named as it asks (image, names, labels, storage, fit, scaling, recipe).

``render`` calls it, so no manifest is ever written for a job that cannot run.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import PurePosixPath

from convoy.config import Job
from convoy.errors import ConfigError
from convoy.k8s import naming
from convoy.k8s.quantities import parse_quantity, pod_range, version_tuple, worker_cpu, worker_gpus


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
    if version_tuple(k8s.ray_version) < (2, 52, 0):
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


QUANTITY = re.compile(
    r"^[+-]?(\d+(\.\d*)?|\.\d+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(\d+(\.\d*)?|\.\d+)))?$"
)
