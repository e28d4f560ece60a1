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

Method: three commands, each in a cpuacct group of its own and sampled per process as in
``benchmarks/launch_cost.py`` (whose helpers this uses), in turns that rotate every
repetition:

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
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from dated import compile_sources, publish  # this folder's helpers
from launch_cost import CPUACCT, PROBE, describe, median, run_once, sample, wait_for_empty

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


def floor_once(tmp: Path, name: str) -> dict:
    """``bare_run`` in a process of its own, in a cpuacct group, sampled until its last
    process (``launch_cost.run_once``'s method, for a command that is not ``convoy train``)."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, __file__, "--bare", str(tmp / "runs" / name)]
    group = CPUACCT / f"convoy-ray-floor-{os.getpid()}"
    group.mkdir()
    seen: dict[int, tuple[str, float]] = {}
    try:
        with (tmp / f"{name}.log").open("w") as out:
            clock = time.monotonic()
            process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
            )  # fmt: skip
            while sample(group, seen) and process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.2)
            process.wait()
            wall = time.monotonic() - clock
        left = wait_for_empty(group, seen)
        total = int((group / "cpuacct.usage").read_text()) / 1e9
    finally:
        group.rmdir()
    if process.returncode != 0:
        log = (tmp / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"the bare run failed:\n{log}")
    processes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for label, cpu in seen.values():
        processes[label][0] += 1
        processes[label][1] += cpu
    return {
        "wall": wall,
        "cpu": total,
        "processes": {k: tuple(v) for k, v in processes.items()},
        "between": total - sum(cpu for _, cpu in seen.values()),
        "left": left,
    }


def table(runs: dict[str, list[dict]]) -> str:
    """Totals, ratios to ``before``, and CPU-s by process for each of the three."""
    labels = list(runs)
    lines = [
        "| command | wall (s) | total CPU-s | CPU-s of each run | of before's |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        ratios = [r["cpu"] / b["cpu"] for r, b in zip(runs[label], runs["before"], strict=True)]
        lines.append(
            f"| {label} | {median([r['wall'] for r in runs[label]]):.1f} "
            f"| {median([r['cpu'] for r in runs[label]]):.1f} "
            f"| {', '.join(format(r['cpu'], '.1f') for r in runs[label])} "
            f"| **{median(ratios):.2f}** |"
        )
    names = {name for results in runs.values() for r in results for name in r["processes"]}

    def cell(label: str, name: str) -> tuple[float, str]:
        counts = [r["processes"].get(name, (0, 0.0)) for r in runs[label]]
        cpu, most = median([c[1] for c in counts]), max(c[0] for c in counts)
        return cpu, f"{cpu:.1f}" + (f" ({most})" if most > 1 else "")

    lines += ["", "| process | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    rows = sorted(names, key=lambda name: -max(cell(label, name)[0] for label in labels))
    lines += [f"| {n} | " + " | ".join(cell(label, n)[1] for label in labels) + " |" for n in rows]
    for title, key in (("between samples", "between"), ("**total (cpuacct)**", "cpu")):
        cells = [f"{median([r[key] for r in runs[label]]):.1f}" for label in labels]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    left = {name for results in runs.values() for r in results for name in r["left"]}
    if left:
        lines.append(f"\nleft running 30 s after the command, then killed: {sorted(left)}")
    return "\n".join(lines)


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
    with tempfile.TemporaryDirectory(prefix="rf", dir="/tmp") as folder:
        tmp = Path(folder)
        (tmp / "probe").mkdir()
        (tmp / "probe" / "sitecustomize.py").write_text(PROBE)
        for index in range(args.repeats):
            order = list(runs)[index % 3 :] + list(runs)[: index % 3]
            for label in order:
                name = f"{label}-{index}"
                if label == "floor":
                    run = floor_once(tmp, name)
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
