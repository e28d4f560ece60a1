"""``convoy bench allreduce``: in-place all-reduce bandwidth, as nccl-tests reports it.

For each size from ``min_bytes`` to ``max_bytes`` (times ``factor``), every rank runs warm-up
iterations at that size, meets at a barrier, then times ``iters`` back-to-back in-place
``dist.all_reduce`` calls (on GPU: synchronized before and after, so the time covers the
queued kernels). The time per op is averaged over ranks, as nccl-tests' default ``-a 1``.

- ``algbw = size / time``; ``busbw = algbw x 2(n-1)/n``, the all-reduce factor, which makes
  the figure comparable with a link's one-direction bandwidth whatever the algorithm;
- GB/s are 1e9 B/s; sizes are bytes (``count x element size``);
- torch's ``all_reduce`` reduces in place, so only nccl-tests' in-place columns exist here;
- one rank moves nothing over a link: its bus-bandwidth factor is 0, shown as ``n/a``.

The worker runs through any launcher (``WorkerEntry("convoy.bench.allreduce:worker", ...)``);
gloo on CPU, NCCL on GPU (``scaling.use_gpu``).
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from convoy.bench import plots
from convoy.bench.common import check_at_least, format_bytes, parse_size
from convoy.config import Job
from convoy.distributed import WorkerContext, all_gather_objects, process_group, worker_threads
from convoy.errors import ConfigError, one_of
from convoy.launchers import get_launcher
from convoy.launchers.base import WorkerEntry
from convoy.outputs import RunOutputs
from convoy.storage import RunStorage

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
ENTRY = "convoy.bench.allreduce:worker"


@dataclass(frozen=True)
class Sweep:
    """What to measure: the sizes, iterations and element type (checked in the driver)."""

    sizes: list[int]
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """``min, min*factor, ...`` up to ``max`` (inclusive), as nccl-tests' ``-b -e -f``."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def make_sweep(
    min_bytes: str, max_bytes: str, factor: str, iters: int, warmup: int, dtype: str
) -> Sweep:
    """Parse and check the command line's sweep; every error names its flag."""
    low, high = parse_size(min_bytes, "--min-bytes"), parse_size(max_bytes, "--max-bytes")
    try:
        step = int(factor)
    except ValueError:
        step = 0
    if step < 2:
        raise ConfigError("--factor", factor, "expected an integer >= 2 (each size times it)")
    if dtype not in DTYPES:
        raise ConfigError("--dtype", dtype, one_of(DTYPES))
    item = DTYPES[dtype].itemsize
    if low < item:
        raise ConfigError("--min-bytes", min_bytes, f"at least one {dtype} element ({item} B)")
    if high < low:
        raise ConfigError(
            "--max-bytes", max_bytes, f"at least --min-bytes ({format_bytes(low)}, {low} B)"
        )
    check_at_least(iters, "--iters", 1)
    check_at_least(warmup, "--warmup", 0)
    return Sweep(size_sweep(low, high, step), iters, warmup, dtype)


def busbw_factor(world_size: int) -> float:
    """All-reduce's bus-bandwidth factor 2(n-1)/n (0 for one rank: nothing crosses a link)."""
    return 2 * (world_size - 1) / world_size


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 B/s): bytes per op over the time of one op."""
    return size_bytes / seconds / 1e9


@dataclass(frozen=True)
class Row:
    """One size of the sweep: nccl-tests' in-place columns."""

    size_bytes: int
    count: int
    type: str
    redop: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float | None
    """None for one rank (factor 0)."""
    wrong: int
    """Elements that differ from the expected sum in one checked all-reduce."""


def worker(job: Job, ctx: WorkerContext, **kwargs: Any) -> dict[str, Any]:
    """Worker entry: join the process group, sweep the sizes; rank 0 writes the summary."""
    sweep = Sweep(**kwargs)
    torch.set_num_threads(job.scaling.threads_per_worker or worker_threads(ctx))
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    with process_group(ctx, job.run.collective_timeout_s):
        rows = [asdict(_measure(size, sweep, ctx)) for size in sweep.sizes]
        hosts = sorted(set(all_gather_objects(socket.gethostname())))
        summary = _result(job, ctx, sweep, rows, len(hosts))
    RunOutputs(RunStorage.at(job.run_uri), ctx.is_main).write_summary(summary)
    return summary


