"""Rendered training pods get a grace period that holds a save (planned from the model's
checkpoint bytes, or set), the environment that gives their SIGTERM a deadline, and Ray
worker pods a preStop hook that drains their Ray node as a preemption; ``convoy k8s
validate`` warns when the run's last measured save is longer than the grace period."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from convoy.cli import main
from convoy.config import load_job
from convoy.k8s.grace import UNPLANNED_GRACE_S, checkpoint_bytes_per_pod
from convoy.k8s.render import render, to_yaml

REPO = Path(__file__).resolve().parents[2]
BASE = ["k8s.image=registry.example.com/convoy:0.1.0", "k8s.pvc=convoy-runs", "run.name=spot"]


def job_of(*overrides: str, recipe: str = "default.yaml"):  # type: ignore[no-untyped-def]
    return load_job(REPO / "recipes" / recipe, [*BASE, *overrides])


def pod_specs(manifests: list[dict]) -> dict[str, dict]:
    workload = manifests[-1]
    if workload["kind"] == "PyTorchJob":
        return {"worker": workload["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]}
    cluster = workload["spec"]["rayClusterSpec"]
    return {
        "submitter": workload["spec"]["submitterPodTemplate"]["spec"],
        "head": cluster["headGroupSpec"]["template"]["spec"],
        "worker": cluster["workerGroupSpecs"][0]["template"]["spec"],
    }


def env_of(spec: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in spec["containers"][0].get("env", [])}


def test_ray_pods_hold_a_save_and_workers_drain_their_node_first() -> None:
    specs = pod_specs(render(job_of()))
    # default.yaml: 302,506 params x (4 + 8 AdamW) bytes = 3.6 MB -> 30 s + 2 x 0.03 s.
    for role in ("head", "worker"):
        assert specs[role]["terminationGracePeriodSeconds"] == 31, role
        assert env_of(specs[role])["CONVOY_STOP_GRACE_S"] == "31"
    assert "terminationGracePeriodSeconds" not in specs["submitter"]
    assert "CONVOY_STOP_GRACE_S" not in env_of(specs["submitter"])
    hook = specs["worker"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["convoy", "k8s", "drain-node", "--deadline-s=26"]
    assert "lifecycle" not in specs["head"]["containers"][0]


def test_the_grace_period_can_be_set_and_pytorchjob_pods_get_it_too() -> None:
    specs = pod_specs(render(job_of("k8s.termination_grace_s=300"), "pytorchjob"))
    assert specs["worker"]["terminationGracePeriodSeconds"] == 300
    assert env_of(specs["worker"])["CONVOY_STOP_GRACE_S"] == "300"
    assert "lifecycle" not in specs["worker"]["containers"][0]  # torchrun saves on SIGTERM
    ray = pod_specs(render(job_of("k8s.termination_grace_s=300")))
    hook = ray["worker"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[-1] == "--deadline-s=295"


def test_the_planned_bytes_follow_the_strategy_and_the_model() -> None:
    vit = ["model.kwargs.hidden=768", "model.kwargs.mlp=3072", "scaling.num_workers=4"]
    replicated = checkpoint_bytes_per_pod(job_of(*vit))
    sharded = checkpoint_bytes_per_pod(job_of(*vit, "strategy={name: fsdp2}"))
    assert replicated is not None and sharded is not None
    assert sharded == pytest.approx(replicated / 4, abs=1)  # one pod writes its shard
    # A model only the image can build: the longest common notice instead.
    missing = job_of("model.name=pkg_only_in_the_image.models:big")
    assert pod_specs(render(missing))["worker"]["terminationGracePeriodSeconds"] == (
        UNPLANNED_GRACE_S
    )


def write_checkpoint(run_dir: Path, step: int, save_seconds: float) -> None:
    done = run_dir / "checkpoints" / f"step_{step:08d}"
    done.mkdir(parents=True)
    (done / "meta.json").write_text(json.dumps({"step": step, "save_seconds": save_seconds}))


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory standing in for the PVC's mount (which may not be under /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="convoy-pvc-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_validate_warns_when_the_last_measured_save_is_longer(
    shared_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The run directory as the pods see it (the PVC), reachable from here too.
    job = job_of(f"k8s.pvc_mount_path={shared_dir}", "run.storage_dir=runs")
    manifest = tmp_path / "spot.yaml"
    manifest.write_text(to_yaml(render(job)))
    assert main(["k8s", "validate", str(manifest)]) == 0
    assert "warning" not in capsys.readouterr().err  # no checkpoint measured yet

    write_checkpoint(shared_dir / "runs" / "spot", 40, save_seconds=45.2)
    assert main(["k8s", "validate", str(manifest)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings  # the worker pods (the head trains nothing)
    assert "workerGroupSpecs[0].template.spec.terminationGracePeriodSeconds: 31 s" in warnings[-1]
    assert "(step_00000040: 45.2 s)" in warnings[-1]
    assert "k8s.termination_grace_s" in warnings[-1]
    # The same check in a fresh interpreter, as a CI pipeline or a laptop runs it: the save
    # time comes from the checkpoint's meta alone, and torch is never imported.
    probe = (
        "import sys\n"
        "from convoy.cli import main\n"
        f"code = main(['k8s', 'validate', {str(manifest)!r}])\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.splitlines()[-1] == "0 False", done.stdout + done.stderr
    assert "(step_00000040: 45.2 s)" in done.stderr

    longer = job_of(
        f"k8s.pvc_mount_path={shared_dir}", "run.storage_dir=runs", "k8s.termination_grace_s=60"
    )
    manifest.write_text(yaml.safe_dump_all(render(longer)))
    assert main(["k8s", "validate", str(manifest)]) == 0
    assert "warning" not in capsys.readouterr().err
