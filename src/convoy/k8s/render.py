"""Render a job as Kubernetes objects: a KubeRay ``RayJob`` (default), a long-lived
``RayCluster``, or a Kubeflow ``PyTorchJob``.

``render(job)`` returns plain dicts: the ConfigMap that carries the resolved recipe (unless
``k8s.recipe_in: inline``), then the workload. The pods run ``convoy train`` on that recipe,
so a recipe runs the same on a laptop and in a cluster; only three fields change on the way
(``cluster_job``): the run gets its final name, a local ``run.storage_dir`` moves onto the
shared PVC, and the launcher is the one the workload needs.

The defaults answer what KubeRay users hit most (research/k8s_facts.md, section 5): both
deadlines set, the cluster shut down a TTL after the job ends, a fixed-size worker group
(autoscaling is opt-in, v2, capped), a head that takes no train workers (``num-cpus: 0``,
``num-gpus: 0``), ``/dev/shm`` in memory, non-root pods with every capability dropped and
the RuntimeDefault seccomp profile, the dashboard behind a ClusterIP Service, Ray token auth.
"""

from __future__ import annotations

import base64
import copy
import math
import posixpath
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from convoy.config import Job, job_to_yaml
from convoy.engine.stop import GRACE_ENV
from convoy.k8s import naming
from convoy.k8s.grace import PRESTOP_MARGIN_S, grace_period_s
from convoy.k8s.quantities import parse_quantity, pod_range, quantity, worker_cpu, worker_gpus
from convoy.k8s.validate import check_job
from convoy.launchers.base import resolve_run

RECIPE_DIR = "/etc/convoy"
RECIPE_PATH = f"{RECIPE_DIR}/recipe.yaml"
INLINE_RECIPE_PATH = "/tmp/convoy-recipe.yaml"
RAY_API = "ray.io/v1"
KUBEFLOW_API = "kubeflow.org/v1"

# Ray images run as uid 1000, gid 100; runAsUser must be numeric for the kubelet to verify
# runAsNonRoot, and fsGroup 100 lets the pods write to the shared PVC.
POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 100,
    "fsGroup": 100,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
}


def render(job: Job, kind: str | None = None) -> list[dict[str, Any]]:
    """The objects that run ``job`` as ``kind`` (default ``k8s.kind``). Raises
    ``ConfigError`` for a job that pods cannot run (``convoy.k8s.validate.check_job``)."""
    kind = kind or job.k8s.kind
    job, name = cluster_job(job, kind)
    check_job(job, kind, name)
    objects = [recipe_configmap(job, name, kind)] if job.k8s.recipe_in == "configmap" else []
    if kind == "pytorchjob":
        return [*objects, pytorchjob(job, name)]
    if kind == "raycluster":
        return [*objects, raycluster(job, name)]
    return [*objects, rayjob(job, name)]


def cluster_job(job: Job, kind: str) -> tuple[Job, str]:
    """The job as the pods run it, and the objects' name (the run id).

    An unnamed run is named here, once, so every pod, retry and resubmission agrees on the
    run directory (and a resubmitted job resumes from its checkpoint). A local storage_dir
    moves under the PVC's mount and is declared shared; ``s3://`` stays as it is.
    """
    generated = job.run.name is None
    run_name = resolve_run(job).run.name if generated else job.run.name
    run: dict[str, Any] = {"name": run_name}
    storage = job.run.storage_dir
    if job.k8s.pvc and not storage.startswith("s3://"):
        mount = PurePosixPath(posixpath.normpath(job.k8s.pvc_mount_path))
        path = PurePosixPath(storage)
        joined = path if path.is_absolute() else mount / path
        normal = PurePosixPath(posixpath.normpath(joined))
        # A path that leaves the mount ('../..') is kept as written: validation refuses it.
        run["storage_dir"] = str(normal if normal.is_relative_to(mount) else joined)
        run["shared_storage"] = True
    k8s = job.k8s.model_copy(update={"kind": kind})
    launcher = "torchrun" if kind == "pytorchjob" else "ray"
    scaling = job.scaling.model_copy(update={"launcher": launcher})
    if kind == "pytorchjob":
        low, high = pod_range(job)
        nnodes = f"{low}:{high}" if low < high else str(high)
        torchrun = scaling.torchrun.model_copy(
            update={"nnodes": nnodes, "nproc_per_node": job.k8s.workers_per_pod}
        )
        scaling = scaling.model_copy(update={"torchrun": torchrun})
    resolved = job.model_copy(
        update={"run": job.run.model_copy(update=run), "scaling": scaling, "k8s": k8s}
    )
    name = naming.resource_name(resolved, kind, generated=generated and not job.k8s.name)
    return resolved, name