def _measure(size: int, sweep: Sweep, ctx: WorkerContext) -> Row:
    dtype = DTYPES[sweep.dtype]
    count = size // dtype.itemsize
    n = dist.get_world_size()
    wrong = _check(count, dtype, ctx.device)
    # Zeros stay zeros under repeated in-place sums: no overflow in fp16 or int types.
    buffer = torch.zeros(count, dtype=dtype, device=ctx.device)
    for _ in range(sweep.warmup):
        dist.all_reduce(buffer)
    _synchronize(ctx.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(sweep.iters):
        dist.all_reduce(buffer)
    _synchronize(ctx.device)
    seconds = (time.perf_counter() - start) / sweep.iters
    mean = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(mean)
    seconds = float(mean.item()) / n
    nbytes = count * dtype.itemsize
    algbw = algbw_gbps(nbytes, seconds)
    busbw = algbw * busbw_factor(n) if n > 1 else None
    return Row(nbytes, count, sweep.dtype, "sum", seconds * 1e6, algbw, busbw, wrong)


def _check(count: int, dtype: torch.dtype, device: torch.device) -> int:
    """Reduce (rank + 1) once; count the elements that differ from n(n+1)/2 on any rank."""
    n, rank = dist.get_world_size(), dist.get_rank()
    buffer = torch.full((count,), rank + 1, dtype=dtype, device=device)
    dist.all_reduce(buffer)
    wrong = (buffer != n * (n + 1) // 2).sum().to(torch.int64).reshape(1)
    dist.all_reduce(wrong, op=dist.ReduceOp.MAX)
    return int(wrong.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _result(
    job: Job, ctx: WorkerContext, sweep: Sweep, rows: list[dict[str, Any]], hosts: int
) -> dict[str, Any]:
    n = ctx.world_size
    busbws = [r["busbw_gbps"] for r in rows if r["busbw_gbps"] is not None]
    return {
        "benchmark": "allreduce",
        "op": "all_reduce",
        "redop": "sum",
        "in_place": True,
        "world_size": n,
        "hosts": hosts,
        "launcher": job.scaling.launcher,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "dtype": sweep.dtype,
        "iters": sweep.iters,
        "warmup": sweep.warmup,
        "busbw_factor": busbw_factor(n),
        "torch": torch.__version__,
        "rows": rows,
        "avg_busbw_gbps": statistics.fmean(busbws) if busbws else None,
        "wrong": sum(r["wrong"] for r in rows),
    }


def run_allreduce(job: Job, sweep: Sweep) -> dict[str, Any]:
    """Launch the sweep on ``job``'s launcher and workers; returns rank 0's summary."""
    entry = WorkerEntry(ENTRY, asdict(sweep), preflight=False)
    return get_launcher(job.scaling.launcher).launch(job, entry).summary


def format_table(result: dict[str, Any]) -> str:
    """nccl-tests-shaped text: a header stating the formulas, one row per size, the footer."""
    n = result["world_size"]
    hosts = result.get("hosts", 1)
    lines = [
        f"# convoy bench allreduce: {n} rank(s) on {hosts} host(s) via {result['launcher']}, "
        f"{result['backend']} on {result['device']}, torch {result['torch']}",
        "# in-place only: torch.distributed.all_reduce reduces in place (nccl-tests' "
        "out-of-place columns have no torch counterpart)",
        f"# {result['iters']} timed iterations after {result['warmup']} warm-up at each size; "
        "time = mean us per op, averaged over ranks",
        f"# algbw = size / time; busbw = algbw x 2(n-1)/n = algbw x {result['busbw_factor']:.3f} "
        f"(n = {n}); GB/s = 1e9 B/s",
    ]
    if n == 1:
        lines.append(
            "# one rank: the bus-bandwidth factor 2(n-1)/n is 0 (no data crosses a link), so "
            "busbw is n/a; algbw is a local copy's rate"
        )
    lines += [
        "#",
        f"#{'size':>11} {'count':>13} {'type':>9} {'redop':>7} {'time':>10} {'algbw':>8} "
        f"{'busbw':>8} {'#wrong':>7}",
        f"#{'(B)':>11} {'(elements)':>13} {'':>9} {'':>7} {'(us)':>10} {'(GB/s)':>8} "
        f"{'(GB/s)':>8} {'':>7}",
    ]
    for r in result["rows"]:
        busbw = f"{r['busbw_gbps']:8.3f}" if r["busbw_gbps"] is not None else f"{'n/a':>8}"
        lines.append(
            f"{r['size_bytes']:>12} {r['count']:>13} {r['type']:>9} {r['redop']:>7} "
            f"{r['time_us']:>10.1f} {r['algbw_gbps']:>8.3f} {busbw} {r['wrong']:>7}"
        )
    wrong = result["wrong"]
    lines.append(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    average = result["avg_busbw_gbps"]
    shown = f"{average:.3f} GB/s" if average is not None else "n/a (one rank)"
    lines.append(f"# Avg bus bandwidth    : {shown} (mean over {len(result['rows'])} sizes)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> str:
    """busbw and algbw against size (log2 x axis) as a PNG."""
    plt = plots.pyplot()
    rows = result["rows"]
    sizes = [r["size_bytes"] for r in rows]
    figure, axis = plt.subplots(figsize=(8, 4.5))
    if result["world_size"] > 1:
        axis.plot(sizes, [r["busbw_gbps"] for r in rows], "o-", label="busbw")
    axis.plot(sizes, [r["algbw_gbps"] for r in rows], "s--", label="algbw", alpha=0.7)
    step = -(-len(sizes) // 8)  # at most 8 labels
    ticks = sizes[::step]
    plots.log2_x(axis, ticks, [format_bytes(s).replace(" ", "") for s in ticks])
    axis.set_xlabel("size (bytes, log2)")
    axis.set_ylabel("GB/s (1e9 B/s)")
    axis.set_title(
        f"all_reduce (in place, sum, {result['dtype']}): {result['world_size']} ranks, "
        f"{result.get('hosts', 1)} host(s), {result['backend']} on {result['device']}, "
        f"torch {result['torch']}",
        fontsize=9,
    )
    axis.legend()
    return plots.save(figure, path)
