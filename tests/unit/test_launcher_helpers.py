"""Launcher helpers that need no workers: run naming, torchrun's command, Ray placement."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from convoy.config import load_job
from convoy.distributed import (
    WorkerContext,
    cgroup_cpu_quota,
    default_threads,
    free_port,
    lost_a_peer,
    usable_cpus,
    worker_threads,
)
from convoy.errors import ConfigError, ResourceError
from convoy.launchers.base import check_run_dir, check_shared_storage, resolve_run
from convoy.launchers.ray import (
    check_cluster_resources,
    placeable_workers,
    reserve_data_cpus,
    worker_resources,
)
from convoy.launchers.ray_local import enter_own_session
from convoy.launchers.torchrun import (
    nnodes_argument,
    node_address,
    procs_per_node,
    stopping_the_agent,
    torchrun_command,
    worker_environment,
)
from convoy.network import interface_with_address, socket_interface_env

REPO = Path(__file__).resolve().parents[2]


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


def test_resolve_run_makes_the_recipes_local_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's workers run in another directory: the driver fixes where the files are."""
    monkeypatch.chdir(tmp_path)
    hf = ["model.name=hf", "model.kwargs={path: models/llama}", "task.name=language_modeling"]
    text = ["data.name=text", "data.path=corpus.txt", "data.tokenizer=model"]
    job = resolve_run(load_job(None, [*hf, *text]))
    folder = str(tmp_path / "models" / "llama")
    assert (job.model.kwargs["path"], job.data.tokenizer_path) == (folder, folder)
    assert job.data.path == str(tmp_path / "corpus.txt")
    remote = resolve_run(load_job(None, ["data.name=series", "data.path=s3://bucket/fleet"]))
    assert remote.data.path == "s3://bucket/fleet"
    # Another model's own keyword named path is its own business.
    user = resolve_run(load_job(None, ["model.name=pkg.models:net", "model.kwargs={path: x}"]))
    assert user.model.kwargs["path"] == "x"


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