def recipe_configmap(job: Job, name: str, kind: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, naming.recipe_configmap_name(name), kind, name),
        "data": {PurePosixPath(RECIPE_PATH).name: job_to_yaml(job)},
    }


def _metadata(job: Job, object_name: str, kind: str, run_id: str) -> dict[str, Any]:
    return {
        "name": object_name,
        "namespace": job.k8s.namespace,
        "labels": naming.labels(job, run_id, kind),
        "annotations": {naming.RUN_NAME: str(job.run.name)},
    }


def recipe_command(job: Job, program: list[str]) -> str:
    """A shell command that runs ``program`` on the recipe: the ConfigMap's file, or the
    recipe decoded from base64 (inline: no quoting can break it)."""
    if job.k8s.recipe_in == "configmap":
        return shlex.join([*program, RECIPE_PATH])
    encoded = base64.b64encode(job_to_yaml(job).encode()).decode()
    write = f"echo {encoded} | base64 -d > {INLINE_RECIPE_PATH}"
    return f"{write} && exec {shlex.join([*program, INLINE_RECIPE_PATH])}"


# ---------------------------------------------------------------------------------------------
# Pods


def worker_resources(job: Job) -> dict[str, str]:
    k8s = job.k8s
    amounts = {"cpu": quantity(worker_cpu(job)), "memory": k8s.worker_memory}
    if worker_gpus(job):
        amounts[k8s.gpu_resource] = str(worker_gpus(job))
    return {**amounts, **k8s.extra_resources}


def head_shm(job: Job) -> str:
    """The head runs no train workers: its /dev/shm is ``k8s.shm_size`` or, if that is more,
    half the head's memory (the pod's limit counts it)."""
    half = parse_quantity(job.k8s.head_memory) / 2
    if parse_quantity(job.k8s.shm_size) <= half:
        return job.k8s.shm_size
    return f"{int(half // 2**20)}Mi"


def head_resources(job: Job) -> dict[str, str]:
    return {"cpu": quantity(job.k8s.head_cpu), "memory": job.k8s.head_memory}


@dataclass(frozen=True)
class PodParts:
    """What differs between the head, worker, submitter and PyTorch pods."""

    container: str
    resources: dict[str, str]
    command: list[str] | None = None
    recipe: bool = False
    """Mount the recipe ConfigMap (where ``convoy train`` or torchrun reads it)."""
    gpu: bool = False
    shared: bool = True
    """Mount the PVC and /dev/shm (not needed by the submitter)."""
    shm_size: str = ""
    """Size of /dev/shm (default ``k8s.shm_size``)."""
    extra_labels: dict[str, str] = field(default_factory=dict)
    trains: bool = True
    """Runs training (or Ray under it): gets the grace period a save needs, and the
    ``CONVOY_STOP_GRACE_S`` that turns its SIGTERM into a notice with a deadline."""
    drains_on_stop: bool = False
    """A Ray worker pod: its preStop hook drains its Ray node as a preemption, so Ray Train's
    workers on it save before the SIGTERM ends Ray (``convoy k8s drain-node``)."""


