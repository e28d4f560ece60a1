"""Launcher helpers that need no workers: run naming, torchrun's command, Ray placement."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.config import load_job
from convoy.errors import ConfigError, ResourceError
from convoy.launchers.base import resolve_run
from convoy.launchers.ray import (
    check_cluster_resources,
    placeable_workers,
    reserve_data_cpus,
    worker_resources,
)
from convoy.launchers.torchrun import nodes_range, torchrun_command


def test_resolve_run_makes_storage_absolute_and_names_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    job = resolve_run(load_job(None, ["run.storage_dir=relative/runs"]))
    assert job.run.storage_dir == str(tmp_path / "relative" / "runs")
    assert job.run.name is not None and job.run.name.startswith("vit_tiny-digits-ddp-")
    # An explicit name is kept, so running it again reuses the directory.
    named = resolve_run(load_job(None, ["run.name=exp1"]))
    assert named.run.name == "exp1"


def test_unnamed_runs_in_the_same_second_get_different_directories() -> None:
    job = load_job(None, ["model.name=pkg.models:tiny_net"])
    names = {resolve_run(job).run.name for _ in range(20)}
    assert len(names) == 20
    # A user factory's path names the run by its function.
    assert all(str(n).startswith("tiny_net-digits-ddp-") for n in names)


class FakeRay:
    """Records how Ray was initialised (control logic only; the e2e tests run real Ray)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, object]] = []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs: object) -> None:
        self.calls.append(kwargs)

    def LoggingConfig(self, **kwargs: object) -> dict[str, object]:
        return kwargs


def test_a_ray_already_running_here_is_joined_not_restarted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from convoy.launchers import ray as ray_launcher

    fake = FakeRay()
    monkeypatch.setattr(ray_launcher, "running_local_cluster", lambda: "127.0.0.1:6379")
    assert ray_launcher.ensure_ray(fake, ray_launcher.RayCluster(address=None))
    # No num_cpus: ray.init refuses it when joining a running cluster.
    assert fake.calls[0]["address"] == "auto" and "num_cpus" not in fake.calls[0]
    assert "using the Ray cluster already running at 127.0.0.1:6379" in capsys.readouterr().out


def test_without_a_running_ray_a_private_one_is_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from convoy.launchers import ray as ray_launcher

    fake = FakeRay()
    monkeypatch.setattr(ray_launcher, "running_local_cluster", lambda: None)
    assert ray_launcher.ensure_ray(fake, ray_launcher.RayCluster(address=None))
    assert "address" not in fake.calls[0] and fake.calls[0]["include_dashboard"] is False


def test_torchrun_command_carries_the_config(tmp_path: Path) -> None:
    job = load_job(
        None,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=4",
            "scaling.max_failures=3",
            "scaling.torchrun.nnodes=1:2",
            "scaling.torchrun.rdzv_endpoint=head:29400",
            "run.name=exp",
        ],
    )
    command = torchrun_command(job, tmp_path / "config.yaml")
    assert command[1:3] == ["-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29400",
        "--rdzv-id=exp",
    ):
        assert flag in command
    assert command[-3:] == ["-m", "convoy.launchers.torchrun", str(tmp_path / "config.yaml")]


@pytest.mark.parametrize("bad", ["0", "3:2", "x", "1:y"])
def test_bad_node_range(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"scaling\.torchrun\.nnodes"):
        nodes_range(bad)


def test_worker_count_must_spread_over_nodes() -> None:
    job = load_job(
        None, ["scaling.num_workers=3", "scaling.torchrun.nnodes=2", "data.batch_size=63"]
    )
    with pytest.raises(ConfigError, match=r"multiple of the node count 2"):
        torchrun_command(job, Path("c.yaml"))


def test_placeable_workers_packs_per_node() -> None:
    nodes = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 3.0}]
    assert placeable_workers({"CPU": 1.0}, nodes) == 5
    assert placeable_workers({"CPU": 0.5}, nodes) == 10
    assert placeable_workers({"CPU": 1.0, "GPU": 1.0}, nodes) == 1
    assert placeable_workers({"CPU": 2.5}, nodes) == 1  # no worker spans two nodes


def test_resource_error_names_the_request() -> None:
    job = load_job(None, ["scaling.num_workers=4", "scaling.use_gpu=true"])
    assert worker_resources(job) == {"CPU": 1.0, "GPU": 1.0}
    with pytest.raises(ResourceError, match=r"got 4 workers .* can place at most 0"):
        check_cluster_resources(job, [{"CPU": 16.0}])


RAY_DATA = ["scaling.launcher=ray", "scaling.num_workers=2", "data.loader=ray_data"]


def test_ray_data_gets_its_cpus_by_fractional_train_workers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = load_job(None, RAY_DATA)  # cpus_per_worker left at its default of 1
    fitted = reserve_data_cpus(job, [{"CPU": 2.0}])
    assert fitted.scaling.cpus_per_worker == 0.5  # 2 x 0.5 for training, 1 for Ray Data
    assert "leaving 1 of 2 CPUs to Ray Data" in capsys.readouterr().out
    roomy = reserve_data_cpus(job, [{"CPU": 8.0}])
    assert roomy.scaling.cpus_per_worker == 1.0  # it fits: nothing changes


def test_ray_data_refuses_a_layout_that_starves_it() -> None:
    explicit = load_job(None, [*RAY_DATA, "scaling.cpus_per_worker=1"])
    with pytest.raises(ResourceError, match=r"scaling.cpus_per_worker: .* set .* to 0\.5 or less"):
        reserve_data_cpus(explicit, [{"CPU": 2.0}])
    greedy = load_job(None, [*RAY_DATA, "data.ray_data.reserved_cpus=2"])
    with pytest.raises(ResourceError, match=r"lower data.ray_data.reserved_cpus"):
        reserve_data_cpus(greedy, [{"CPU": 2.0}])


def test_ray_data_needs_the_ray_launcher() -> None:
    with pytest.raises(ConfigError, match=r"data.loader: got 'ray_data'; .* scaling.launcher: ray"):
        load_job(None, ["data.loader=ray_data", "scaling.launcher=torchrun"])
