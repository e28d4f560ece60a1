"""The default recipe on a real two-node Ray cluster (test hosts), as a user runs it.

The head and the worker node are started with ``ray start`` and token auth, the way a user or
KubeRay starts them; the driver runs ``convoy train`` on the head with ``RAY_ADDRESS``. The
hosts' host name resolves to loopback, so these runs fail with ``Gloo connectFullMesh`` unless
Convoy puts gloo on each node's own interface.

The Ray tests share one head for the module (``shared_ray``: its start is a Ray of its own,
with the dashboard), each adding its worker nodes on fresh hosts and losing only those.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from netns import FAST_NODE_DEATH_ENV, Host, RayNode, RayNodes, TestHosts, kill_namespace

from convoy.cli import main

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "default.yaml")
CONVOY = [sys.executable, "-m", "convoy"]
CORES = len(os.sched_getaffinity(0))


def train_args(storage: Path, name: str, *overrides: str) -> list[str]:
    base = [
        f"run.storage_dir={storage}",
        "run.shared_storage=true",  # every test host sees this machine's /tmp
        f"run.name={name}",
        "run.progress=plain",
    ]
    return [*CONVOY, "train", RECIPE, *(f"-o{o}" for o in [*base, *overrides])]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def committed(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step_*/meta.json"))


class Driver:
    """A ``convoy train`` started in a test host, its output going to a log file (a pipe
    nobody reads while the test waits would fill up and stall it)."""

    def __init__(self, host: Host, args: list[str], log: Path, env: dict | None = None) -> None:
        self.log = log
        with open(log, "w") as out:
            self.process = host.popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"{self.log.name}: still running after {timeout:g} s:\n{self.output[-4000:]}"
            )

    def wait_for(self, condition: Callable[[], bool], timeout: float) -> None:
        """Wait until ``condition()``; fail at once if the driver ends first."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(
                    f"{self.log.name} exited ({self.process.returncode}) first:\n"
                    f"{self.output[-4000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"condition not reached in {timeout:g} s:\n{self.output[-4000:]}")
            time.sleep(0.2)


def elastic_driver_env(nodes: RayNodes) -> dict[str, str | None]:
    # After a node is lost, Ray Train first tries the old size again until the worker group
    # start times out (60 s by default) and only then starts on what is left.
    return {**nodes.driver_env(), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}


