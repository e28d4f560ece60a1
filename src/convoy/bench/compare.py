"""``convoy bench compare``: the strategies (and ``+ac`` / ``+compile`` layouts of them) like
for like on one recipe.

Like for like means: the same seed (so the same initial weights), the same global batch
(``single`` trains it on one worker, the others split it over N), the same wrap units (the
sharded strategies share one unit rule) and the optimizer created after sharding (the engine
does both). Each strategy is an ordinary engine run (``convoy.bench.runs``); the report has

- step time (median, p90 over the timed steps) and global samples/s;
- peak memory per rank, labelled with where it comes from: on GPU the allocator's peak
  (``torch.cuda.max_memory_allocated``, the engine's summary); on CPU the peak that torch's
  MemTracker / FSDPMemTracker count for the strategy (``convoy.plan.check.tracked_peak``,
  the training step under the tracker its class names), never the process's resident set,
  which holds the whole runtime;
- communication per step per rank, to explain gaps (``Strategy.comm_volume``): DDP's
  all-reduce moves 2 psi (n-1)/n bytes, full-shard FSDP (all-gather forward, all-gather
  backward, reduce-scatter) 3 psi (n-1)/n, FSDP that keeps parameters gathered after forward
  2 psi (n-1)/n, psi = parameter bytes; ``single`` moves nothing. With LoRA adapters
  (``model.lora``, applied as the engine applies them) the report says how many parameters
  train, DDP's all-reduce moves the trainable bytes only, and FSDP's figure (every
  parameter gathered, psi the whole model's) is an upper bound: its reduce-scatter carries
  the trainable gradients only;
- whether the first steps' losses agree with the reference strategy's (the first listed)
  within a stated relative tolerance: the same model, data and global batch must give the
  same loss whatever the strategy.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from convoy.bench import plots
from convoy.bench.common import (
    bench_name,
    bench_storage,
    check_at_least,
    format_bytes,
    markdown_table,
)
from convoy.bench.runs import (
    Measured,
    bench_job,
    device_label,
    engine_overrides,
    launch_and_measure,
    pinned_threads,
)
from convoy.config import STRATEGY_NAMES, Job, load_job
from convoy.data.registry import load_splits
from convoy.errors import ConfigError, one_of
from convoy.models.registry import build_model
from convoy.plan.check import tracked_peak
from convoy.plan.job import takes_tensor_parallel
from convoy.plan.model import with_adapters
from convoy.strategies import strategy_class

LOSS_RTOL = 1e-4
"""Relative tolerance of the loss check: fp32 sums in another order differ by ~1e-7."""
LOSS_STEPS = 5
"""How many first steps' losses are compared."""


@dataclass(frozen=True)
class ComparePlan:
    jobs: dict[str, Job]
    """One job per strategy, in the order given (the first is the loss reference)."""
    workers: int
    warmup: int
    steps: int
    loss_rtol: float
    bench_dir: str


LAYOUT_OPTIONS = {
    "ac": "strategy.activation_checkpointing=full",
    "compile": "run.compile=true",
}
"""What a ``+option`` after a strategy's name in ``--strategies`` adds to its run; and
``+tpN``, tensor parallelism over N ranks (``strategy.tp_size=N``)."""
TENSOR_PARALLEL = re.compile(r"tp([1-9]\d*)")


def tensor_parallel_size(options: list[str]) -> int:
    """N of a ``+tpN`` among a layout's options; 1 without one."""
    sizes = [int(m.group(1)) for o in options if (m := TENSOR_PARALLEL.fullmatch(o))]
    return sizes[0] if sizes else 1


def layout_override(option: str) -> str | None:
    """The override a ``+option`` adds (None: not an option)."""
    match = TENSOR_PARALLEL.fullmatch(option)
    return f"strategy.tp_size={match.group(1)}" if match else LAYOUT_OPTIONS.get(option)


