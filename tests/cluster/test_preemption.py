"""Spot reclaims on two test hosts, as a cloud does them.

- Ray: the worker node is drained with ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
  --deadline-remaining-seconds 30`` (or the Kubernetes preStop hook's ``convoy k8s
  drain-node``) mid-epoch, a replacement node joins, and the drained node is killed at its
  deadline. The run saves the step it finished on the notice, waits, and Ray Train restarts
  it on the head and the replacement from that checkpoint.
- Ray, ddp with relaxed collectives: the drained node is killed about a second after the
  drain, as soon as the notice is agreed; rank 0 saves alone and Ray registers the save
  without the dead rank.
- torchrun (c10d, one node per host): one node gets SIGTERM and, after a grace period, would
  get SIGKILL; both nodes save the same step and stop, and the same commands resume.

Each: no step is trained twice, and the final weights equal an uninterrupted run's, bit for
bit. The uninterrupted runs are made once per strategy for the module; the drained-node test's
two strategies share one Ray head (``drain_ray``), each adding and losing its own nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from netns import FAST_NODE_DEATH_ENV, RayNodes, TestHosts, kill_namespace
from test_multinode import CONVOY, Driver, SharedRay, committed, torchrun_args, train_args
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from convoy.cli import main
from convoy.engine.stop import STOPPED_EXIT_CODE

pytestmark = [pytest.mark.cluster]

DEADLINE_S = 20
CORES = len(os.sched_getaffinity(0))
# The same job both ways; each step made slower (a sleep outside the math) so the drain,
# the notice and the kill land mid-run on a 2-core machine.
STEPS = 60
JOB = [f"run.max_steps={STEPS}", "run.log_every_steps=1", "checkpoint.every_epochs=1",
       "scaling.threads_per_worker=1"]  # fmt: skip
SLOW = ["fault.kind=slow", "fault.at_step=1", "fault.slow_seconds=0.25"]
NODE_ID = (
    "import os\n"
    "from ray._raylet import GcsClient\n"
    "nodes = GcsClient(address=os.environ['RAY_ADDRESS']).get_all_node_info()\n"
    "print(next(i.node_id.hex() for i in nodes.values()\n"
    "           if i.node_manager_address == os.environ['NODE_IP'] and i.state == 0))\n"
)


def ray_drain_node(node_id: str, deadline_s: int) -> list[str]:
    """Ray's own drain command, as a cloud's spot notice reaches the GCS."""
    return [
        str(Path(sys.executable).with_name("ray")), "drain-node", f"--node-id={node_id}",
        "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim (test)",
        f"--deadline-remaining-seconds={deadline_s}",
    ]  # fmt: skip


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [r["step"] for r in map(json.loads, filter(None, lines)) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], dict[str, torch.Tensor]]:
    """The final weights of the job run straight through (torchrun, 2 workers, this
    machine), once per strategy for the module: ``convoy train``'s main in the test's process,
    as the reference is not what a test stops."""
    found: dict[str, dict[str, torch.Tensor]] = {}

    def weights(strategy: str) -> dict[str, torch.Tensor]:
        if strategy not in found:
            storage = tmp_path_factory.mktemp(f"straight-{strategy}")
            args = train_args(
                storage, "straight", "scaling.launcher=torchrun", *JOB, f"strategy.name={strategy}"
            )
            assert main(args[len(CONVOY) :]) == 0  # in this process; its workers are torchrun's
            found[strategy] = final_weights(storage / "straight")
        return found[strategy]

    return weights


def assert_no_step_redone_and_bitwise(run_dir: Path, expected: dict[str, torch.Tensor]) -> None:
    """Every step logged once, and the final weights equal ``expected`` bit for bit."""
    steps = logged_steps(run_dir)
    assert steps == list(range(1, STEPS + 1)), (
        f"steps trained twice: {len(steps) - len(set(steps))}"
    )
    got = final_weights(run_dir)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    target = run_dir.parent / f"{run_dir.name}.pt"
    dcp_to_torch_save(committed(run_dir)[-1].parent, target)
    return torch.load(target, weights_only=True)["model"]


def test_with_relaxed_collectives_a_node_that_dies_early_costs_no_step(
    make_test_hosts: Callable[[int], TestHosts],
    ray_nodes: RayNodes,
    uninterrupted: Callable[[str], dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    """ddp with ``scaling.relax_collectives_on_preemption``: the drained node is killed as
    soon as the notice is agreed, long before its deadline, while rank 0 saves. Rank 0 saves
    alone and Ray's report barrier leaves the dead rank out, so the run still resumes from
    that save. The head takes no workers here, so the rank off rank 0's node can be drained
    without taking Ray's head with it."""
    head, first, second, replacement = make_test_hosts(4)
    ray_nodes.start_head(head, num_cpus=0, env=FAST_NODE_DEATH_ENV)
    nodes = {h.ip: ray_nodes.start_worker(h, ray_nodes.head.address, num_cpus=1)
             for h in (first, second)}  # fmt: skip
    job = [*JOB, "strategy.name=ddp"]

    env = {**ray_nodes.driver_env(), "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
    run_dir = tmp_path / "relaxed"
    # Ray 2.60 counts a drained node that dies before its deadline (missed heartbeats) as a
    # failure, not a preemption: one restart is allowed for it.
    relaxed = [
        *job, *SLOW, "scaling.relax_collectives_on_preemption=true", "scaling.max_failures=1"
    ]  # fmt: skip
    driver = Driver(head, train_args(tmp_path, "relaxed", *relaxed), tmp_path / "driver.log", env)
    driver.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), timeout=240)
    started = time.monotonic()
    driver.wait_for(
        lambda: time.monotonic() - started > 12 and len(logged_steps(run_dir)) >= 20, 240
    )
    # The node of rank 1: Ray lists the group as "(ip=..., pid=...) world_rank=1".
    victim_ip = re.findall(r"ip=([\d.]+), pid=\d+\) world_rank=1", driver.output)[-1]
    node_id = head.run(
        [sys.executable, "-c", NODE_ID], env={**env, "NODE_IP": victim_ip}, check=True
    ).stdout.strip()
    head.run(ray_drain_node(node_id, DEADLINE_S), env=env, check=True)
    drained_at = time.monotonic()
    driver.wait_for(lambda: "without waiting for them" in driver.output, timeout=DEADLINE_S)
    ray_nodes.kill_node(nodes[victim_ip])  # gone long before its deadline
    killed_after = time.monotonic() - drained_at
    ray_nodes.add_worker(replacement, num_cpus=1)
    assert driver.wait(timeout=300) == 0, driver.output[-5000:]

    output = driver.output
    shown = [line for line in output.splitlines() if "rank 0" in line and "preempt" in line]
    shown += [line for line in output.splitlines() if "resumed from" in line]
    print("\n" + "\n".join(shown) + f"\nnode killed {killed_after:.1f} s after the drain")
    assert killed_after < DEADLINE_S / 2
    saved = re.search(r"checkpoint (step_\d+) committed by rank 0 alone", output)
    assert saved, output[-5000:]
    assert f"convoy: resumed from {saved.group(1)}" in output
    assert_no_step_redone_and_bitwise(run_dir, uninterrupted("ddp"))


