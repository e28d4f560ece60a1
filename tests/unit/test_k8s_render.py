"""``convoy k8s render``: what a job becomes on Kubernetes (no cluster, no client needed)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from convoy.config import job_from_dict, load_job
from convoy.k8s import naming
from convoy.k8s.quantities import parse_quantity
from convoy.k8s.render import (
    RECIPE_PATH,
    TORCHRUN_WORKER,
    cluster_job,
    ray_start_commands,
    render,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/convoy:0.1.0"
BASE = [f"k8s.image={IMAGE}", "k8s.pvc=convoy-runs", "run.name=digits-vit"]


def rendered(*overrides: str, kind: str | None = None, recipe: str = "default.yaml"):
    return render(load_job(REPO / "recipes" / recipe, [*BASE, *overrides]), kind)


def cluster_of(manifests):
    return manifests[-1]["spec"]["rayClusterSpec"]


def pods_of(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {
        "submitter": rayjob["spec"]["submitterPodTemplate"],
        "head": cluster["headGroupSpec"]["template"],
        "worker": cluster["workerGroupSpecs"][0]["template"],
    }


def test_rayjob_defaults_answer_what_kuberay_users_hit():
    config_map, rayjob = rendered()
    spec = rayjob["spec"]
    assert (config_map["kind"], rayjob["kind"], rayjob["apiVersion"]) == (
        "ConfigMap",
        "RayJob",
        "ray.io/v1",
    )
    assert spec["entrypoint"] == f"convoy train {RECIPE_PATH}"
    assert spec["submissionMode"] == "K8sJobMode" and spec["jobId"] == "digits-vit"
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 3600
    assert spec["activeDeadlineSeconds"] == 86400 and spec["preRunningDeadlineSeconds"] == 1200
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0" and cluster["authOptions"] == {"mode": "token"}
    assert cluster["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in cluster
    head = cluster["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 2


def test_every_pod_is_non_root_unprivileged_and_labelled():
    _, rayjob = rendered()
    for role, pod in pods_of(rayjob).items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, role
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "hostNetwork" not in spec
        (container,) = spec["containers"]
        context = container["securityContext"]
        assert context["capabilities"]["drop"] == ["ALL"] and not context["privileged"]
        assert context["allowPrivilegeEscalation"] is False
        assert container["image"] == IMAGE
        assert pod["metadata"]["labels"][naming.RUN_ID] == "digits-vit"
    assert pods_of(rayjob)["submitter"]["spec"]["restartPolicy"] == "Never"


def test_shm_is_memory_and_the_pvc_is_mounted_where_the_run_is_stored():
    config_map, rayjob = rendered("k8s.shm_size=1Gi")
    worker = pods_of(rayjob)["worker"]["spec"]
    volumes = {v["name"]: v for v in worker["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert volumes["shared"]["persistentVolumeClaim"] == {"claimName": "convoy-runs"}
    mounts = {m["name"]: m["mountPath"] for m in worker["containers"][0]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm" and mounts["shared"] == "/mnt/shared"
    recipe = yaml.safe_load(config_map["data"]["recipe.yaml"])
    assert recipe["run"]["storage_dir"] == "/mnt/shared/runs"
    assert recipe["run"]["shared_storage"] is True
    head_mounts = pods_of(rayjob)["head"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "recipe", "mountPath": "/etc/convoy", "readOnly": True} in head_mounts


def test_the_shipped_recipe_is_the_job_that_runs():
    job = load_job(REPO / "recipes" / "default.yaml", BASE)
    config_map, _ = render(job)
    shipped = job_from_dict(yaml.safe_load(config_map["data"]["recipe.yaml"]))
    assert shipped == cluster_job(job, "rayjob")[0]
    # Only the run's place and the launcher change on the way to the cluster.
    assert shipped.model_copy(update={"run": job.run, "k8s": job.k8s}) == job
    assert shipped.scaling.launcher == "ray" and shipped.run.name == "digits-vit"


def test_s3_storage_stays_and_needs_no_pvc():
    config_map, rayjob = render(
        load_job(
            None, [f"k8s.image={IMAGE}", "run.storage_dir=s3://bucket/runs", "run.name=s3-run"]
        )
    )
    assert (
        yaml.safe_load(config_map["data"]["recipe.yaml"])["run"]["storage_dir"]
        == "s3://bucket/runs"
    )
    volumes = {v["name"] for v in pods_of(rayjob)["worker"]["spec"]["volumes"]}
    assert "shared" not in volumes


def test_inline_recipe_needs_no_configmap():
    (rayjob,) = rendered("k8s.recipe_in=inline")
    entrypoint = rayjob["spec"]["entrypoint"]
    encoded = entrypoint.split("echo ", 1)[1].split(" |", 1)[0]
    recipe = yaml.safe_load(base64.b64decode(encoded))
    assert recipe["run"]["name"] == "digits-vit"
    assert entrypoint.endswith("&& exec convoy train /tmp/convoy-recipe.yaml")
    volumes = {v["name"] for v in pods_of(rayjob)["head"]["spec"]["volumes"]}
    assert "recipe" not in volumes


def test_gpu_workers_get_limits_selector_and_toleration_the_head_none():
    _, rayjob = rendered(
        "scaling.use_gpu=true",
        "k8s.gpu_type=NVIDIA-H100-80GB-HBM3",
        "k8s.workers_per_pod=2",
        "k8s.node_selector={pool: train}",
    )
    pods = pods_of(rayjob)
    worker = pods["worker"]["spec"]
    limits = worker["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2" and limits["cpu"] == "2"
    assert worker["containers"][0]["resources"]["requests"] == limits
    assert worker["nodeSelector"] == {
        "pool": "train",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in worker[
        "tolerations"
    ]
    head = pods["head"]["spec"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"]
    assert head.get("nodeSelector") == {"pool": "train"} and "tolerations" not in head
    (group,) = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["replicas"] == 1  # 2 workers, 2 per pod


def test_autoscaling_is_opt_in_v2_and_capped():
    _, rayjob = rendered(
        "scaling.num_workers=[2, 4]",
        "data.batch_size=48",
        "k8s.autoscaling=true",
        "k8s.max_worker_pods=6",
    )
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["version"] == "v2"
    assert cluster["autoscalerOptions"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    (group,) = cluster["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (2, 2, 6)
    assert "restartPolicy" not in group["template"]["spec"]  # v2 needs Never or unset


def test_raycluster_is_the_same_cluster_without_a_job():
    _, cluster = rendered(kind="raycluster")
    _, rayjob = rendered()
    assert cluster["kind"] == "RayCluster"
    spec, job_spec = cluster["spec"], rayjob["spec"]["rayClusterSpec"]
    assert (
        spec["workerGroupSpecs"][0]["template"]["metadata"]["labels"][naming.KIND] == "raycluster"
    )
    assert spec["headGroupSpec"]["rayStartParams"] == job_spec["headGroupSpec"]["rayStartParams"]


def test_pytorchjob_is_elastic_c10d_on_convoys_torchrun_worker():
    config_map, job = rendered(
        "scaling.num_workers=[2, 4]",
        "data.batch_size=48",
        "k8s.workers_per_pod=2",
        kind="pytorchjob",
    )
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    assert spec["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "minReplicas": 1,
        "maxReplicas": 2,
        "maxRestarts": 0,
    }
    assert spec["nprocPerNode"] == "2"
    assert spec["runPolicy"]["ttlSecondsAfterFinished"] == 3600
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == "ExitCode"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch"
    assert container["command"] == ["sh", "-c", " ".join([*TORCHRUN_WORKER, RECIPE_PATH])]
    recipe = yaml.safe_load(config_map["data"]["recipe.yaml"])
    assert recipe["scaling"]["launcher"] == "torchrun"
    assert recipe["scaling"]["torchrun"]["nnodes"] == "1:2"
    assert recipe["k8s"]["kind"] == "pytorchjob"


def test_unnamed_runs_get_a_name_that_fits():
    job = load_job(
        None,
        [
            f"k8s.image={IMAGE}",
            "k8s.pvc=runs",
            "model.name=pkg.very_long_module_name:build_a_model",
        ],
    )
    _, rayjob = render(job)
    name = rayjob["metadata"]["name"]
    assert naming.is_dns1035(name, 47), name
    assert rayjob["metadata"]["annotations"][naming.RUN_NAME].startswith(
        "build_a_model-digits-ddp-"
    )


def test_names_become_dns_labels_and_long_generated_ones_are_cut_with_a_hash():
    assert naming.dns1035("ViT_tiny--Digits") == "vit-tiny-digits"
    assert naming.dns1035("2024-run") == "run-2024-run"
    cut = naming.shorten("a" * 60, 47)
    assert len(cut) == 47 and cut != naming.shorten("a" * 61, 47)


def test_yaml_has_no_anchors_and_the_recipe_as_a_block():
    text = to_yaml(rendered())
    assert "&id" not in text and "*id" not in text
    assert "recipe.yaml: |" in text
    assert list(yaml.safe_load_all(text)) == rendered()


def test_ray_start_commands_of_a_rendered_rayjob():
    plan = ray_start_commands(
        rendered("k8s.worker_cpu=2", "k8s.worker_memory=3Gi"), "10.1.0.2", "secret"
    )
    assert plan.head == [
        "ray", "start", "--head", "--block", "--port=6379", "--dashboard-host=0.0.0.0",
        f"--memory={4 * 2**30}", "--num-cpus=0", "--num-gpus=0",
    ]  # fmt: skip
    assert (
        plan.workers
        == [
            [
                "ray",
                "start",
                "--block",
                "--address=10.1.0.2:6379",
                f"--memory={3 * 2**30}",
                "--num-cpus=2",
            ]
        ]
        * 2
    )
    grace = {"CONVOY_STOP_GRACE_S": "31"}  # 30 s + twice the planned save (302k params)
    assert plan.env == {**grace, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "secret"}
    assert plan.entrypoint == f"convoy train {RECIPE_PATH}"
    assert yaml.safe_load(plan.files[RECIPE_PATH])["run"]["name"] == "digits-vit"


def test_ray_start_commands_carry_gpus_and_the_jobs_env():
    plan = ray_start_commands(
        rendered("scaling.use_gpu=true", "k8s.gpu_type=A100", "k8s.env={NCCL_DEBUG: INFO}"),
        "head",
    )
    assert "--num-gpus=1" in plan.workers[0] and "--num-gpus=0" in plan.head
    assert plan.env.pop("CONVOY_STOP_GRACE_S").isdigit()
    assert plan.env == {"NCCL_DEBUG": "INFO", "RAY_AUTH_MODE": "token"}


def test_ray_start_commands_count_any_vendors_gpus_as_kuberay_does():
    # KubeRay reads num-gpus from any limit ending in "gpu", not only nvidia.com/gpu.
    plan = ray_start_commands(
        rendered("scaling.use_gpu=true", "k8s.gpu_type=MI300X", "k8s.gpu_resource=amd.com/gpu"),
        "head",
    )
    assert "--num-gpus=1" in plan.workers[0] and "--num-gpus=0" in plan.head


@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", 0.5), ("2", 2.0), ("8Gi", 8 * 2**30), ("1.5G", 1.5e9), ("1e3", 1000.0)],
)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == pytest.approx(value)


def test_import_convoy_and_render_need_no_kubernetes_packages():
    code = (
        "import sys, convoy, convoy.cli, convoy.k8s.render, convoy.k8s.validate, convoy.k8s.control;"
        "bad = [m for m in ('kubernetes', 'jsonschema', 'celpy') if m in sys.modules];"
        "print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_missing_extra_names_it(monkeypatch):
    import builtins

    from convoy.k8s import K8sError, require

    real_import = builtins.__import__

    def no_kubernetes(name, *args, **kwargs):
        if name.startswith("kubernetes"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kubernetes)
    for module in [m for m in sys.modules if m.split(".")[0] == "kubernetes"]:
        monkeypatch.delitem(sys.modules, module)  # imported already by another test
    with pytest.raises(K8sError, match=r"pip install 'convoy\[k8s\]'"):
        require("kubernetes")


CRD_SHA256 = {
    # Byte-identical to KubeRay v1.7.0 helm-chart/kuberay-operator/crds/.
    "ray.io_rayclusters.yaml": "c44704442eef0c6721ad40c1d66782c8bd3fdab9d3344306a5820910a679baa1",
    "ray.io_rayjobs.yaml": "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5",
}


def test_the_shipped_crds_are_kuberays_own():
    import hashlib

    crds = REPO / "src" / "convoy" / "k8s" / "crds"
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in crds.glob("*.yaml")}
    assert found == CRD_SHA256