def parse_strategies(text: str) -> list[str]:
    """``"single,ddp,fsdp2+ac+compile"`` -> the layouts, each a strategy's name with
    ``+ac`` (activation checkpointing, every block) and / or ``+compile`` (``torch.compile``
    per block); unknown or repeated ones are refused, the error naming the bad one (and the
    closest known name)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    allowed = (
        f"distinct layouts, comma-separated: {one_of(STRATEGY_NAMES)}, each with optional "
        f"{' / '.join('+' + o for o in LAYOUT_OPTIONS)} / +tpN (fsdp2, hsdp)"
    )
    for name in names:
        strategy, *options = name.split("+")
        if strategy not in STRATEGY_NAMES:
            guess = difflib.get_close_matches(strategy, STRATEGY_NAMES, n=1, cutoff=0.5)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            raise ConfigError("--strategies", text, f"unknown {strategy!r}{hint}; {allowed}")
        unknown = [o for o in options if layout_override(o) is None]
        split = [o for o in options if TENSOR_PARALLEL.fullmatch(o)]
        if split and not takes_tensor_parallel(strategy):
            unknown += split
        if unknown or len(set(options)) < len(options) or len(split) > 1:
            raise ConfigError("--strategies", text, f"bad option in {name!r}; {allowed}")
    repeated = sorted({s for s in names if names.count(s) > 1})
    if repeated:
        raise ConfigError("--strategies", text, f"{', '.join(repeated)} repeated; {allowed}")
    if not names:
        raise ConfigError("--strategies", text, allowed)
    return names


def comm_factor(strategy: Any, world_size: int) -> float:
    """Bytes moved per step per rank, in units of the parameter bytes psi, for the strategy
    config ``strategy`` (its class's ``comm_volume``).

    DDP: one all-reduce of the gradients, 2 (n-1)/n. Full-shard FSDP: all-gather in forward
    and again in backward, reduce-scatter of gradients: 3 (n-1)/n. Parameters kept gathered
    after forward (FSDP's shard_grad_op, FSDP2's reshard_after_forward=False) skip the second
    all-gather: 2 (n-1)/n. No sharding (no_shard) is DDP's all-reduce.
    """
    return strategy_class(strategy.name).comm_volume(strategy, world_size)


@dataclass(frozen=True)
class ParameterSizes:
    """The model's parameters, all of them and those that train (LoRA: the adapters)."""

    count: int
    trainable_count: int
    bytes: int
    trainable_bytes: int


def parameter_sizes(job: Job) -> ParameterSizes | None:
    """The model's parameters as the engine trains it (built on the meta device, with its
    adapters under ``model.lora``); None if it cannot be built here (the data's shape
    decides some models' sizes). Tied weights count once."""
    try:
        shape = load_splits(job.data).shape
        with torch.device("meta"):
            model = with_adapters(job, build_model(job.model.name, job.model.kwargs, shape))
    except Exception:  # reported as n/a: the runs themselves say what is wrong with the data
        return None
    unique = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in unique if p.requires_grad]
    return ParameterSizes(
        count=sum(p.numel() for p in unique),
        trainable_count=sum(p.numel() for p in trainable),
        bytes=sum(p.numel() * p.element_size() for p in unique),
        trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
    )


