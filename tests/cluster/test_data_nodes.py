"""Preprocessing where the CPUs are: Ray Data's map stages on a CPU-only node, training on the
other (two test hosts, ``ray start`` with custom resources, as a user or KubeRay starts them).

The training host is started with a ``trainer`` resource, the data host with ``preprocess``;
the job asks ``scaling.resources_per_worker: {trainer: 1}`` and
``data.ray_data.resources: {preprocess: 1}``. Ray's state API then says on which node every
map task ran.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from netns import RayNodes, TestHosts

from convoy.data.telematics import FleetSpec, write_fleet

pytestmark = [pytest.mark.cluster]

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "recipes" / "telematics_stream.yaml")

TASK_NODES = """
import json
import ray
from ray.util.state import list_nodes, list_tasks

ray.init(logging_config=ray.LoggingConfig(log_level="ERROR"))
ips = {n.node_id: n.node_ip for n in list_nodes()}
tasks = list_tasks(filters=[("type", "=", "NORMAL_TASK")], detail=True, limit=10000)
print(json.dumps(sorted({(t.name, ips.get(t.node_id, "?")) for t in tasks if t.node_id})))
"""


def data_node_args(storage: Path, fleet: Path, name: str) -> list[str]:
    overrides = [
        f"data.path={fleet}",
        "data.loader=ray_data",
        "model={name: conv1d, kwargs: {hidden: 16, depth: 2}}",
        "scaling.resources_per_worker={trainer: 1}",
        "scaling.cpus_per_worker=0.5",
        "data.ray_data.resources={preprocess: 1}",
        "run.epochs=1",
        f"run.storage_dir={storage}",
        "run.shared_storage=true",  # every test host sees this machine's /tmp
        f"run.name={name}",
        "run.progress=plain",
    ]
    return [sys.executable, "-m", "convoy", "train", RECIPE, *(f"-o{o}" for o in overrides)]


def test_map_stages_run_on_the_cpu_node_and_the_training_node_only_trains(
    make_test_hosts: Callable[[int], TestHosts], ray_nodes: RayNodes, tmp_path: Path
) -> None:
    fleet = tmp_path / "fleet"
    write_fleet(FleetSpec(devices=10, hours=0.5, rows_per_group=64), str(fleet))
    trainer, data = make_test_hosts(2)
    ray_nodes.start_head(trainer, num_cpus=1, extra_args=['--resources={"trainer": 2}'])
    ray_nodes.add_worker(data, num_cpus=1, extra_args=['--resources={"preprocess": 4}'])
    done = trainer.run(
        data_node_args(tmp_path, fleet, "split"), env=ray_nodes.driver_env(), timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert f"ip={trainer.ip}" in output and f"ip={data.ip}" not in output, output[-4000:]
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["metrics"]["test/samples"] == 180  # one held-out device: 180 windows

    listed = trainer.run(
        [sys.executable, "-c", TASK_NODES], env=ray_nodes.driver_env(), timeout=120
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    ran = json.loads(listed.stdout.strip().splitlines()[-1])
    maps = {ip for name, ip in ran if "MapBatches" in name}
    assert maps == {data.ip}, ran
    print(
        f"\nmap tasks on {sorted(maps)}; train workers on {trainer.ip}; data wait "
        f"{100 * summary['data_wait_fraction']:.1f}%, "
        f"{summary['samples_per_second']:.0f} samples/s"
    )