class SharedRay:
    """The module's Ray cluster: one head (1 CPU, quick to declare a node dead) started once,
    and a test host for each worker node a test adds. A test only ever kills the worker
    nodes it added, and those it left alive are killed after it (``ray_cluster``), so each
    test starts from the head alone, as a cluster of its own would."""

    def __init__(self, hosts: TestHosts) -> None:
        self.hosts = list(hosts)
        self.nodes = RayNodes()
        self.nodes.start_head(self.hosts[0], num_cpus=1, env=FAST_NODE_DEATH_ENV)
        self.spare = self.hosts[1:]  # a fresh host for every worker node
        self.workers: list[RayNode] = []  # the running test's

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def add_worker(self) -> RayNode:
        worker = self.nodes.add_worker(self.spare.pop(0), num_cpus=1)
        self.workers.append(worker)
        return worker

    def let_train_see_the_nodes(self) -> None:
        """Have Ray Train's elastic policy count the nodes that joined since the last run.

        The policy counts the nodes it may start on from Ray's ``AutoscalingCoordinator``, a
        detached actor on the head that the module's earlier runs created and that re-reads
        the cluster's nodes every 20 s: a node added since its last read is not counted when
        the next run starts (a cluster of its own would create the actor after the node
        joined). This asks it to re-read now, once the nodes are alive in Ray's view.
        """
        ips = [worker.host.ip for worker in self.workers]
        done = self.head.run(
            [sys.executable, "-c", LET_TRAIN_SEE_THE_NODES, *ips],
            env=self.nodes.driver_env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    def remove_workers(self) -> None:
        for worker in self.workers:
            self.nodes.kill_node(worker)
        self.workers = []


LET_TRAIN_SEE_THE_NODES = """
import sys, time, ray
ray.init(logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 60
def alive():
    return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
while not set(sys.argv[1:]) <= alive():
    assert time.monotonic() < deadline, f"nodes {sys.argv[1:]} not alive in {alive()}"
    time.sleep(0.2)
try:
    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
except ValueError:
    sys.exit(0)  # none yet: the next run creates it, reading the nodes then
ray.get(coordinator.get_reserved_resources.remote("convoy-tests", recompute=True))
"""

# One host per worker node the module's Ray tests add, and the head's.
RAY_WORKER_NODES = 4


@pytest.fixture(scope="module")
def shared_ray(module_test_hosts: Callable[[int], TestHosts]) -> Iterator[SharedRay]:
    cluster = SharedRay(module_test_hosts(1 + RAY_WORKER_NODES))
    yield cluster
    cluster.nodes.stop()


@pytest.fixture
def ray_cluster(shared_ray: SharedRay) -> Iterator[SharedRay]:
    """The module's head, alone at the start of the test; its test's worker nodes killed
    after it."""
    yield shared_ray
    shared_ray.remove_workers()


def torchrun_args(storage: Path, name: str, endpoint: str, *overrides: str) -> list[str]:
    return train_args(
        storage,
        name,
        "scaling.launcher=torchrun",
        f"scaling.torchrun.rdzv_endpoint={endpoint}",
        *overrides,
    )


def test_torchrun_loses_a_node_and_finishes_on_the_other(
    make_test_hosts: Callable[[int], TestHosts], tmp_path: Path
) -> None:
    """Elastic torchrun (``--nnodes 1:2``, c10d): the worker node dies after a checkpoint;
    the head's agent restarts its worker, which resumes from that checkpoint at world size 1."""
    head, worker = make_test_hosts(2)
    run_dir = tmp_path / "tr-elastic"
    args = torchrun_args(
        tmp_path,
        "tr-elastic",
        f"{head.ip}:29400",
        "run.epochs=3",
        "checkpoint.every_steps=20",
        "scaling.num_workers=[1,2]",
        "scaling.max_failures=1",
    )
    survivor, victim = (
        Driver(host, ["taskset", "-c", str(i % CORES), *args], tmp_path / f"{host.name}.log")
        for i, host in enumerate((head, worker))
    )
    survivor.wait_for(lambda: bool(committed(run_dir)), timeout=240)
    saved = committed(run_dir)[-1].parent.name
    # The whole node: every process in it (torchrun starts its workers in their own sessions).
    kill_namespace(worker.netns)
    # Killed: reaped once its last thread has exited, which on a busy machine can come after
    # its main thread is already a zombie (what kill_namespace waits for).
    victim.process.wait(timeout=30)
    assert survivor.wait(timeout=300) == 0, survivor.output[-5000:]
    output = survivor.output
    assert f"convoy: resumed from {saved}" in output, output[-3000:]
    print(f"\n{next(line for line in output.splitlines() if 'convoy: resumed from' in line)}")
    summary = summary_of(run_dir)
    assert summary["world_size"] == 1
    assert summary["metrics"]["test/acc"] > 0.2


# The layouts are compared on their metrics after the same steps, not on convergence: 12
# steps of the default recipe, then its evaluation.
FEW_STEPS = ("run.epochs=1", "run.max_steps=12")


def test_default_recipe_on_two_nodes_matches_one_node(
    ray_cluster: SharedRay, tmp_path: Path
) -> None:
    """One recipe three ways, the same metrics: one node (torchrun, 2 workers), two Ray
    nodes (one worker each), two torchrun nodes (c10d rendezvous, one worker each)."""
    ray_nodes, head = ray_cluster.nodes, ray_cluster.head
    worker = ray_cluster.add_worker().host
    refusals = [
        # A local run directory while workers sit on two nodes.
        (ray_nodes.driver_env(), ["-orun.shared_storage=false"], "run.storage_dir: got"),
        # The token cluster joined without its token.
        (ray_nodes.driver_env(token=False), [], "RAY_AUTH_TOKEN"),
    ]
    for env, extra, expected in refusals:
        refused = head.run([*train_args(tmp_path, "refused"), *extra], env=env, timeout=120)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("convoy: error:")]
        assert refused.returncode != 0 and len(errors) == 1, refused.stderr[-3000:]
        assert expected in errors[0], errors[0]
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()
        print(f"\n{errors[0]}")

    # The one-node reference through the CLI's main in this process (its torchrun workers are
    # processes as ever): the layouts on two nodes are what is tested, not its start.
    single = train_args(tmp_path, "one-node", "scaling.launcher=torchrun", *FEW_STEPS)
    assert main(single[len(CONVOY) :]) == 0

    done = head.run(
        train_args(tmp_path, "ray-two-nodes", *FEW_STEPS),
        env=ray_nodes.driver_env(),
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    # One worker on each node: Ray lists the group with the node IPs.
    assert f"ip={head.ip}" in output and f"ip={worker.ip}" in output, output[-4000:]

    # torchrun: the same command on both hosts, the rendezvous on the head's address.
    endpoint = f"{head.ip}:29400"
    args = torchrun_args(
        tmp_path, "torchrun-two-nodes", endpoint, *FEW_STEPS, "scaling.torchrun.nnodes=2"
    )
    # Each test host gets a core of its own (CPU affinity), as separate machines would: the
    # workers' torch threads follow the affinity, so two hosts do not oversubscribe the cores.
    nodes = [
        Driver(host, ["taskset", "-c", str(i % CORES), *args], tmp_path / f"tr-{host.name}.log")
        for i, host in enumerate((head, worker))
    ]
    for node in nodes:
        assert node.wait(timeout=300) == 0, node.output[-4000:]

    one = summary_of(tmp_path / "one-node")
    for name in ("ray-two-nodes", "torchrun-two-nodes"):
        two = summary_of(tmp_path / name)
        assert two["world_size"] == one["world_size"] == 2
        for key, value in one["metrics"].items():
            assert two["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
    steps = {
        name: f"{summary_of(tmp_path / name)['step_seconds_median'] * 1e3:.1f} ms"
        for name in ("one-node", "ray-two-nodes", "torchrun-two-nodes")
    }
    print(f"\nstep time (median): {steps}; test acc {one['metrics']['test/acc']:.4f}")


def test_a_lost_node_fails_the_run_clearly_and_its_checkpoint_resumes(
    ray_cluster: SharedRay, tmp_path: Path
) -> None:
    ray_nodes, head = ray_cluster.nodes, ray_cluster.head
    lost = ray_cluster.add_worker()
    worker = lost.host
    run_dir = tmp_path / "lost"
    args = train_args(tmp_path, "lost", "run.epochs=3", "checkpoint.every_steps=20")
    driver = Driver(head, args, tmp_path / "driver.log", env=ray_nodes.driver_env())
    driver.wait_for(lambda: bool(committed(run_dir)), timeout=240)
    ray_nodes.kill_node(lost)
    assert driver.wait(timeout=240) != 0
    output = driver.output
    errors = [line for line in output.splitlines() if line.startswith("convoy: error:")]
    assert len(errors) == 1, output[-4000:]
    print(f"\n{errors[0]}")
    assert f"lost node {worker.ip}" in errors[0], output[-5000:]
    assert "resumes when you run 'lost' again" in errors[0]
    saved = committed(run_dir)[-1].parent.name

    # Later, on what is left (the head alone), the same run name resumes from that checkpoint.
    again = head.run([*args, "-oscaling.num_workers=1"], env=ray_nodes.driver_env(), timeout=300)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert f"convoy: resumed from {saved}" in output, output[-3000:]
    print(next(line for line in output.splitlines() if "convoy: resumed from" in line))
    assert summary_of(run_dir)["world_size"] == 1


def test_an_elastic_run_continues_on_the_nodes_left(ray_cluster: SharedRay, tmp_path: Path) -> None:
    ray_nodes, head = ray_cluster.nodes, ray_cluster.head
    worker = ray_cluster.add_worker()
    ray_cluster.let_train_see_the_nodes()  # or the run may start on the head alone
    run_dir = tmp_path / "elastic"
    args = train_args(
        tmp_path,
        "elastic",
        "run.epochs=3",
        "checkpoint.every_steps=20",
        "scaling.num_workers=[1,2]",
        "scaling.max_failures=2",
    )
    driver = Driver(head, args, tmp_path / "driver.log", env=elastic_driver_env(ray_nodes))
    driver.wait_for(lambda: bool(committed(run_dir)), timeout=240)
    # Ray says "Attempting to start ... of size 2" too, before an attempt that may fail.
    assert "Started training worker group of size 2" in driver.output, driver.output[-3000:]
    ray_nodes.kill_node(worker)
    assert driver.wait(timeout=400) == 0, driver.output[-5000:]
    output = driver.output
    assert "convoy: resumed from step_" in output, output[-3000:]
    print("\n" + "\n".join(line for line in output.splitlines() if "resumed from" in line))
    summary = summary_of(run_dir)
    assert summary["world_size"] == 1
    assert summary["metrics"]["test/acc"] > 0.2  # it trained on, 3 epochs in all


def test_an_elastic_run_grows_when_a_node_joins(ray_cluster: SharedRay, tmp_path: Path) -> None:
    ray_nodes, head = ray_cluster.nodes, ray_cluster.head
    args = train_args(
        tmp_path,
        "grow",
        "run.epochs=200",  # never reached: the test ends once the run has grown
        "checkpoint.every_steps=20",
        "scaling.num_workers=[1,2]",
        "scaling.elastic_monitor_interval_s=2",
    )
    driver = Driver(head, args, tmp_path / "driver.log", env=elastic_driver_env(ray_nodes))
    driver.wait_for(lambda: "| ddp x 1 |" in driver.output, timeout=240)
    joiner = ray_cluster.add_worker().host
    # Ray Train restarts the group at 2 workers from the last checkpoint; once an epoch has
    # finished at the new size, the growth is shown (the rest of the run would only repeat it).
    grown = re.compile(r"convoy: resumed from step_\d+[^\n]*\n[^\n]*\| ddp x 2 \|.*\nepoch ", re.S)
    driver.wait_for(lambda: bool(grown.search(driver.output)), timeout=300)
    output = driver.output
    assert "worker group of size 1" in output and "worker group of size 2" in output
    assert [ip for ip in (head.ip, joiner.ip) if f"ip={ip}" in output.split("size 2")[-1]] == [
        head.ip,
        joiner.ip,
    ]
