"""``convoy bench scaling``: one recipe at several world sizes, weak or strong.

Each size N trains the recipe's model for ``warmup + steps`` steps through its launcher
(``convoy.bench.runs``). Throughput X is the global count (samples, or tokens for language
modeling) per second over the timed steps, and the efficiency is ``E = X_N / (N x X_1)``,
which is right for both modes: weak scaling keeps the per-worker batch (the global batch grows
with N), strong scaling keeps the global batch (each worker gets 1/N of it). Computing E from
step times instead would give ~1/N under weak scaling. Without a size 1, the smallest size
N0 is the baseline: ``E = (X_N / N) / (X_N0 / N0)``.

Every job is built (and so validated) before anything launches, and the sizes run largest
first, so a world size the cluster cannot place is refused by the launcher's own resource
check before any other size has run.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from convoy.bench import plots
from convoy.bench.common import (
    bench_name,
    bench_storage,
    check_at_least,
    markdown_table,
    parse_int_list,
)
from convoy.bench.runs import (
    bench_job,
    device_label,
    engine_overrides,
    launch_and_measure,
    pinned_threads,
)
from convoy.config import Job, load_job, split_batch
from convoy.errors import ConfigError


@dataclass(frozen=True)
class ScalingPlan:
    """The jobs to run, one per world size, all checked."""

    mode: str
    per_worker_batch: int | None
    """Weak mode's fixed batch per worker; None in strong mode."""
    jobs: dict[int, Job]
    warmup: int
    steps: int
    bench_dir: str


def global_batches(
    mode: str, workers: list[int], recipe_batch: int, per_worker: int
) -> dict[int, int]:
    """The global batch at each size: N x per-worker (weak) or the recipe's (strong)."""
    return {n: n * per_worker if mode == "weak" else recipe_batch for n in workers}


def check_strong_split(workers: list[int], batch: int, accum: int, text: str) -> None:
    """Strong scaling splits one global batch over N workers: refuse every N that does not
    divide it, all in one error."""
    bad = [n for n in workers if split_batch(batch, n, accum) is None]
    if bad:
        raise ConfigError(
            "--workers",
            text,
            f"strong scaling splits the global batch (data.batch_size {batch}"
            + (f", x {accum} accumulation steps" if accum > 1 else "")
            + f") evenly over N workers; {', '.join(map(str, bad))} do(es) not divide it: use "
            "divisors, or --mode weak",
        )


SUPERLINEAR = 1.1
"""Efficiency above this is flagged: a worker at N outran the baseline's."""


def efficiencies(throughputs: dict[int, float]) -> dict[int, float]:
    """E_N = (X_N / N) / (X_N0 / N0), N0 the smallest size (E = X_N / (N X_1) with N0 = 1)."""
    base = min(throughputs)
    per_worker = throughputs[base] / base
    return {n: (x / n) / per_worker if per_worker > 0 else 0.0 for n, x in throughputs.items()}


def make_plan(args: argparse.Namespace) -> ScalingPlan:
    """Build and validate every size's job from the command line, before any launch."""
    workers = sorted(parse_int_list(args.workers, "--workers"))
    check_at_least(args.steps, "--steps", 1)
    check_at_least(args.warmup, "--warmup", 1)  # step 1 also counts FLOPs and builds caches
    base = load_job(args.recipe, args.override)
    accum = base.optim.grad_accum_steps
    if args.mode == "strong":
        if args.per_worker_batch is not None:
            raise ConfigError("--per-worker-batch", args.per_worker_batch, "only with --mode weak")
        check_strong_split(workers, base.data.batch_size, accum, args.workers)
        per_worker = None
    else:
        if args.per_worker_batch is not None:
            per_worker = check_at_least(args.per_worker_batch, "--per-worker-batch", 1)
        else:
            per_worker = base.data.batch_size // base.scaling.max_workers
        check_at_least(per_worker, "--per-worker-batch", accum)
        if per_worker % accum:
            raise ConfigError(
                "--per-worker-batch", per_worker, f"a multiple of optim.grad_accum_steps ({accum})"
            )
    batches = global_batches(args.mode, workers, base.data.batch_size, per_worker or 0)
    storage = bench_storage(base, args.out)
    bench_dir = bench_name(f"scaling-{args.mode}")
    jobs = {
        n: bench_job(
            args.recipe,
            args.override,
            [
                f"data.batch_size={batches[n]}",
                *pinned_threads(base, max(workers)),
                *engine_overrides(f"{storage}/{bench_dir}", f"n{n}", n, args.steps, args.warmup),
            ],
            ("--workers", args.workers),
        )
        for n in workers
    }
    return ScalingPlan(
        args.mode, per_worker, jobs, args.warmup, args.steps, f"{storage}/{bench_dir}"
    )