def test_a_ray_a_user_started_here_is_joined_at_its_address_not_auto(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from convoy.launchers import ray as ray_launcher

    fake = FakeRay()
    monkeypatch.setattr(ray_launcher, "user_started_cluster", lambda: "127.0.0.1:6379")
    monkeypatch.setattr(ray_launcher, "check_reachable", lambda address: None)
    monkeypatch.setattr(ray_launcher, "route_ray_output", lambda ray: None)
    connection = ray_launcher.ensure_ray(fake, ray_launcher.RayCluster(address=None))
    assert connection is not None and not connection.private
    # Its exact address: "auto" would join any Ray running here, another run's private one too.
    assert fake.calls[0]["address"] == "127.0.0.1:6379" and "num_cpus" not in fake.calls[0]
    assert "joining the Ray started on this machine at 127.0.0.1:6379" in capsys.readouterr().out


def test_without_a_user_started_ray_a_private_one_is_started(
    monkeypatch: pytest.MonkeyPatch, short_tmp_path: Path
) -> None:
    from convoy.launchers import ray as ray_launcher
    from convoy.launchers import ray_local

    fake = FakeRay()
    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    monkeypatch.setattr(ray_launcher, "user_started_cluster", lambda: None)
    monkeypatch.setattr(ray_launcher, "route_ray_output", lambda ray: None)
    monkeypatch.setattr(ray_local, "ray_logs_note", lambda ray: "")
    connection = ray_launcher.ensure_ray(fake, ray_launcher.RayCluster(address=None))
    assert connection is not None and connection.private
    call = fake.calls[0]
    assert "address" not in call and call["include_dashboard"] is False
    # Its own temp folder: no address file another process could find, its own logs.
    assert Path(call["_temp_dir"]).parent == short_tmp_path / "ray"
    assert re.fullmatch(r"cv[0-9a-f]{6}", Path(call["_temp_dir"]).name)


def test_a_stale_address_file_is_said_in_one_line_and_not_joined(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    from convoy.distributed import free_port
    from convoy.launchers.ray_local import ray_address_file, user_started_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    ray_address_file().parent.mkdir(parents=True)
    ray_address_file().write_text(f"127.0.0.1:{free_port()}")  # a head killed without `ray stop`
    assert user_started_cluster() is None
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "is not running (nothing accepts connections there" in out[0]
    assert out[0].endswith("starting a private Ray for this run")


def test_a_port_that_is_not_a_ray_gcs_is_not_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray")
    from convoy.launchers import ray_local

    with socket.socket() as listener:  # accepts connections, never answers as a GCS
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        problem = ray_local.gcs_problem(address, timeout=1.0)
    assert problem is not None and "does not answer as a Ray GCS" in problem


def test_router_shows_the_workers_lines_and_logs_rays_own(tmp_path: Path) -> None:
    from convoy.launchers.ray_local import INFO_MARKER, RayOutputRouter

    shown: list[dict[str, object]] = []
    router = RayOutputRouter(shown.append, tmp_path / "first.log")
    worker = {"actor_name": "RayTrainWorker", "pid": 7, "ip": "10.0.0.1"}
    router({**worker, "lines": ["epoch 1/2 loss 0.5", f"{INFO_MARKER}Ray's own note"]})
    router({**worker, "lines": ["Setting up process group for: env:// [rank=0, world_size=2]"]})
    placed = ["Started training worker group of size 2: ", "- (ip=10.0.0.1, pid=7) world_rank=0"]
    controller = {"actor_name": "TrainController", "pid": 8}
    router({**controller, "lines": ["Requesting resources: {'CPU': 1.0} * 2", *placed]})
    router({**controller, "lines": ["Traceback (most recent"]})
    router.move_to(tmp_path / "run" / "ray.log")
    router({"pid": "autoscaler", "lines": ["Autoscaler status"]})
    router.close()
    # Shown: the run's own lines, and where its workers are (a user's first question).
    assert [d["lines"] for d in shown] == [["epoch 1/2 loss 0.5"], placed]
    first = (tmp_path / "first.log").read_text()
    assert "Ray's own note" in first and "(TrainController pid=8" in first
    assert "Traceback" in first and "Autoscaler" not in first
    assert "Requesting resources" in first and "Setting up process group" in first
    assert "Autoscaler status" in (tmp_path / "run" / "ray.log").read_text()


def test_process_niceness_is_set_on_every_thread() -> None:
    # Runs in a child so the test process keeps its priority (raising nice is one-way).
    code = (
        "import os, threading, time\n"
        "from convoy.launchers.ray_local import set_process_niceness\n"
        "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
        "assert set_process_niceness(os.getpriority(os.PRIO_PROCESS, 0) + 3) is None\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, int(x)) for x in os.listdir('/proc/self/task')}))\n"
    )
    base = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"[{base + 3}]"


def test_a_process_group_leader_enters_a_session_of_its_own() -> None:
    # As Ray starts its workers: each the leader of its own process group, in its parent's
    # session. After the move: a session of its own (a scheduler autogroup of its own), and
    # its group id is its PID again (the group Ray signals to end it).
    code = (
        "import os\n"
        "from convoy.launchers.ray_local import enter_own_session\n"
        "before = os.getsid(0)\n"
        "assert enter_own_session() is None\n"
        "assert enter_own_session() is None  # a second call: already its own\n"
        "print(before != os.getpid(), os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, process_group=0
    )
    assert out.stdout.split() == ["True", "True", "True"]


def test_a_refused_session_move_says_why_and_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel's refusal, faked: a worker neither session nor group leader whose setsid
    # fails (no real refusal can be made here without moving the test process itself).
    def refuse() -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "getsid", lambda pid: -1)
    monkeypatch.setattr(os, "getpgid", lambda pid: -1)
    monkeypatch.setattr(os, "setsid", refuse)
    assert enter_own_session() == "the worker stays in Ray's session (Operation not permitted)"


def test_torchrun_command_carries_the_config(tmp_path: Path) -> None:
    job = load_job(
        None,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=[2,4]",
            "scaling.torchrun.nproc_per_node=2",
            "scaling.max_failures=3",
            "scaling.torchrun.rdzv_endpoint=head:29400",
            "scaling.torchrun.local_addr=10.0.0.5",
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
        "--local-addr=10.0.0.5",
    ):
        assert flag in command
    assert command[-3:] == ["-m", "convoy.launchers.torchrun", str(tmp_path / "config.yaml")]


@pytest.mark.parametrize("bad", ["0", "3:2", "x", "1:y"])
def test_bad_node_range(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"^scaling\.torchrun\.nnodes: got .*0 < MIN <= MAX"):
        load_job(None, [f"scaling.torchrun.nnodes={bad}"])


def test_worker_count_must_spread_over_nodes() -> None:
    # Refused when the config is loaded (convoy config show says so too), not at launch.
    with pytest.raises(ConfigError, match=r"nnodes 2 x 1 worker\(s\) per node = 2; make them"):
        load_job(
            None,
            [
                "scaling.launcher=torchrun",
                "scaling.num_workers=3",
                "scaling.torchrun.nnodes=2",
                "data.batch_size=63",
            ],
        )
    with pytest.raises(ConfigError, match=r"set with scaling.num_workers: \[MIN, MAX\]"):
        load_job(None, ["scaling.launcher=torchrun", "scaling.torchrun.nnodes=1:2"])


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


def test_elastic_workers_map_to_torchrun_node_ranges(tmp_path: Path) -> None:
    job = load_job(
        None,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=[2,4]",
            "scaling.torchrun.nproc_per_node=2",
            "scaling.torchrun.local_addr=10.0.0.5",
            "data.batch_size=48",
        ],
    )
    assert nnodes_argument(job) == "1:2" and procs_per_node(job) == 2
    assert "--nnodes=1:2" in torchrun_command(job, tmp_path / "c.yaml", "10.0.0.1:29400")
    odd = load_job(None, ["scaling.launcher=torchrun", "scaling.num_workers=[1,2]"])
    with pytest.raises(ConfigError, match=r"multiples of 2"):
        procs_per_node(
            odd.model_copy(
                update={
                    "scaling": odd.scaling.model_copy(
                        update={
                            "torchrun": odd.scaling.torchrun.model_copy(
                                update={"nproc_per_node": 2}
                            )
                        }
                    )
                }
            )
        )
    clash = load_job(None, ["scaling.num_workers=[1,2]", "scaling.torchrun.nnodes=1:3"])
    with pytest.raises(ConfigError, match=r"scaling\.torchrun\.nnodes: got '1:3'.*--nnodes 1:2"):
        nnodes_argument(clash)