def pod_template(job: Job, name: str, kind: str, parts: PodParts) -> dict[str, Any]:
    k8s = job.k8s
    spec: dict[str, Any] = {
        "securityContext": POD_SECURITY,
        "containers": [_container(job, parts)],
    }
    if parts.trains:
        spec["terminationGracePeriodSeconds"] = grace_period_s(job)
    volumes = _volumes(job, name, parts)
    if volumes:
        spec["volumes"] = volumes
    if k8s.service_account:
        spec["serviceAccountName"] = k8s.service_account
    if k8s.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in k8s.image_pull_secrets]
    selector = dict(k8s.node_selector)
    tolerations = list(k8s.tolerations)
    if parts.gpu:
        selector[k8s.gpu_node_label] = str(k8s.gpu_type)
        tolerations.append({"key": k8s.gpu_resource, "operator": "Exists", "effect": "NoSchedule"})
    if selector:
        spec["nodeSelector"] = selector
    if tolerations:
        spec["tolerations"] = tolerations
    pod_labels = {**naming.labels(job, name, kind), **parts.extra_labels}
    return {"metadata": {"labels": pod_labels}, "spec": spec}


def _container(job: Job, parts: PodParts) -> dict[str, Any]:
    k8s = job.k8s
    container: dict[str, Any] = {
        "name": parts.container,
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "resources": {"requests": dict(parts.resources), "limits": dict(parts.resources)},
        "securityContext": CONTAINER_SECURITY,
    }
    if parts.command:
        container["command"] = parts.command
    env = dict(k8s.env)
    if parts.trains:
        env.setdefault(GRACE_ENV, str(grace_period_s(job)))
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in sorted(env.items())]
    if parts.drains_on_stop:
        deadline = max(1, grace_period_s(job) - PRESTOP_MARGIN_S)
        drain = ["convoy", "k8s", "drain-node", f"--deadline-s={deadline}"]
        container["lifecycle"] = {"preStop": {"exec": {"command": drain}}}
    if k8s.env_secrets:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in k8s.env_secrets]
    mounts = _mounts(job, parts)
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _mounts(job: Job, parts: PodParts) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = []
    if parts.shared:
        mounts += [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
        if job.k8s.pvc:
            mounts.append({"name": "shared", "mountPath": job.k8s.pvc_mount_path})
    if parts.recipe and job.k8s.recipe_in == "configmap":
        mounts.append({"name": "recipe", "mountPath": RECIPE_DIR, "readOnly": True})
    return mounts


def _volumes(job: Job, name: str, parts: PodParts) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = []
    if parts.shared:
        # /tmp (Ray's session directory, the inline recipe) as an emptyDir, as KubeRay's
        # samples mount /tmp/ray: the container's own layer stays clean and bounded.
        volumes += [
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": parts.shm_size or job.k8s.shm_size},
            },
            {"name": "tmp", "emptyDir": {"sizeLimit": job.k8s.tmp_size}},
        ]
        if job.k8s.pvc:
            volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": job.k8s.pvc}})
    if parts.recipe and job.k8s.recipe_in == "configmap":
        volumes.append(
            {"name": "recipe", "configMap": {"name": naming.recipe_configmap_name(name)}}
        )
    return volumes


# ---------------------------------------------------------------------------------------------
# KubeRay


def ray_cluster_spec(job: Job, name: str, kind: str) -> dict[str, Any]:
    k8s = job.k8s
    low, high = pod_range(job)
    head = PodParts("ray-head", head_resources(job), recipe=True, shm_size=head_shm(job))
    worker = PodParts(
        "ray-worker", worker_resources(job), gpu=bool(worker_gpus(job)), drains_on_stop=True
    )
    group: dict[str, Any] = {
        "groupName": "workers",
        "replicas": high,
        "minReplicas": high,
        "maxReplicas": high,
        "numOfHosts": 1,
        "rayStartParams": {},  # num-cpus, num-gpus and memory come from the pod's limits
        "template": pod_template(job, name, kind, worker),
    }
    spec: dict[str, Any] = {
        "rayVersion": k8s.ray_version,
        # "token" must be written out: KubeRay treats an empty mode as auth off.
        "authOptions": {"mode": "token"},
        "enableInTreeAutoscaling": k8s.autoscaling,
        "headGroupSpec": {
            "serviceType": "ClusterIP",
            # The head runs the driver and Ray Train's controller (0 CPUs), never a worker,
            # and must not claim a GPU it might see on a GPU node.
            "rayStartParams": {"num-cpus": "0", "num-gpus": "0", "dashboard-host": "0.0.0.0"},
            "template": pod_template(job, name, kind, head),
        },
        "workerGroupSpecs": [group],
    }
    if k8s.autoscaling:
        cap = k8s.max_worker_pods or high
        group.update({"replicas": low, "minReplicas": low, "maxReplicas": cap})
        spec["autoscalerOptions"] = {
            "version": "v2",
            "upscalingMode": "Default",
            "idleTimeoutSeconds": 60,
            "securityContext": CONTAINER_SECURITY,
            "resources": {
                "requests": {"cpu": "500m", "memory": "512Mi"},
                "limits": {"cpu": "500m", "memory": "512Mi"},
            },
        }
    return spec