def run_scaling(plan: ScalingPlan) -> dict[str, Any]:
    """Run every size (largest first) and put the results together."""
    measured = {n: launch_and_measure(plan.jobs[n], plan.warmup) for n in sorted(plan.jobs)[::-1]}
    throughputs = {n: m.throughput for n, m in measured.items()}
    efficiency = efficiencies(throughputs)
    first = plan.jobs[min(plan.jobs)]
    backend, device = device_label(first, measured[min(measured)].summary)
    count_name = measured[min(measured)].count_name
    return {
        "benchmark": "scaling",
        "mode": plan.mode,
        "model": first.model.name,
        "data": first.data.name,
        "strategy": first.strategy.name,
        "launcher": first.scaling.launcher,
        "precision": first.precision,
        "threads_per_worker": first.scaling.threads_per_worker,
        "backend": backend,
        "device": device,
        "torch": torch.__version__,
        "count_name": count_name,
        "per_worker_batch": plan.per_worker_batch,
        "warmup_steps": plan.warmup,
        "timed_steps": plan.steps,
        "baseline_workers": min(measured),
        "bench_dir": plan.bench_dir,
        "timing": measured[min(measured)].timing,
        "sizes": [
            {
                **measured[n].row(),
                "per_worker_batch": measured[n].global_batch // n,
                "throughput": throughputs[n],
                "ideal_throughput": n * throughputs[min(measured)] / min(measured),
                "efficiency": efficiency[n],
            }
            for n in sorted(measured)
        ],
    }


def labels(result: dict[str, Any]) -> str:
    """One line with what a reader needs to compare two scaling reports."""
    threads = result.get("threads_per_worker")
    threads = f" ({threads} thread(s) per worker)" if threads else ""
    if result["mode"] == "weak":
        batch = f"per-worker batch {result['per_worker_batch']} (global = N x it)"
    else:
        batch = f"global batch {result['sizes'][0]['global_batch']} (per worker = it / N)"
    return (
        f"{result['mode']} scaling: {result['model']} on {result['data']}, {result['strategy']} "
        f"via {result['launcher']}, {result['precision']}, {batch}; {result['backend']} on "
        f"{result['device']}" + threads + f", torch {result['torch']}; {result['timed_steps']} "
        f"timed steps after {result['warmup_steps']} warm-up"
    )


def format_report(result: dict[str, Any]) -> str:
    """A markdown table: throughput, step time spread and efficiency per size."""
    unit = result["count_name"]
    rows = [
        [
            s["world_size"],
            s["per_worker_batch"],
            s["global_batch"],
            f"{s['throughput']:,.0f}",
            f"{s['ideal_throughput']:,.0f}",
            f"{1000 * s['step_seconds']['median']:.1f}",
            f"{1000 * s['step_seconds']['p10']:.1f} / {1000 * s['step_seconds']['p90']:.1f}",
            f"{100 * s['efficiency']:.1f}%",
        ]
        for s in result["sizes"]
    ]
    headers = [
        "N",
        "batch/worker",
        "global batch",
        f"{unit}/s",
        f"ideal {unit}/s",
        "step ms (median)",
        "step ms (p10 / p90)",
        "efficiency",
    ]
    base = result["baseline_workers"]
    above = [s["world_size"] for s in result["sizes"] if s["efficiency"] > SUPERLINEAR]
    warning = (
        [
            f"note: efficiency above {100 * SUPERLINEAR:.0f}% at N = "
            f"{', '.join(map(str, above))}: each worker ran faster than the baseline's. Usually "
            "the baseline was slowed (other load on the machine, or more torch threads per "
            "worker than free cores: hold them fixed with -o scaling.threads_per_worker=K), "
            "sometimes a smaller per-worker batch fits a cache."
        ]
        if above
        else []
    )
    formula = "E = X_N / (N x X_1)" if base == 1 else f"E = (X_N / N) / (X_{base} / {base})"
    return "\n".join(
        [
            labels(result),
            "",
            markdown_table(headers, rows),
            "",
            f"X = global {unit}/s over the timed steps; {formula}; ideal = N x X_1 per worker "
            f"of the baseline; step time: {result['timing']}.",
            f"runs: {result['bench_dir']}",
            *warning,
        ]
    )


def plot(result: dict[str, Any], path: str) -> str:
    """Left: throughput against N with the ideal line; right: efficiency with 100%."""
    plt = plots.pyplot()
    sizes = result["sizes"]
    ns = [s["world_size"] for s in sizes]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(ns, [s["ideal_throughput"] for s in sizes], "k--", label="ideal (N x X_1)")
    left.plot(ns, [s["throughput"] for s in sizes], "o-", label="measured")
    left.set_ylabel(f"global {result['count_name']}/s")
    left.legend()
    right.axhline(100, color="k", linestyle="--", label="100%")
    right.plot(ns, [100 * s["efficiency"] for s in sizes], "o-", label="efficiency")
    right.set_ylabel("efficiency E (%)")
    right.set_ylim(0, max(110, *(100 * s["efficiency"] + 10 for s in sizes)))
    right.legend()
    for axis in (left, right):
        plots.log2_x(axis, ns)
        axis.set_xlabel("workers N (log2)")
    figure.suptitle(labels(result), fontsize=8)
    return plots.save(figure, path)