def test_an_unreachable_rendezvous_host_is_named() -> None:
    job = load_job(
        None,
        ["scaling.torchrun.nnodes=2", "scaling.torchrun.rdzv_endpoint=no-such-host.invalid:29400"],
    )
    with pytest.raises(ConfigError, match=r"scaling\.torchrun\.rdzv_endpoint"):
        node_address(job, "no-such-host.invalid:29400")


def test_an_elastic_batch_must_split_at_every_size() -> None:
    with pytest.raises(ConfigError, match=r"does not split over 3 worker\(s\).*multiple of 12"):
        load_job(None, ["scaling.num_workers=[1,4]", "data.batch_size=64"])
    assert load_job(None, ["scaling.num_workers=1:4", "data.batch_size=48"]).scaling.elastic


def test_local_storage_is_refused_when_workers_span_nodes(tmp_path: Path) -> None:
    job = load_job(None, [f"run.storage_dir={tmp_path}"])
    check_shared_storage(job, 1, "one node")
    with pytest.raises(ConfigError, match=r"run\.storage_dir: .*s3://.*run\.shared_storage: true"):
        check_shared_storage(job, 2, "2 nodes")
    shared = load_job(None, [f"run.storage_dir={tmp_path}", "run.shared_storage=true"])
    check_shared_storage(shared, 2, "2 nodes")
    check_shared_storage(load_job(None, ["run.storage_dir=s3://bucket/runs"]), 2, "2 nodes")


def test_cpu_quota_is_read_from_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(v2) == 1.5
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path / "v1") == 3.0
    (tmp_path / "v2" / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path / "v2") == 1.0  # never below one


def test_threads_follow_the_cpus_a_worker_was_given() -> None:
    assert worker_threads(WorkerContext(cpus=3.0, local_world_size=1)) == 3
    assert worker_threads(WorkerContext(cpus=0.5)) == 1
    assert worker_threads(WorkerContext(local_world_size=64)) == 1


def test_the_interface_of_an_address_is_found() -> None:
    assert interface_with_address("127.0.0.1") == "lo"
    assert interface_with_address("203.0.113.77") is None
    assert socket_interface_env("203.0.113.77") == {}


@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "nohost"])
def test_ray_address_with_nothing_there_fails_at_once(address: str) -> None:
    from convoy.errors import LaunchError
    from convoy.launchers.ray import check_reachable

    with pytest.raises(LaunchError, match=r"^RAY_ADDRESS: "):
        check_reachable(address.format(port=free_port()))


def test_lost_nodes_are_read_from_ray_worker_failures() -> None:
    from convoy.launchers.ray_failures import lost_nodes

    health = RuntimeError(
        "A worker health check failed.\nWorker info: Worker(\n  metadata=ActorMetadata(\n"
        "    hostname='vm',\n    node_ip='10.213.2.3',\n    pid=5981,\n  ),\n)\n"
        "The actor 6f09 is unavailable: The actor is temporarily unavailable: RpcError"
    )
    died = RuntimeError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: RayTrainWorker"
        "\n\tip: 10.213.2.4\nThe actor is dead because its node has died."
    )
    peer = RuntimeError("Read error [10.213.2.5]:31971: Connection reset by peer")
    app = RuntimeError("ValueError: the loss is NaN")
    assert lost_nodes({0: app, 1: health, 2: died}) == ["10.213.2.3", "10.213.2.4"]
    assert lost_nodes({0: app}) == []
    # A survivor's collective losing its peer names a candidate; the GCS decides (dead_nodes).
    assert lost_nodes({0: peer}) == ["10.213.2.5"]
    closed = RuntimeError(
        "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[10.213.1.3]:42186. This is typically caused by a remote worker crashing."
    )
    assert lost_nodes({0: closed}) == ["10.213.1.3"]


def test_a_peer_on_the_drivers_own_node_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A survivor's "connection reset by peer" names a node; the driver's own node is alive
    (it answers the question), so only the others are waited for until the GCS decides. On a
    private Ray every worker is on the driver's node: a crashed worker is told at once."""
    ray = pytest.importorskip("ray")
    from convoy.launchers import ray_failures

    nodes = [
        {"NodeID": "own", "NodeManagerAddress": "10.0.0.1", "Alive": True},
        {"NodeID": "gone", "NodeManagerAddress": "10.0.0.2", "Alive": False},
        {"NodeID": "live", "NodeManagerAddress": "10.0.0.3", "Alive": True},
    ]
    context = type("Context", (), {"get_node_id": lambda self: "own"})()
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    slept: list[float] = []
    monkeypatch.setattr(ray_failures.time, "sleep", slept.append)
    assert ray_failures.dead_nodes(["10.0.0.1"]) == []
    assert slept == []  # not one poll for the driver's own node
    assert ray_failures.dead_nodes(["10.0.0.1", "10.0.0.2"]) == ["10.0.0.2"]
    # A live peer elsewhere is polled until the time-out: Ray may yet mark it dead.
    assert ray_failures.dead_nodes(["10.0.0.3"], timeout=0.0) == []