def rayjob(job: Job, name: str) -> dict[str, Any]:
    k8s = job.k8s
    submitter = PodParts(
        "ray-job-submitter",
        {"cpu": "500m", "memory": "512Mi"},
        shared=False,
        extra_labels={"convoy.io/role": "submitter"},
        trains=False,
    )
    submitter_pod = pod_template(job, name, "rayjob", submitter)
    # A batch/v1 Job's pods may not restart in place; KubeRay fills in the command.
    submitter_pod["spec"]["restartPolicy"] = "Never"
    return {
        "apiVersion": RAY_API,
        "kind": "RayJob",
        "metadata": _metadata(job, name, "rayjob", name),
        "spec": {
            "entrypoint": recipe_command(job, ["convoy", "train"]),
            "submissionMode": "K8sJobMode",
            # A fixed submission id: a retried submitter finds the job instead of
            # submitting it twice.
            "jobId": name,
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": k8s.ttl_after_finished_s,
            "activeDeadlineSeconds": k8s.active_deadline_s,
            "preRunningDeadlineSeconds": k8s.pre_running_deadline_s,
            "backoffLimit": k8s.backoff_limit,
            "submitterPodTemplate": submitter_pod,
            "rayClusterSpec": ray_cluster_spec(job, name, "rayjob"),
        },
    }


def raycluster(job: Job, name: str) -> dict[str, Any]:
    return {
        "apiVersion": RAY_API,
        "kind": "RayCluster",
        "metadata": _metadata(job, name, "raycluster", name),
        "spec": ray_cluster_spec(job, name, "raycluster"),
    }


# ---------------------------------------------------------------------------------------------
# Kubeflow PyTorchJob (the maintained successor of the TorchElastic ElasticJob)


TORCHRUN_WORKER = ["python", "-m", "torch.distributed.run", "-m", "convoy.launchers.torchrun"]
"""Why torchrun on ``convoy.launchers.torchrun`` and not ``convoy train``: with an
``elasticPolicy`` the training operator hands each pod its share of the rendezvous through
``PET_*`` variables (``PET_NNODES=MIN:MAX``, ``PET_RDZV_ENDPOINT=<job>-worker-0:29400``,
``PET_NPROC_PER_NODE``, ``PET_MAX_RESTARTS``), which torchrun reads as its defaults. ``convoy
train`` would start its own torchrun with a rendezvous on a free local port, which is right on
one machine and wrong across pods. The worker module is the same one Convoy's torchrun
launcher runs, so the engine, config and outputs are those of ``scaling.launcher: torchrun``."""


def pytorchjob(job: Job, name: str) -> dict[str, Any]:
    k8s = job.k8s
    low, high = pod_range(job)
    worker = PodParts(
        "pytorch",  # the training operator looks for a container of this name
        worker_resources(job),
        command=["sh", "-c", recipe_command(job, TORCHRUN_WORKER)],
        recipe=True,
        gpu=bool(worker_gpus(job)),
    )
    return {
        "apiVersion": KUBEFLOW_API,
        "kind": "PyTorchJob",
        "metadata": _metadata(job, name, "pytorchjob", name),
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",  # the rendezvous lives in worker 0: no etcd to run
                "minReplicas": low,
                "maxReplicas": high,
                "maxRestarts": job.scaling.max_failures,
            },
            "nprocPerNode": str(k8s.workers_per_pod),
            "runPolicy": {
                # Finished pods stay (with their logs) until the TTL deletes the job.
                "cleanPodPolicy": "None",
                "ttlSecondsAfterFinished": k8s.ttl_after_finished_s,
                "activeDeadlineSeconds": k8s.active_deadline_s,
                "backoffLimit": k8s.backoff_limit,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": high,
                    # ExitCode: restart on signals and infrastructure exits (128+), fail at
                    # once on the program's own errors (a bad config exits 1 or 2).
                    "restartPolicy": "ExitCode",
                    "template": pod_template(job, name, "pytorchjob", worker),
                }
            },
        },
    }