def test_a_stopped_torchrun_node_costs_no_step(
    make_test_hosts: Callable[[int], TestHosts],
    uninterrupted: Callable[[str], dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    """torchrun on two hosts (c10d): SIGTERM to one node's ``convoy train`` (which passes it
    to its agent and workers) with a grace period before a SIGKILL. Both nodes' workers
    save the same step and stop with the "stopped" code; the same commands resume."""
    head, worker = make_test_hosts(2)
    job = [*JOB, "strategy.name=ddp", "scaling.torchrun.nnodes=2"]

    run_dir = tmp_path / "tr-spot"
    args = torchrun_args(tmp_path, "tr-spot", f"{head.ip}:29400", *job)

    def start(attempt: str, slow: list[str]) -> list[Driver]:
        return [
            Driver(
                host,
                ["taskset", "-c", str(i % CORES), *args, *(f"-o{o}" for o in slow)],
                tmp_path / f"{attempt}-{host.name}.log",
            )
            for i, host in enumerate((head, worker))
        ]

    nodes = start("first", SLOW)
    nodes[0].wait_for(lambda: len(logged_steps(run_dir)) >= 15, timeout=240)
    nodes[1].process.send_signal(signal.SIGTERM)  # the node's spot notice
    grace_ends = time.monotonic() + 30
    for node in nodes:
        try:
            node.process.wait(timeout=max(0.0, grace_ends - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_namespace(worker.netns)  # the grace period is over: the node goes
    codes = [node.process.returncode for node in nodes]
    assert codes == [STOPPED_EXIT_CODE] * 2, [node.output[-3000:] for node in nodes]
    stop_line = next(line for line in nodes[0].output.splitlines() if "stopped on" in line)
    print(f"\n{stop_line}")
    stopped_at = logged_steps(run_dir)[-1]
    assert f"checkpoint step_{stopped_at:08d} committed" in stop_line

    again = start("again", [])
    for node in again:
        assert node.wait(timeout=300) == 0, node.output[-4000:]
    assert f"convoy: resumed from step_{stopped_at:08d}" in again[0].output
    assert_no_step_redone_and_bitwise(run_dir, uninterrupted("ddp"))


# The drained-node test's head (1 CPU: it holds rank 0), one for both strategies; each adds a
# node to drain and its replacement on fresh hosts, and those are killed after it.
DRAIN_WORKER_NODES = 2 * 2


@pytest.fixture(scope="module")
def drain_ray(module_test_hosts: Callable[[int], TestHosts]) -> Iterator[SharedRay]:
    cluster = SharedRay(module_test_hosts(1 + DRAIN_WORKER_NODES))
    yield cluster
    cluster.nodes.stop()


@pytest.fixture
def drain_cluster(drain_ray: SharedRay) -> Iterator[SharedRay]:
    """The module's head, alone at the start of the test; its test's nodes killed after it."""
    yield drain_ray
    drain_ray.remove_workers()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_drained_node_costs_no_step(
    strategy: str,
    drain_cluster: SharedRay,
    uninterrupted: Callable[[str], dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    ray_nodes, head = drain_cluster.nodes, drain_cluster.head
    drained = drain_cluster.add_worker()
    worker = drained.host
    job = [*JOB, f"strategy.name={strategy}"]
    # The default recipe with a 20 s notice (issue 18 showed 30 s); fsdp2 with a shorter one.
    deadline = DEADLINE_S if strategy == "ddp" else DEADLINE_S // 2

    env = {**ray_nodes.driver_env(), "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1"}
    node_id = head.run(
        [sys.executable, "-c", NODE_ID], env={**env, "NODE_IP": worker.ip}, check=True
    ).stdout.strip()
    run_dir = tmp_path / "spot"
    driver = Driver(head, train_args(tmp_path, "spot", *job, *SLOW), tmp_path / "driver.log", env)
    # Ray Train's preemption watcher starts once the workers have trained 10 s.
    driver.wait_for(lambda: (run_dir / "metrics.jsonl").exists(), timeout=240)
    started = time.monotonic()
    driver.wait_for(
        lambda: time.monotonic() - started > 12 and len(logged_steps(run_dir)) >= 20, 240
    )
    if strategy == "ddp":  # Ray's own command, from the head
        head.run(ray_drain_node(node_id, deadline), env=env, check=True)
    else:  # a rendered Ray worker pod's preStop hook, on the node itself
        drain = [*CONVOY, "k8s", "drain-node", f"--deadline-s={deadline}", "--no-wait"]
        done = worker.run(drain, env=env, check=True)
        assert f"drained Ray node {worker.ip} ({node_id[:8]})" in done.stdout
    drained_at = time.monotonic()
    drain_cluster.add_worker()  # the cloud's replacement
    driver.wait_for(lambda: "is being preempted" in driver.output, timeout=deadline)
    time.sleep(max(0.0, drained_at + deadline - time.monotonic()))
    ray_nodes.kill_node(drained)  # taken at its deadline
    assert driver.wait(timeout=300) == 0, driver.output[-5000:]

    output = driver.output
    shown = [line for line in output.splitlines() if "stopped on preemption" in line]
    shown += [line for line in output.splitlines() if "is being preempted" in line]
    shown += [line for line in output.splitlines() if "resumed from" in line]
    print("\n" + "\n".join(shown))
    assert f"preemption of node {worker.ip}" in shown[0], output[-5000:]
    assert "before the deadline" in shown[0]
    saved = shown[0].split("checkpoint ")[1].split()[0]
    assert f"convoy: resumed from {saved}" in output
    assert_no_step_redone_and_bitwise(run_dir, uninterrupted(strategy))
