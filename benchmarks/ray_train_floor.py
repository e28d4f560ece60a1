"""Ray Train's floor: what a 2-worker Ray Train run costs when the workers do nothing, beside
``convoy train`` on ``ray`` in the issue's starting tree and in this one.

Question (issue 40): its target for a ``ray`` launch is half the CPU-seconds of the starting
tree's. How much of a launch can Convoy still cut at all? The floor is the part no launcher
built on Ray Train can leave out: a private Ray with every one of Convoy's trims (Convoy's own
``start_private_ray``: no autoscaler monitor, no API server, no metrics collection, no
prestarted workers), and a ``ConvoyTorchTrainer`` with the same trims (no placement-group
cleaner, no metrics callbacks) and the same gloo process group, whose workers run an empty
loop. Everything above the floor is Convoy's: its driver's checks and imports, its workers'
imports beyond Ray Train's and torch's, the training, the checkpoints.

Method: three commands, each in a cpuacct group of its own and sampled per process by
``benchmarks/launch_cost.py``'s helpers, in turns that rotate every repetition:

- ``before``: ``convoy train recipes/digits_mlp.yaml -o run.epochs=1 -o scaling.launcher=ray
  -o scaling.num_workers=2`` in the ``--before`` tree (the issue's start, 38dd6d1);
- ``after``: the same in this tree;
- ``floor``: this script with ``--bare``: the private Ray and the empty 2-worker run above,
  then ``ray.shutdown()``.

Figures are medians over the repetitions. Must be run as root (the cgroup).

    .venv/bin/python benchmarks/ray_train_floor.py [--repeats 3] [--before /tmp/start]
        [--out benchmarks]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dated import compile_sources, publish  # this folder's helpers
from launch_cost import (
    describe,
    measure_command,
    median,
    probed_folder,
    process_rows,
    run_once,
)

REPO = Path(__file__).resolve().parents[1]
WORKERS = 2


def empty_loop() -> None:
    """A train worker that does nothing: Ray Train has set up its gloo group before this."""


def bare_run(storage: Path) -> None:
    """The floor: Convoy's private Ray and an empty 2-worker ``ConvoyTorchTrainer``."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    from convoy.config import load_job
    from convoy.launchers.ray import worker_resources
    from convoy.launchers.ray_controller import ProcessGroupConfig
    from convoy.launchers.ray_local import start_private_ray
    from convoy.launchers.ray_torch import ConvoyTorchTrainer

    job = load_job(
        REPO / "recipes" / "digits_mlp.yaml",
        ["scaling.launcher=ray", f"scaling.num_workers={WORKERS}"],
    )
    start_private_ray(ray, job.scaling.ray)
    try:
        ConvoyTorchTrainer(
            private_ray=True,
            sole_run=True,
            train_loop_per_worker=empty_loop,
            torch_config=ProcessGroupConfig(backend="gloo"),
            scaling_config=ScalingConfig(
                num_workers=WORKERS, resources_per_worker=worker_resources(job)
            ),
            run_config=RunConfig(name="floor", storage_path=str(storage)),
        ).fit()
    finally:
        ray.shutdown()


def table(runs: dict[str, list[dict]]) -> str:
    """Totals and ratios to ``before``, then CPU-s by process, for each of the three."""
    lines = [
        "| command | wall (s) | total CPU-s | CPU-s of each run | of before's |",
        "|---|---|---|---|---|",
    ]
    for label, results in runs.items():
        ratios = [r["cpu"] / b["cpu"] for r, b in zip(results, runs["before"], strict=True)]
        lines.append(
            f"| {label} | {median([r['wall'] for r in results]):.1f} "
            f"| {median([r['cpu'] for r in results]):.1f} "
            f"| {', '.join(format(r['cpu'], '.1f') for r in results)} "
            f"| **{median(ratios):.2f}** |"
        )
    return "\n".join([*lines, "", *process_rows(runs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bare", type=Path, metavar="STORAGE", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, default=Path("/tmp/start"), help="a tree")
    parser.add_argument("--out", type=Path, help="write ray_train_floor_cpu_<date>.md here")
    args = parser.parse_args()
    if args.bare:
        bare_run(args.bare)
        return
    trees = {"before": args.before.resolve(), "after": REPO}
    for tree in trees.values():
        compile_sources(tree)
    runs: dict[str, list[dict]] = {"before": [], "after": [], "floor": []}
    load = os.getloadavg()[0]
    with probed_folder("rf") as tmp:
        for index in range(args.repeats):
            order = list(runs)[index % 3 :] + list(runs)[: index % 3]
            for label in order:
                name = f"{label}-{index}"
                if label == "floor":
                    bare = [sys.executable, __file__, "--bare", str(tmp / "runs" / name)]
                    run, _ = measure_command(bare, dict(os.environ), tmp, name)
                else:
                    run = run_once(trees[label], "ray", tmp, name)
                runs[label].append(run)
                print(f"{label} #{index}: {run['cpu']:.1f} CPU-s, {run['wall']:.1f} s", flush=True)
    header = (
        f"{describe(trees)}; floor = `--bare` with this tree's Convoy. {args.repeats} "
        f"repetitions, {os.cpu_count()} cores, load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end. Method: `benchmarks/ray_train_floor.py`'s "
        "docstring."
    )
    publish(
        args.out, "ray_train_floor", "Ray Train's floor beside a ray launch", header, table(runs)
    )


if __name__ == "__main__":
    main()