# ---------------------------------------------------------------------------------------------
# What the pods of a rendered RayJob run, for tests that play the pods on test hosts


@dataclass(frozen=True)
class RayStartPlan:
    """The processes of a rendered RayJob, as KubeRay v1.7 would start them in its pods."""

    head: list[str]
    """``ray start --head ...`` for the head pod."""
    workers: list[list[str]]
    """``ray start --address=...`` for each worker pod (``replicas`` of them)."""
    env: dict[str, str]
    """Environment of every Ray container (the job's ``k8s.env`` and Ray token auth)."""
    entrypoint: str
    """The RayJob's entrypoint, run on the head by ``ray job submit``."""
    files: dict[str, str]
    """Files the pods mount (the recipe ConfigMap), by path."""


def ray_start_commands(
    manifests: list[dict[str, Any]],
    head_address: str,
    auth_token: str | None = None,
    gcs_port: int = 6379,
) -> RayStartPlan:
    """The ``ray start`` command lines of a rendered RayJob's head and workers, as KubeRay
    builds them (``rayStartParams`` plus ``num-cpus`` / ``num-gpus`` / ``memory`` from the
    container limits when not set), with the workers joining ``head_address:gcs_port``."""
    by_kind = {m["kind"]: m for m in manifests}
    cluster = by_kind["RayJob"]["spec"]["rayClusterSpec"]
    head_group = cluster["headGroupSpec"]
    head = ["ray", "start", "--head", "--block", f"--port={gcs_port}"]
    head += _start_flags(head_group)
    workers = []
    for group in cluster["workerGroupSpecs"]:
        command = ["ray", "start", "--block", f"--address={head_address}:{gcs_port}"]
        command += _start_flags(group)
        workers += [list(command) for _ in range(group["replicas"] * group.get("numOfHosts", 1))]
    container = head_group["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    if cluster.get("authOptions", {}).get("mode") == "token":
        env["RAY_AUTH_MODE"] = "token"
        if auth_token:
            env["RAY_AUTH_TOKEN"] = auth_token
    files = {
        f"{RECIPE_DIR}/{key}": text
        for key, text in by_kind.get("ConfigMap", {}).get("data", {}).items()
    }
    return RayStartPlan(head, workers, env, by_kind["RayJob"]["spec"]["entrypoint"], files)


def _start_flags(group: dict[str, Any]) -> list[str]:
    params = dict(group.get("rayStartParams", {}))
    limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    if "num-cpus" not in params and "cpu" in limits:
        params["num-cpus"] = str(math.ceil(parse_quantity(limits["cpu"])))
    # KubeRay takes the first non-zero limit whose name ends in "gpu" (nvidia.com/gpu,
    # amd.com/gpu, ...), not only NVIDIA's: k8s.gpu_resource may name another vendor's.
    gpus = [v for k, v in limits.items() if k.endswith("gpu") and parse_quantity(v)]
    if "num-gpus" not in params and gpus:
        params["num-gpus"] = str(math.ceil(parse_quantity(gpus[0])))
    if "memory" not in params and "memory" in limits:
        params["memory"] = str(int(parse_quantity(limits["memory"])))
    return [f"--{key}={value}" for key, value in sorted(params.items())]


class _Dumper(yaml.SafeDumper):
    """Block-style YAML without anchors (render shares dicts between pods), multi-line
    strings (the recipe) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def to_yaml(manifests: list[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML file (``kubectl apply -f`` reads it)."""
    return yaml.dump_all(copy.deepcopy(manifests), Dumper=_Dumper, sort_keys=False)