def test_a_failed_runs_hint_names_the_checkpoint_that_resumes_it(tmp_path: Path) -> None:
    from convoy.launchers.ray_failures import checkpoint_hint

    job = load_job(None, [f"run.storage_dir={tmp_path}", "run.name=failed"])
    assert checkpoint_hint(job).startswith("no checkpoint was committed")
    partial = job.run_dir / "checkpoints" / "step_00000040"  # a save that never committed
    partial.mkdir(parents=True)
    committed = job.run_dir / "checkpoints" / "step_00000020"
    committed.mkdir()
    (committed / "meta.json").write_text("{}")
    assert checkpoint_hint(job) == (
        "the committed checkpoint step_00000020 resumes when you run 'failed' again"
    )


def test_a_range_in_a_recipe_file_is_a_range_not_a_base_60_number(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "scaling:\n  num_workers: 1:2\n  torchrun:\n    nnodes: 2\noptim:\n  lr: 1.5\n"
    )
    job = load_job(recipe)
    assert job.scaling.num_workers == (1, 2) and job.optim.lr == 1.5


def test_torchrun_elastic_batch_is_checked_at_whole_nodes_only() -> None:
    job = load_job(
        None,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=2:4",
            "scaling.torchrun.nproc_per_node=2",
            "data.batch_size=32",
        ],
    )
    assert procs_per_node(job) == 2 and nnodes_argument(job) == "1:2"  # sizes 2 and 4, not 3


def test_an_elastic_range_is_shown_as_a_range_where_it_cannot_be() -> None:
    with pytest.raises(ConfigError, match=r"scaling.num_workers is \[1, 2\]"):
        load_job(None, ["scaling.num_workers=1:2", "strategy.name=single"])


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("http://127.0.0.1:8265", r"a URL .*host:6379"),
        ("ftp://x:1", r"expected host:port"),
        ("127.0.0.1", r"expected host:port of the Ray head \(the GCS port"),
        ("ray://127.0.0.1:{port}", r"nothing accepts connections"),
    ],
)
def test_ray_address_mistakes_are_named(address: str, expected: str) -> None:
    from convoy.errors import LaunchError
    from convoy.launchers.ray import check_reachable

    with pytest.raises(LaunchError, match=expected):
        check_reachable(address.format(port=free_port()))


def test_a_port_that_is_not_a_ray_gcs_is_named_within_the_probe_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket
    import threading

    from convoy.errors import LaunchError
    from convoy.launchers import ray as ray_launcher

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []  # accept and stay silent, like a non-gRPC service
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    monkeypatch.setattr(ray_launcher, "GCS_PROBE_TIMEOUT_S", 2.0)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    try:
        with pytest.raises(
            LaunchError, match=r"does not answer as a Ray GCS.*8265 is the dashboard"
        ):
            ray_launcher.check_reachable(f"127.0.0.1:{port}")
    finally:
        server.close()


def test_an_elastic_torchrun_config_survives_its_own_saved_yaml(tmp_path: Path) -> None:
    from convoy.config import job_to_yaml

    job = load_job(None, ["scaling.launcher=torchrun", "scaling.num_workers=[1,2]"])
    saved = tmp_path / "config.yaml"  # what the workers load
    saved.write_text(job_to_yaml(job))
    assert nnodes_argument(load_job(saved)) == "1:2"


def test_an_unwritable_storage_dir_is_refused_before_any_worker(tmp_path: Path) -> None:
    import convoy
    from convoy.config import load_job

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    job = load_job(
        None, ["scaling.launcher=local", "scaling.num_workers=1", f"run.storage_dir={blocker}/runs"]
    )
    with pytest.raises(ConfigError, match=r"^run.storage_dir: got '.*a-file/runs'; a folder"):
        convoy.train(job)
    assert blocker.read_text() == "not a folder"
    # The storage folder itself a file: named as the file it is.
    itself = job.model_copy(
        update={"run": job.run.model_copy(update={"storage_dir": str(blocker)})}
    )
    with pytest.raises(
        ConfigError, match=r"^run.storage_dir: got '.*a-file'; a folder \(.*a-file is a file\)"
    ):
        convoy.train(itself)
    assert blocker.read_text() == "not a folder"


def test_a_run_directory_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "exp1"
    blocker.write_text("not a run")
    job = load_job(None, [f"run.storage_dir={tmp_path}", "run.name=exp1"])
    with pytest.raises(ConfigError) as caught:
        check_run_dir(job)
    message = str(caught.value)
    assert message.startswith("run.name: got 'exp1'; the run's directory ")
    assert f"{blocker} is a file, not a folder; choose another run.name" in message
    assert "\n" not in message
    assert blocker.read_text() == "not a run"