def make_plan(args: argparse.Namespace) -> ComparePlan:
    """Build and validate every strategy's job before any launch."""
    strategies = parse_strategies(args.strategies)
    check_at_least(args.workers, "--workers", 1)
    check_at_least(args.steps, "--steps", 1)
    check_at_least(args.warmup, "--warmup", 1)
    rtol = float(getattr(args, "loss_rtol", LOSS_RTOL))
    if not (math.isfinite(rtol) and rtol >= 0):
        raise ConfigError("--loss-rtol", rtol, "expected a finite number >= 0")
    base = load_job(args.recipe, args.override)
    storage = bench_storage(base, args.out)
    bench_dir = f"{storage}/{bench_name('compare')}"
    jobs = {}
    for layout in strategies:
        name, *options = layout.split("+")
        limit = strategy_class(name, "--strategies").max_world_size()
        workers = args.workers if limit is None else min(args.workers, limit)
        extra = [
            strategy_override(name, base.strategy.name),
            *default_shard_size(name, base, workers // tensor_parallel_size(options)),
            *(str(layout_override(option)) for option in options),
            f"run.seed={base.run.seed}",
            *pinned_threads(base, max(args.workers, 1)),
            *engine_overrides(
                bench_dir, layout.replace("+", "-"), workers, args.steps, args.warmup
            ),
        ]
        jobs[layout] = bench_job(args.recipe, args.override, extra, ("--workers", args.workers))
    return ComparePlan(jobs, args.workers, args.warmup, args.steps, rtol, bench_dir)


def strategy_override(name: str, recipe_strategy: str) -> str:
    """The recipe's own strategy keeps its options; any other gets a fresh section, since
    one strategy's options (fsdp2's ``reshard_after_forward``) are unknown keys to another."""
    if name == recipe_strategy:
        return f"strategy.name={name}"
    return f"strategy={{name: {name}}}"


def default_shard_size(name: str, base: Job, workers: int) -> list[str]:
    """hsdp without the recipe's ``shard_size``: two replicas of ``workers // 2`` ranks
    (``workers``: the data-parallel ones; the bench runs its workers on one machine, where
    "the workers of one node" is all of them)."""
    if (
        name != base.strategy.name
        and "shard_size" in strategy_class(name).config_model.model_fields
    ):
        return [f"strategy.shard_size={max(1, workers // 2)}"]
    return []


def run_compare(plan: ComparePlan) -> dict[str, Any]:
    """Run every strategy (most workers first, so the launcher refuses an unplaceable size
    before anything runs) and put the results together."""
    order = sorted(plan.jobs, key=lambda s: -plan.jobs[s].scaling.max_workers)
    measured = {name: launch_and_measure(plan.jobs[name], plan.warmup) for name in order}
    reference = next(iter(plan.jobs))
    first = plan.jobs[reference]
    sizes = parameter_sizes(first)
    psi = None if sizes is None else sizes.bytes
    backend, device = device_label(first, measured[reference].summary)
    rows = [
        _row(name, plan.jobs[name], measured[name], measured[reference], sizes, plan.loss_rtol)
        for name in plan.jobs
    ]
    return {
        "benchmark": "compare",
        "model": first.model.name,
        "data": first.data.name,
        "launcher": first.scaling.launcher,
        "precision": first.precision,
        "global_batch": first.data.batch_size,
        "seed": first.run.seed,
        "workers": plan.workers,
        "backend": backend,
        "device": device,
        "torch": torch.__version__,
        "warmup_steps": plan.warmup,
        "timed_steps": plan.steps,
        "parameter_bytes": psi,
        **_parameters(first, sizes),
        "loss_reference": reference,
        "loss_rtol": plan.loss_rtol,
        "loss_steps": min(LOSS_STEPS, plan.warmup + plan.steps),
        "losses_agree": all(r["loss_agrees"] for r in rows),
        "timing": measured[reference].timing,
        "bench_dir": plan.bench_dir,
        "strategies": rows,
    }


def _parameters(job: Job, sizes: ParameterSizes | None) -> dict[str, Any]:
    """The report's parameter counts: all of them and those that train, with LoRA's
    adapters (``lora``: a line saying which, None without)."""
    lora = job.model.lora
    return {
        "parameters": None if sizes is None else sizes.count,
        "trainable_parameters": None if sizes is None else sizes.trainable_count,
        "trainable_parameter_bytes": None if sizes is None else sizes.trainable_bytes,
        "lora": None if lora is None else f"LoRA r={lora.r} on {', '.join(lora.target_modules)}",
    }


def gradient_psi(job: Job, sizes: ParameterSizes | None) -> int | None:
    """The psi a strategy's communication is counted in: the trainable bytes for DDP (its
    all-reduce carries gradients only, none for frozen parameters), every parameter's for
    FSDP (it gathers them all)."""
    if sizes is None:
        return None
    gradients_only = strategy_class(job.strategy.name).comm_buffers == "ddp_buckets"
    return sizes.trainable_bytes if gradients_only else sizes.bytes


def _row(
    name: str,
    job: Job,
    run: Measured,
    reference: Measured,
    sizes: ParameterSizes | None,
    rtol: float,
) -> dict[str, Any]:
    memory, source = peak_memory(job, run)
    factor = comm_factor(job.strategy, run.world_size)
    psi = gradient_psi(job, sizes)
    worst = loss_gap(run.losses, reference.losses)
    return {
        **run.row(),
        "strategy": name,
        "peak_memory_bytes_per_rank": memory,
        "peak_memory_source": source,
        "comm_factor": factor,
        "comm_bytes_per_step_per_rank": None if psi is None else factor * psi,
        "first_losses": run.losses[:LOSS_STEPS],
        "loss_max_relative_gap": worst,
        "loss_agrees": worst is not None and worst <= rtol,
        "compile_seconds": run.summary.get("compile_seconds"),
    }


def loss_gap(losses: list[float], reference: list[float]) -> float | None:
    """The largest relative difference over the first ``LOSS_STEPS`` steps; None if a run
    logged fewer steps."""
    steps = min(LOSS_STEPS, len(reference))
    if steps == 0 or len(losses) < steps:
        return None
    return max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference[:steps], strict=False)
    )


