"""Launcher overhead: the same job under torchrun and Ray Train, measured side by side.

Question: what does running through Ray Train cost compared with vanilla torchrun, at start-up
and in steady state? Each repetition runs, in an interleaved order:

- ``torchrun``: ``python -m torch.distributed.run`` spawning 2 gloo workers;
- ``ray (cold)``: the embedded local Ray that ``make run`` uses, started and stopped by the
  launcher inside the measurement;
- ``ray (warm)``: a Ray that is already running (a cluster reached through ``RAY_ADDRESS``, or
  a second job on the same embedded Ray), started as the embedded one is (with the dashboard,
  which ``ray[default]`` brings): only Ray Train's own start-up is measured;
- ``ray (warm, no dashboard)``: the same on a Ray started without the dashboard, as Convoy's
  embedded Ray was before it depended on ``ray[default]``: what the dashboard costs a run,
  and (in ``ray.init`` time) what it costs at start-up.

Time to first step = from the launch call to the end of the first optimizer step on rank 0;
steady-state step = median step time after 3 warm-up steps; total = launch call to return.

    python benchmarks/launcher_overhead.py [--repeats 3] [--epochs 5] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

import convoy
from convoy.config import load_job

REPO = Path(__file__).resolve().parents[1]
MODES = ("torchrun", "ray (cold)", "ray (warm)", "ray (warm, no dashboard)")
HEALTH_CHECK = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def job_for(mode: str, storage: Path, epochs: int, index: int) -> convoy.Job:
    launcher = "torchrun" if mode == "torchrun" else "ray"
    return load_job(
        REPO / "recipes" / "default.yaml",
        [
            f"scaling.launcher={launcher}",
            f"run.epochs={epochs}",
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={re.sub(r'[^a-z0-9]+', '-', mode).strip('-')}-{index}",
        ],
    )


def measure(mode: str, storage: Path, epochs: int, index: int) -> dict[str, float]:
    import ray

    from convoy.launchers.ray import EMBEDDED_RAY_ENV

    job = job_for(mode, storage, epochs, index)
    warm = mode.startswith("ray (warm")
    # Each mode starts its own Ray, whose processes inherit the polling interval set here.
    os.environ[HEALTH_CHECK] = EMBEDDED_RAY_ENV[HEALTH_CHECK]
    init_seconds = 0.0
    if warm:
        start = time.time()
        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard="no dashboard" not in mode,
            dashboard_host="127.0.0.1",
            logging_config=ray.LoggingConfig(log_level="ERROR"),
        )
        init_seconds = time.time() - start
    try:
        start = time.time()
        result = convoy.train(job)
        end = time.time()
    finally:
        if warm:
            ray.shutdown()
    summary = result.summary
    return {
        "first_step": summary["first_step_end_time"] - start,
        "step_ms": 1000 * summary["step_seconds_median"],
        "after_train": end - summary["end_time"],
        "total": end - start,
        "ray_init": init_seconds,
        "test_acc": summary["metrics"]["test/acc"],
    }


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(results: dict[str, list[dict[str, float]]]) -> str:
    base = results["torchrun"]

    def ratio(runs: list[dict[str, float]], key: str) -> str:
        return f"{median_of(runs, key) / median_of(base, key):.3f}"

    rows = []
    for mode, runs in results.items():
        cells = [
            f"{median_of(runs, 'first_step'):.2f}",
            f"{median_of(runs, 'step_ms'):.2f}",
            f"{median_of(runs, 'after_train'):.2f}",
            f"{median_of(runs, 'total'):.2f}",
            ratio(runs, "first_step"),
            ratio(runs, "step_ms"),
            ratio(runs, "total"),
            f"{median_of(runs, 'test_acc') * 100:.2f}%",
        ]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    header = (
        "| launcher | first step (s) | steady step (ms) | after training (s) | total (s) "
        "| first step / torchrun | step / torchrun | total / torchrun | test acc |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="convoy-bench-") as tmp:
        for index in range(args.repeats):
            order = MODES if index % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                results[mode].append(measure(mode, Path(tmp), args.epochs, index))
                print(f"[{index}] {mode}: {results[mode][-1]}", file=sys.stderr)
    table = render(results)
    warm_init = median_of(results["ray (warm)"], "ray_init")
    bare_init = median_of(results["ray (warm, no dashboard)"], "ray_init")
    cpu = platform.processor() or platform.machine()
    text = f"""# Launcher overhead: torchrun vs Ray Train (CPU), {date.today().isoformat()}

Produced by `python benchmarks/launcher_overhead.py --repeats {args.repeats} --epochs {args.epochs}`.

- Machine: {os.cpu_count()} CPU cores ({cpu}), no GPU; Python {platform.python_version()},
  torch {torch.__version__}, Ray {__import__("ray").__version__}.
- Job: `recipes/default.yaml` (ViT, hidden 96, 4 blocks, on digits), `ddp` over 2 gloo
  workers, global batch 32, {args.epochs} epochs; the same config for every launcher, only
  `scaling.launcher` differs. Medians of {args.repeats} interleaved repetitions.

{table}

Columns: *first step* = launch call to the end of rank 0's first optimizer step; *steady
step* = median step time after 3 warm-up steps; *after training* = rank 0's summary written to
the launch call returning (worker teardown, Ray Train's completion polling). Before the launch
clock started, `ray.init` took {warm_init:.2f} s with the dashboard and {bare_init:.2f} s without
it (medians): the start-up cost of `ray[default]`'s dashboard, which *ray (cold)* pays inside
its time.
"""
    out = args.out / f"launcher_overhead_cpu_{date.today().isoformat()}.md"
    out.write_text(text)
    print(table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