def test_a_run_directory_to_resume_or_to_create_passes_and_nothing_is_made(
    tmp_path: Path,
) -> None:
    (tmp_path / "earlier").mkdir()
    check_run_dir(load_job(None, [f"run.storage_dir={tmp_path}", "run.name=earlier"]))
    check_run_dir(load_job(None, [f"run.storage_dir={tmp_path}/new/runs", "run.name=fresh"]))
    assert [p.name for p in tmp_path.iterdir()] == ["earlier"]
    check_run_dir(load_job(None, ["run.storage_dir=s3://bucket/runs", "run.name=exp1"]))


def test_a_run_directory_that_is_a_file_is_refused_before_any_worker(tmp_path: Path) -> None:
    import convoy

    blocker = tmp_path / "exp1"
    blocker.write_text("not a run")
    job = load_job(
        None,
        [
            "scaling.launcher=local",
            "scaling.num_workers=1",
            f"run.storage_dir={tmp_path}",
            "run.name=exp1",
        ],
    )
    with pytest.raises(ConfigError, match=r"^run.name: got 'exp1'; the run's directory .*exp1 "):
        convoy.train(job)
    assert blocker.read_text() == "not a run"
    assert [p.name for p in tmp_path.iterdir()] == ["exp1"]


def test_a_run_directory_that_is_a_file_is_refused_before_ray_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from convoy.launchers import ray as ray_launcher

    def no_ray() -> None:
        raise AssertionError("Ray was imported or started before the run directory was checked")

    monkeypatch.setattr(ray_launcher, "import_ray", no_ray)
    (tmp_path / "exp1").write_text("not a run")
    job = load_job(None, [f"run.storage_dir={tmp_path}", "run.name=exp1"])
    with pytest.raises(ConfigError, match=r"^run.name: got 'exp1'; the run's directory "):
        ray_launcher.RayLauncher(ray_launcher.RayCluster(address=None)).launch(job)


def test_a_private_ray_that_never_starts_ends_in_one_line_naming_the_bound(
    monkeypatch: pytest.MonkeyPatch, short_tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from convoy.config import RayLauncherConfig
    from convoy.errors import LaunchError
    from convoy.launchers.ray_local import start_private_ray

    class NeverStarts(FakeRay):
        def init(self, **kwargs: object) -> None:
            super().init(**kwargs)
            raise RuntimeError("Failed to start the dashboard\nthe last 20 lines of its log")

        def shutdown(self) -> None:
            pass

    monkeypatch.setenv("RAY_TMPDIR", str(short_tmp_path))
    fake = NeverStarts()
    with pytest.raises(LaunchError) as caught:
        start_private_ray(fake, RayLauncherConfig(start_timeout_s=0.5))
    message = str(caught.value)
    assert message.startswith("scaling.ray.start_timeout_s: the embedded Ray did not start")
    assert "(Failed to start the dashboard)" in message and "\n" not in message
    # Retried within the bound, each retry said in one line.
    retries = capsys.readouterr().out.strip().splitlines()
    assert len(fake.calls) == len(retries) + 1 >= 2


def test_ray_train_helpers_a_run_does_not_need_are_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("ray.train")
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )

    from convoy.launchers import ray_local
    from convoy.launchers.ray_torch import ConvoyTorchTrainer

    def callback_types(sole_run: bool = False, **datasets: object) -> set[type]:
        trainer = ConvoyTorchTrainer(
            train_loop_per_worker=lambda: None, datasets=datasets, sole_run=sole_run
        )
        return {type(c) for c in trainer._create_default_callbacks()}

    monkeypatch.setattr(ray_local, "state_api_running", lambda: False)
    without_data = callback_types()
    assert DatasetsCallback not in without_data
    assert PlacementGroupCleanerCallback not in without_data
    # A Ray Data run keeps its dataset manager; a Ray with a state API keeps the cleaner.
    assert DatasetsCallback in callback_types(train=lambda: None)
    monkeypatch.setattr(ray_local, "state_api_running", lambda: True)
    assert PlacementGroupCleanerCallback in callback_types()
    # A driver that exits with its run (convoy train) frees the group itself.
    assert PlacementGroupCleanerCallback not in callback_types(sole_run=True)


@pytest.mark.parametrize("private_ray", [True, False])
def test_fixed_size_runs_never_wait_on_the_autoscaling_coordinator(
    monkeypatch: pytest.MonkeyPatch, private_ray: bool
) -> None:
    pytest.importorskip("ray.train")
    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import (
        ElasticScalingPolicy,
        FixedScalingPolicy,
    )
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from convoy.launchers.ray_controller import (
        NoAutoscalerScalingPolicy,
        UnblockedRequestsScalingPolicy,
    )
    from convoy.launchers.ray_torch import ConvoyTorchTrainer

    given: list[object] = []
    controller_env: list[str | None] = []

    def run_controller(self: object, **kwargs: object) -> None:
        given.append(kwargs["scaling_policy"])
        controller_env.append(os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"))

    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", run_controller)
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    trainer = ConvoyTorchTrainer(train_loop_per_worker=lambda: None, private_ray=private_ray)
    fixed = ScalingConfig(num_workers=2)
    trainer._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(fixed))
    expected = NoAutoscalerScalingPolicy if private_ray else UnblockedRequestsScalingPolicy
    assert type(given[-1]) is expected and given[-1].scaling_config is fixed
    # The controller starts no watcher of its own (the deferred one replaces it), and the
    # user's setting is back once the run ends.
    assert controller_env == ["0"] and os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"
    # An elastic run keeps Ray Train's own policy, which asks the autoscaler for its range.
    elastic = ElasticScalingPolicy(ScalingConfig(num_workers=(1, 2)))
    trainer._initialize_and_run_controller(scaling_policy=elastic)
    assert given[-1] is elastic