def peak_memory(job: Job, run: Measured) -> tuple[list[int] | None, str]:
    """Peak memory per rank and where it comes from (never the resident set on CPU)."""
    if job.scaling.use_gpu:
        reserved = run.summary.get("peak_memory_reserved_bytes_per_rank") or []
        shown = f"; reserved up to {format_bytes(max(reserved))}" if reserved else ""
        return list(run.summary["peak_memory_bytes_per_rank"]), (
            f"CUDA allocator peak allocated (torch.cuda.max_memory_allocated){shown}"
        )
    cls = strategy_class(job.strategy.name)
    if cls.memory_tracking is None:
        return None, f"n/a for {cls.name} on CPU: {cls.untracked_reason}"
    try:
        peak = tracked_peak(job, job.strategy.name, run.world_size)
    except Exception as exc:  # a tracker that cannot follow this model: say why, keep the rest
        return None, f"n/a on CPU: the memory tracker failed ({type(exc).__name__}: {exc})"
    tracker = cls.memory_tracking.tracker
    # The tracker follows one rank; every rank holds the same shapes.
    return [int(peak["Total"])] * run.world_size, f"torch {tracker} peak (convoy.plan.check)"


def format_report(result: dict[str, Any]) -> str:
    """A markdown table per strategy, the loss check, and the formulas behind the columns."""
    rows = [_cells(r) for r in result["strategies"]]
    headers = [
        "strategy",
        "workers",
        "step ms (median)",
        "step ms (p90)",
        "samples/s",
        "peak memory / rank",
        "comm / step / rank",
        f"loss steps 1-{result['loss_steps']}",
    ]
    compiled = any(r.get("compile_seconds") is not None for r in result["strategies"])
    if compiled:
        headers.append("compile s")
        for cells, row in zip(rows, result["strategies"], strict=True):
            seconds = row.get("compile_seconds")
            cells.append("-" if seconds is None else f"{seconds:.1f}")
    sources = sorted({r["peak_memory_source"] for r in result["strategies"]})
    psi = result["parameter_bytes"]
    agree = (
        f"the first {result['loss_steps']} losses agree with {result['loss_reference']}'s "
        f"within relative {result['loss_rtol']:g}"
        if result["losses_agree"]
        else f"LOSSES DISAGREE: a strategy's first {result['loss_steps']} losses differ from "
        f"{result['loss_reference']}'s by more than relative {result['loss_rtol']:g} (see the "
        "last column)"
    )
    return "\n".join(
        [
            f"compare: {result['model']} on {result['data']} via {result['launcher']}, "
            f"{result['precision']}, global batch {result['global_batch']}, seed "
            f"{result['seed']}; {result['backend']} on {result['device']}, torch "
            f"{result['torch']}; {result['timed_steps']} timed steps after "
            f"{result['warmup_steps']} warm-up",
            "",
            markdown_table(headers, rows),
            "",
            f"loss check: {agree}.",
            "peak memory: " + "; ".join(sources) + ".",
            "comm: bytes sent per step per rank, psi = parameter bytes"
            + (f" = {format_bytes(psi)}" if psi else " (n/a: the model could not be built here)")
            + ": ddp 2 psi (n-1)/n, fsdp/fsdp2 full shard 3 psi (n-1)/n (2 when parameters stay "
            "gathered after forward), hsdp fsdp2's inside a shard group of s plus "
            "2 psi/s (r-1)/r across its r replicas, single 0"
            + (
                "; +tpN: FSDP's over the n/N data-parallel ranks, of psi/N each (tensor "
                "parallelism's all-reduces carry activations, not parameters: not counted)."
                if any("+tp" in row["strategy"] for row in result["strategies"])
                else "."
            ),
            *_lora_lines(result),
            f"step time: {result['timing']}"
            + (" (without compiling: the compile s column)" if compiled else "")
            + f". runs: {result['bench_dir']}",
        ]
    )


