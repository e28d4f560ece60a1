"""Where preprocessing runs: the training node's own CPUs, or a CPU-only second node.

Two test hosts (network namespaces, ``tests/cluster/netns.py``), a Ray cluster started with
``ray start`` on them, ``convoy train`` from the first with ``RAY_ADDRESS``. Two workloads:

- images: a generated ImageFolder tree (``data_pipeline.make_tree``: 64x64 JPEG/PNG, decoded,
  resized to 32, shifted and flipped), ``vit_tiny``, ddp x 2, global batch 128;
- telematics: ``convoy data synth-telematics`` (6 x 200 series), ``recipes/telematics_stream``
  (conv1d), ddp x 2, global batch 64.

Three placements, the same two cores in all of them:

- ``torch, one node``: one host with 2 CPUs; the torch loader in each train worker (images:
  one DataLoader worker process each; telematics: the streamed row groups);
- ``ray_data, one node``: the same host; Ray Data's map tasks beside the train workers
  (1 CPU kept for them: train workers get 0.5 CPU each);
- ``ray_data, data node``: host h0 (1 CPU, core 0, resource ``trainer``) trains, host h1
  (1 CPU, core 1, resource ``preprocess``) is the head (GCS, the driver, Ray Data's
  executor) and runs every map task
  (``scaling.resources_per_worker: {trainer: 1}``, ``data.ray_data.resources:
  {preprocess: 1}``).

Reported: samples/s and the data-wait fraction from each run's summary (time waiting for the
next batch over step time), whole and after the first batch, whose wait (the pipeline's start:
Ray Data's task processes importing torch) is shown apart. One machine of 2 cores cannot add CPUs by adding a node: what the
data node changes here is only that preprocessing no longer competes with training for the
training node's core.

    python benchmarks/data_nodes.py [--images 3000] [--devices 40] [--epochs 2] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import stat
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from netns import Host, RayNodes, TestHosts, cannot_make_hosts  # noqa: E402

from data_pipeline import data_overrides, make_tree  # noqa: E402
from dated import publish  # noqa: E402  (this folder)

CONVOY = [sys.executable, "-m", "convoy", "train"]
RAY = str(Path(sys.executable).with_name("ray"))


def pinned_ray(folder: Path, cores: str) -> str:
    """A ``ray`` that runs on ``cores`` only (its daemons and workers inherit the affinity)."""
    wrapper = folder / f"ray-on-{cores.replace(',', '-')}"
    wrapper.write_text(f'#!/bin/sh\nexec taskset -c {cores} {RAY} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


def workloads(tmp: Path, images: int, devices: int) -> dict[str, tuple[str, list[str]]]:
    tree = make_tree(tmp / "tree", images)
    fleet = tmp / "fleet"
    os.system(
        f"{sys.executable} -m convoy data synth-telematics {fleet} --devices {devices} "
        "--hours 1 >/dev/null"
    )
    image_overrides = [
        "model.name=vit_tiny",
        *data_overrides(tree),
        "data.num_workers=1",  # the torch loader's DataLoader: one process per train worker
    ]
    return {
        "images": (str(REPO / "recipes" / "default.yaml"), image_overrides),
        "telematics": (str(REPO / "recipes" / "telematics_stream.yaml"), [f"data.path={fleet}"]),
    }


def train(
    head: Host, nodes: RayNodes, recipe: str, overrides: list[str], storage: Path, name: str
) -> dict:  # type: ignore[type-arg]
    args = [
        *overrides,
        f"run.storage_dir={storage}",
        "run.shared_storage=true",
        f"run.name={name}",
        "run.progress=off",
        "checkpoint.every_epochs=null",
    ]
    done = head.run(
        [*CONVOY, recipe, *(f"-o{a}" for a in args)], env=nodes.driver_env(), timeout=900
    )
    if done.returncode:
        raise SystemExit(f"{name}: exit {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}")
    return dict(json.loads((storage / name / "summary.json").read_text()))


PLACEMENTS = {
    "torch, one node": ["data.loader=torch", "scaling.cpus_per_worker=1"],
    "ray_data, one node": [
        "data.loader=ray_data",
        "data.num_workers=0",
        "scaling.cpus_per_worker=0.5",
    ],
    "ray_data, data node": [
        "data.loader=ray_data",
        "data.num_workers=0",
        "scaling.cpus_per_worker=0.5",
        "scaling.resources_per_worker={trainer: 1}",
        "data.ray_data.resources={preprocess: 1}",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--devices", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--placements", default=";".join(PLACEMENTS), help="';'-separated")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("-o", dest="more", action="append", default=[],
                        help="another override for every run, e.g. data.ray_data.prefetch_batches=8")  # fmt: skip
    args = parser.parse_args()
    reason = cannot_make_hosts()
    if reason:
        raise SystemExit(f"no test hosts here: {reason}")
    results: dict[tuple[str, str], dict] = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="convoy-datanodes-") as tmp, TestHosts(2) as hosts:
        folder = Path(tmp)
        loads = workloads(folder, args.images, args.devices)
        for placement, extra in PLACEMENTS.items():
            if placement not in args.placements.split(";"):
                continue
            one_node = placement != "ray_data, data node"
            train_nodes = RayNodes(ray_bin=pinned_ray(folder, "0,1" if one_node else "0"))
            data_nodes = RayNodes(ray_bin=pinned_ray(folder, "1"))
            try:
                if one_node:
                    train_nodes.start_head(hosts[0], num_cpus=2)
                    driver, cluster = hosts[0], train_nodes
                else:
                    # The head (GCS, dashboard, the driver, Ray Data's executor) is the CPU
                    # node, as in a cluster of a CPU head and GPU workers: the training node
                    # runs its raylet and the train workers only.
                    data_nodes.start_head(
                        hosts[1], num_cpus=1, extra_args=['--resources={"preprocess": 4}']
                    )
                    train_nodes.start_worker(
                        hosts[0],
                        data_nodes.head.address,
                        num_cpus=1,
                        token=data_nodes.head.token,
                        extra_args=['--resources={"trainer": 2}'],
                    )
                    driver, cluster = hosts[1], data_nodes
                for workload, (recipe, overrides) in loads.items():
                    name = f"{workload}-{placement.replace(', ', '-').replace(' ', '-')}"
                    results[workload, placement] = train(
                        driver,
                        cluster,
                        recipe,
                        [*overrides, *extra, *args.more, f"run.epochs={args.epochs}"],
                        folder / "runs",
                        name,
                    )
                    print(name, "done", flush=True)
            finally:
                train_nodes.stop()
                data_nodes.stop()
    header = (
        f"{platform.node()} ({os.cpu_count()} CPUs), {platform.python_version()}; two test "
        f"hosts on one machine; images: {args.images} generated 64x64 images, vit_tiny; "
        f"telematics: {args.devices} devices x 1 h, conv1d; ddp x 2, {args.epochs} epochs each"
    )
    lines = [
        "| workload | placement | samples/s | vs torch one node | data wait | first batch | "
        "data wait after it | test acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (workload, placement), summary in results.items():
        base = results.get((workload, "torch, one node"), summary)["samples_per_second"]
        lines.append(
            f"| {workload} | {placement} | {summary['samples_per_second']:,.0f} | "
            f"{summary['samples_per_second'] / base:.2f} | "
            f"{100 * summary['data_wait_fraction']:.1f}% | {summary['first_batch_seconds']:.1f} s | "
            f"{100 * summary['data_wait_fraction_after_first']:.1f}% | "
            f"{summary['metrics']['test/acc']:.3f} |"
        )
    publish(args.out, "data_nodes", "Preprocessing on a CPU-only node", header, "\n".join(lines))


if __name__ == "__main__":
    main()