@pytest.mark.parametrize(
    ("private_ray", "user_setting", "watched"),
    [(False, None, True), (True, None, False), (False, "0", False), (True, "1", True)],
)
def test_the_preemption_watcher_runs_where_a_node_can_be_drained(
    monkeypatch: pytest.MonkeyPatch, private_ray: bool, user_setting: str | None, watched: bool
) -> None:
    pytest.importorskip("ray.train")
    from convoy.launchers import ray_local
    from convoy.launchers.ray_controller import DeferredPreemptionCallback
    from convoy.launchers.ray_torch import ConvoyTorchTrainer

    monkeypatch.setattr(ray_local, "state_api_running", lambda: False)
    if user_setting is None:
        monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    else:
        monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", user_setting)
    trainer = ConvoyTorchTrainer(train_loop_per_worker=lambda: None, private_ray=private_ray)
    kinds = [type(c) for c in trainer._create_default_callbacks()]
    assert kinds.count(DeferredPreemptionCallback) == int(watched)


def test_the_preemption_watcher_starts_once_the_group_has_trained_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("ray.train")
    from ray.train.v2._internal.callbacks.preemption_callback import PreemptionCallback

    from convoy.launchers import ray_controller

    started: list[object] = []
    stopped: list[bool] = []
    monkeypatch.setattr(
        PreemptionCallback, "after_worker_group_start", lambda self, group: started.append(group)
    )
    monkeypatch.setattr(PreemptionCallback, "_stop_watcher", lambda self: stopped.append(True))
    clock = [100.0]
    monkeypatch.setattr(ray_controller.time, "monotonic", lambda: clock[0])
    callback = ray_controller.DeferredPreemptionCallback()
    callback.after_worker_group_start("group-1")
    callback.after_worker_group_poll_status(None)
    assert started == []  # not as the workers start
    clock[0] += ray_controller.LONG_RUN_HELPERS_AFTER_S
    callback.after_worker_group_poll_status(None)
    callback.after_worker_group_poll_status(None)
    assert started == ["group-1"]  # once, after the delay
    # A group shut down before the delay never gets one.
    callback.after_worker_group_start("group-2")
    callback.before_worker_group_shutdown("group-2")
    clock[0] += ray_controller.LONG_RUN_HELPERS_AFTER_S
    callback.after_worker_group_poll_status(None)
    assert started == ["group-1"] and stopped