def _lora_lines(result: dict[str, Any]) -> list[str]:
    """Under LoRA, what trains and what that changes in the comm column; nothing otherwise."""
    if not result.get("lora"):
        return []
    total, trainable = result.get("parameters"), result.get("trainable_parameters")
    counts = (
        f"{trainable:,} of {total:,} parameters train "
        f"({format_bytes(result['trainable_parameter_bytes'])})"
        if total and trainable is not None
        else "trainable parameters n/a"
    )
    return [
        f"{result['lora']}: {counts}; ddp's comm is of the trainable bytes (its all-reduce "
        "carries gradients only), FSDP's of every parameter's, an upper bound (its "
        "reduce-scatter carries the trainable gradients only)."
    ]


def _cells(row: dict[str, Any]) -> list[str]:
    times = row["step_seconds"]
    memory = row["peak_memory_bytes_per_rank"]
    comm = row["comm_bytes_per_step_per_rank"]
    gap = row["loss_max_relative_gap"]
    return [
        row["strategy"],
        str(row["world_size"]),
        f"{1000 * times['median']:.1f}",
        f"{1000 * times['p90']:.1f}",
        f"{row['samples_per_second']:,.0f}",
        f"{format_bytes(max(memory))} ({_short_source(row['peak_memory_source'])})"
        if memory
        else "n/a",
        f"{format_bytes(comm)} ({row['comm_factor']:.2f} psi)" if comm is not None else "n/a",
        ("agree" if row["loss_agrees"] else "DIFFER")
        + (f" (max rel. gap {gap:.1e})" if gap is not None else " (too few steps)"),
    ]


def _short_source(source: str) -> str:
    """The tracker or allocator a peak came from, in a word or two for the table."""
    for name in ("FSDPMemTracker", "MemTracker"):
        if name in source:
            return name
    return "CUDA allocated" if "CUDA" in source else source


def plot(result: dict[str, Any], path: str) -> str:
    """Bars per strategy: samples/s, step time (median with p90), peak memory per rank."""
    plt = plots.pyplot()
    rows = result["strategies"]
    names = [f"{r['strategy']} x{r['world_size']}" for r in rows]
    figure, (rate, step, memory) = plt.subplots(1, 3, figsize=(13, 4.2))
    rate.bar(names, [r["samples_per_second"] for r in rows])
    rate.set_ylabel("global samples/s")
    medians = [1000 * r["step_seconds"]["median"] for r in rows]
    p90 = [1000 * r["step_seconds"]["p90"] for r in rows]
    step.bar(names, medians, label="median")
    step.scatter(names, p90, color="k", marker="_", s=400, label="p90", zorder=3)
    step.set_ylabel("step time (ms)")
    step.legend()
    peaks = [max(r["peak_memory_bytes_per_rank"] or [0]) / 2**20 for r in rows]
    memory.bar(names, peaks)
    memory.set_ylabel("peak memory per rank (MiB)")
    memory.set_title("; ".join(sorted({r["peak_memory_source"] for r in rows})), fontsize=7)
    figure.suptitle(
        f"{result['model']} on {result['data']}, global batch {result['global_batch']}, "
        f"{result['backend']} on {result['device']}, torch {result['torch']}, "
        f"{result['timed_steps']} timed steps",
        fontsize=9,
    )
    return plots.save(figure, path)
