"""The ``k8s`` section: how ``convoy k8s`` runs the job on Kubernetes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from convoy.config.base import Section


class K8sConfig(Section):
    """How ``convoy k8s`` runs the job on Kubernetes: a KubeRay ``RayJob`` (default), a
    long-lived ``RayCluster``, or a Kubeflow ``PyTorchJob``. ``convoy train`` ignores it;
    ``convoy.k8s.validate`` checks it (with the rest of the job) before anything is sent."""

    kind: Literal["rayjob", "raycluster", "pytorchjob"] = "rayjob"
    """What ``convoy k8s render`` writes (``--kind`` overrides it)."""
    image: str | None = None
    """Image with Convoy and Ray 2.60.0 installed, pinned by tag or digest
    (``registry.example.com/convoy:0.1.0``); untagged and ``:latest`` images are refused."""
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)
    namespace: str = "default"
    name: str | None = None
    """Name of the objects (DNS-1035; a RayJob at most 47 characters); default: from
    ``run.name``. It is also the run id: the ``convoy.io/run-id`` label and the Ray job id."""
    service_account: str | None = None
    """Service account of every pod (IRSA / workload identity for S3, for example)."""
    workers_per_pod: Annotated[int, Field(gt=0)] = 1
    """Train workers per worker pod (e.g. 8 on an 8-GPU node)."""
    worker_cpu: Annotated[float, Field(gt=0)] | None = None
    """CPUs of one worker pod (request = limit); default: scaling.cpus_per_worker x
    workers_per_pod."""
    worker_memory: str = "8Gi"
    """Memory of one worker pod (request = limit), ``/dev/shm`` included."""
    worker_gpus: Annotated[int, Field(ge=0)] | None = None
    """GPUs of one worker pod; default with scaling.use_gpu: GPUs per worker x workers_per_pod."""
    head_cpu: Annotated[float, Field(gt=0)] = 2.0
    """CPUs of the Ray head pod; the head takes no train workers (``num-cpus: 0``)."""
    head_memory: str = "4Gi"
    gpu_type: str | None = None
    """The GPU model worker pods must land on, matched against ``gpu_node_label``
    (e.g. ``NVIDIA-H100-80GB-HBM3``); required with scaling.use_gpu."""
    gpu_node_label: str = "nvidia.com/gpu.product"
    """The node label that names the GPU model (NVIDIA GPU feature discovery sets this one)."""
    gpu_resource: str = "nvidia.com/gpu"
    extra_resources: dict[str, str] = Field(default_factory=dict)
    """More limits per worker pod, e.g. ``vpc.amazonaws.com/efa: "4"``."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels every pod needs: head, workers and the RayJob's submitter alike (e.g.
    ``node.kubernetes.io/instance-type``); GPU pods also get ``gpu_node_label: gpu_type``."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Pod tolerations; GPU pods also get ``{key: <gpu_resource>, operator: Exists}``."""
    pvc: str | None = None
    """A ReadWriteMany PVC that every pod mounts at ``pvc_mount_path``; the run is stored on it
    (``run.storage_dir`` becomes ``<pvc_mount_path>/<storage_dir>``). Without it,
    ``run.storage_dir`` must be ``s3://``: the pods share no other filesystem."""
    pvc_mount_path: str = "/mnt/shared"
    shm_size: str = "2Gi"
    """Size of ``/dev/shm`` (a memory ``emptyDir``: NCCL and DataLoader workers use it)."""
    tmp_size: str = "4Gi"
    """Size limit of ``/tmp`` (an ``emptyDir`` on the node's disk: Ray's session directory,
    logs and spilled objects); a pod that writes more is evicted."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every Ray / PyTorch container (e.g. ``AWS_ENDPOINT_URL``)."""
    termination_grace_s: Annotated[int, Field(gt=0)] | None = None
    """``terminationGracePeriodSeconds`` of the training pods: the time from a stop (a spot
    reclaim, a node drain, a deleted pod) to the kill, in which the run saves the step it
    finished. Default: 30 s plus twice the planned save (the checkpoint bytes one pod writes,
    at 100 MiB/s); ``convoy k8s validate`` warns when the run's last measured save is longer."""
    env_secrets: list[str] = Field(default_factory=list)
    """Secrets whose keys become environment variables in every pod (S3 credentials)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """More labels on every object (e.g. ``kueue.x-k8s.io/queue-name``)."""
    recipe_in: Literal["configmap", "inline"] = "configmap"
    """How the resolved recipe reaches the pods: a ConfigMap mounted at /etc/convoy, or inline
    in the entrypoint (no extra object; limited by the entrypoint's size)."""
    active_deadline_s: Annotated[int, Field(gt=0)] = 86_400
    """Fail the job after this long, whatever it is doing (never retried)."""
    pre_running_deadline_s: Annotated[int, Field(gt=0)] = 1_200
    """Fail the job if it is not Running after this long (image pulls, unschedulable GPUs)."""
    ttl_after_finished_s: Annotated[int, Field(ge=0)] = 3_600
    """Delete the Ray cluster this long after the job ends (its pods' logs go with it)."""
    backoff_limit: Annotated[int, Field(ge=0)] = 0
    """Retries of the whole job, each on a new Ray cluster (resuming from the checkpoint)."""
    autoscaling: bool = False
    """Opt in to the KubeRay autoscaler (v2) between the min and max worker pods; training
    defaults to a fixed-size worker group."""
    max_worker_pods: Annotated[int, Field(gt=0)] | None = None
    """With autoscaling: the cap on worker pods (required)."""
    ray_version: str = "2.60.0"
    """The Ray in the image; token auth needs 2.52 or later."""

    @field_validator("env", "extra_resources", "node_selector", "labels", mode="before")
    @classmethod
    def _scalars_as_strings(cls, value: Any) -> Any:
        """YAML reads ``OMP_NUM_THREADS: 4`` or ``efa: 4`` as a number and ``x: true`` as a
        bool; these maps hold strings (``"4"``, ``"true"``), so scalars are written out."""
        if not isinstance(value, dict):
            return value
        return {
            k: ("true" if v else "false") if isinstance(v, bool)
            else str(v) if isinstance(v, (int, float)) else v
            for k, v in value.items()
        }  # fmt: skip