def test_ray_trains_controller_side_imports_no_torch() -> None:
    """What Ray Train's controller unpickles for a Convoy run (the process group's backend,
    the scaling policies, the deferred preemption watcher) imports neither torch nor the
    engine: the controller is a process of its own, and torch is its dearest import."""
    pytest.importorskip("ray.train")
    probe = (
        "import sys, convoy.launchers.ray_controller as c; "
        "c.ProcessGroupConfig().backend_cls; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('convoy.engine')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]"


def test_a_private_ray_policy_sends_no_request_and_still_sizes_the_group() -> None:
    pytest.importorskip("ray.train")
    from ray.train.v2._internal.execution.scaling_policy import ResizeDecision
    from ray.train.v2.api.config import ScalingConfig

    from convoy.launchers.ray_controller import NoAutoscalerScalingPolicy

    policy = NoAutoscalerScalingPolicy(ScalingConfig(num_workers=3))
    policy.after_controller_start(train_run_context=None)
    decision = policy.make_decision_for_non_running_worker_group()
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 3
    assert policy._coordinator_client is None  # no coordinator actor was asked for


def test_a_joined_cluster_policy_asks_the_coordinator_only_once_the_workers_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("ray.train")
    from ray.train.v2._internal.execution.scaling_policy import NoopDecision, ResizeDecision
    from ray.train.v2.api.config import ScalingConfig

    from convoy.launchers import ray_controller

    created: list[str] = []

    class RecordingClient:
        def __init__(self, requester_id: str) -> None:
            created.append(requester_id)
            self.sent: list[int] = []

        def send_resource_request(self, scaling_config: object, num_workers: int) -> None:
            self.sent.append(num_workers)

        def maybe_send_resource_request(self, scaling_config: object, num_workers: int) -> None:
            self.sent.append(num_workers)

    monkeypatch.setattr(ray_controller, "_RequestWithoutWaiting", RecordingClient)
    policy = ray_controller.UnblockedRequestsScalingPolicy(ScalingConfig(num_workers=2))

    class Context:
        run_id = "abc"

    class GroupState:
        start_time = time.monotonic()

    policy.after_controller_start(Context())
    decision = policy.make_decision_for_non_running_worker_group()
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 2
    assert created == []  # nothing started beside the workers
    running = policy.make_decision_for_running_worker_group(GroupState(), None)
    assert isinstance(running, NoopDecision)
    assert created == []  # nor in the group's first seconds of training
    GroupState.start_time -= ray_controller.LONG_RUN_HELPERS_AFTER_S
    running = policy.make_decision_for_running_worker_group(GroupState(), None)
    assert isinstance(running, NoopDecision)
    assert created == ["train-abc"] and policy._coordinator_client.sent == [2, 2]
    # A restarted group (the client exists now) keeps sending as Ray Train does.
    policy.make_decision_for_non_running_worker_group()
    assert len(created) == 1 and policy._coordinator_client.sent == [2, 2, 2]


def test_a_bad_job_fails_with_its_own_error_while_ray_starts_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from convoy.errors import LaunchError
    from convoy.launchers import ray as ray_launcher

    job = load_job(None, [f"run.storage_dir={tmp_path}", "model.name=no_such_model"])
    stopped: list[bool] = []

    class StartsFine(FakeRay):
        def shutdown(self) -> None:
            stopped.append(True)

    monkeypatch.setattr(ray_launcher, "import_ray", StartsFine)
    monkeypatch.setattr(
        ray_launcher, "ensure_ray", lambda ray, *a, **k: ray_launcher.RayConnection(private=True)
    )
    with pytest.raises(ConfigError, match=r"^model.name: got 'no_such_model'"):
        ray_launcher.RayLauncher().launch(job)
    assert stopped == [True]  # the private Ray started beside the checks is stopped

    def ray_fails(*args: object, **kwargs: object) -> None:
        raise LaunchError("scaling.ray.start_timeout_s: the embedded Ray did not start")

    monkeypatch.setattr(ray_launcher, "ensure_ray", ray_fails)
    with pytest.raises(ConfigError, match=r"^model.name"):
        ray_launcher.RayLauncher().launch(job)
    assert not list(tmp_path.iterdir())  # nothing written for a job that never ran


@pytest.mark.parametrize(
    ("setting", "private", "expected"),
    [(None, True, False), (None, False, True), (True, True, True), (False, False, False)],
)
def test_prometheus_export_is_on_where_a_prometheus_can_scrape_it(
    tmp_path: Path, setting: bool | None, private: bool, expected: bool
) -> None:
    from convoy.launchers.ray_local import prometheus_enabled

    overrides = [] if setting is None else [f"monitor.prometheus={str(setting).lower()}"]
    job = load_job(REPO / "recipes" / "default.yaml", overrides)
    assert prometheus_enabled(job, private=private) is expected


def test_a_private_rays_processes_know_it_without_being_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from convoy.launchers.ray_local import PRIVATE_RAY_VARIABLE, prometheus_enabled

    job = load_job(REPO / "recipes" / "default.yaml", [])
    monkeypatch.setenv(PRIVATE_RAY_VARIABLE, "1")  # as a worker of a private Ray has it
    assert prometheus_enabled(job) is False
    monkeypatch.delenv(PRIVATE_RAY_VARIABLE)
    assert prometheus_enabled(job) is True


def test_a_private_rays_environment_is_set_only_while_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from convoy.launchers.ray_local import environment

    metrics = "RAY_enable_metrics_collection"  # Ray's spelling
    monkeypatch.setenv(metrics, "1")  # the user's own value
    monkeypatch.delenv("CONVOY_PRIVATE_RAY", raising=False)
    wanted = {metrics: "0", "CONVOY_PRIVATE_RAY": "1"}
    with environment(wanted):
        assert os.environ["CONVOY_PRIVATE_RAY"] == "1"
        assert os.environ[metrics] == "1"  # the user's wins
    # A later Ray in this process (one that wants metrics) starts from a clean slate.
    assert "CONVOY_PRIVATE_RAY" not in os.environ
    assert os.environ[metrics] == "1"


def test_hsdp_on_a_one_node_ray_cluster_is_checked_before_any_worker(tmp_path: Path) -> None:
    """On one node every worker is local, so hsdp's default shard group is all of them: one
    replica, refused before the workers start; a shard size that splits them is taken."""
    from convoy.launchers.ray import prepare_on_cluster

    class OneNode:
        def nodes(self) -> list[dict[str, object]]:
            return [{"Alive": True, "Resources": {"CPU": 4.0}}]

    base = [f"run.storage_dir={tmp_path}", "strategy.name=hsdp", "scaling.num_workers=4"]
    base += ["scaling.cpus_per_worker=0.5", "scaling.launcher=ray"]
    with pytest.raises(ConfigError, match="one replica, which is fsdp2"):
        prepare_on_cluster(OneNode(), load_job(None, base))
    split = prepare_on_cluster(OneNode(), load_job(None, [*base, "strategy.shard_size=2"]))
    assert split.strategy.shard_size == 2  # type: ignore[union-attr]


def test_preprocessing_resources_must_be_offered_by_a_node_with_cpus() -> None:
    from convoy.launchers.ray import check_data_resources

    job = load_job(None, [*RAY_DATA, "data.ray_data.resources={preprocess: 1}"])
    check_data_resources(job, [{"CPU": 1.0, "trainer": 2.0}, {"CPU": 1.0, "preprocess": 4.0}])
    with pytest.raises(ResourceError, match=r"data.ray_data.resources: no node .* preprocess=1"):
        check_data_resources(job, [{"CPU": 1.0, "trainer": 2.0}, {"preprocess": 4.0}])
    with pytest.raises(ConfigError, match=r"data.ray_data.resources: got \{'GPU': 1\}"):
        load_job(None, [*RAY_DATA, "data.ray_data.resources={GPU: 1}"])


class AgentSignal(Exception):
    """Stands in for torchrun's ``SignalException`` (its signature: a message and ``sigval``)."""

    def __init__(self, message: str, sigval: signal.Signals) -> None:
        super().__init__(message)
        self.sigval = sigval


@pytest.mark.parametrize(
    ("sent", "passed_on"),
    [
        (signal.SIGINT, signal.SIGINT),
        (signal.SIGTERM, signal.SIGTERM),
        (signal.SIGUSR1, signal.SIGTERM),  # a worker would die of SIGUSR1
    ],
)
def test_the_agent_is_stopped_by_the_first_stop_signal_only(
    sent: signal.Signals, passed_on: signal.Signals
) -> None:
    """The first stop signal is raised into torchrun's agent (which passes it to its workers
    and waits while they save); a repeated one, during that wait, is not; afterwards the
    handlers are the ones that were there."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    with stopping_the_agent(AgentSignal):
        with pytest.raises(AgentSignal) as first:
            os.kill(os.getpid(), sent)
            time.sleep(1)  # the handler runs at once; this only bounds a failure
        assert first.value.sigval == passed_on and sent.name in str(first.value)
        for again in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            os.kill(os.getpid(), again)  # the agent is waiting on its workers: not raised
    assert {s: signal.getsignal(s) for s in before} == before


class _HangingWorkerGroup:
    """Two workers whose process-group shutdown has not answered (a worker stuck in
    ``destroy_process_group``): what ``on_shutdown`` waits on, up to Ray's time-out."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, dict[str, Any]]] = []

    def __len__(self) -> int:
        return 2

    def execute_async(self, function: Any, **kwargs: Any) -> list[str]:
        self.asked.append((function, kwargs))
        return ["ref-0", "ref-1"]


def test_a_process_group_shutdown_that_hangs_is_given_up_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ray's own behaviour, kept: the workers are asked to destroy their process group, the
    controller waits ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S`` at most, then warns and goes
    on (the worker group is killed next), without raising."""
    pytest.importorskip("ray.train")
    from ray.exceptions import GetTimeoutError

    from convoy.launchers import ray_controller

    waited: list[float] = []

    def get(refs: Any, timeout: float) -> None:
        waited.append(timeout)
        raise GetTimeoutError("no answer")

    monkeypatch.setattr(ray_controller.ray, "get", get)
    monkeypatch.setenv("TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", "7")
    group = _HangingWorkerGroup()
    with caplog.at_level(logging.WARNING, logger=ray_controller.__name__):
        ray_controller.ProcessGroupBackend().on_shutdown(group, ray_controller.ProcessGroupConfig())
    assert group.asked == [
        (ray_controller.shut_down_process_group, {"destroy_process_group": True})
    ]
    assert waited == [7]
    assert "Torch process group shutdown timed out after 7 seconds" in caplog.text


def test_torchrun_workers_get_their_thread_count_in_omp_num_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun sets OMP_NUM_THREADS=1 and prints a five-line banner when it is unset;
    Convoy sets the threads each worker uses (what the worker gives torch) and keeps the
    user's own value."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    endpoint = "127.0.0.1:29400"
    job = load_job(None, ["scaling.launcher=torchrun", "scaling.num_workers=2"])
    assert worker_environment(job, endpoint)["OMP_NUM_THREADS"] == str(default_threads(2))
    pinned = load_job(None, ["scaling.launcher=torchrun", "scaling.threads_per_worker=3"])
    assert worker_environment(pinned, endpoint)["OMP_NUM_THREADS"] == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert worker_environment(pinned, endpoint)["OMP_NUM_THREADS"] == "5"


GLOO_RESET = (
    "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28802: Connection reset by peer."
)


def test_a_failure_on_a_lost_peer_is_told_from_the_rank_that_failed_first() -> None:
    """A rank whose collective lost the rank at the other end (gloo's words, also as the cause
    or the context of what the rank raised) failed because that rank did; its own fault is
    not."""
    import torch.distributed as dist

    assert lost_a_peer(RuntimeError(GLOO_RESET))
    assert lost_a_peer(dist.DistNetworkError("the store's host went away"))
    try:
        try:
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:52953.")
        except RuntimeError:
            raise ValueError("saving on the way out failed")  # noqa: B904 (the context is the test)
    except ValueError as raised:
        assert lost_a_peer(raised)  # raised while handling the lost peer
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = RuntimeError(GLOO_RESET)
    assert lost_a_peer(wrapped)
    assert not lost_a_peer(ValueError("fault injection: rank 1 raised after step 1"))
