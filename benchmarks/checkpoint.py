"""Checkpoint costs on CPU: save/load time by size, training blocked by sync vs async saves,
and the time from a worker kill to training resumed.

1. For models of three sizes (with AdamW state after one step), one process: the time of a
   synchronous save, of an asynchronous save's blocking part (staging) and until its commit,
   and of a load; plus the bytes on disk.
2. Kill to resume: a 2-worker ``ddp`` job whose rank 1 is SIGKILLed after step 30, under
   torchrun (``--max-restarts``) and under Ray Train (``FailureConfig``); the time from the
   last step before the kill to the first step of the restarted attempt, read from the run's
   metrics log.

    python benchmarks/checkpoint.py [--repeats 3] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

import convoy
from convoy.checkpoint import CheckpointManager, Position, checkpoint_root, committed_checkpoints
from convoy.config import load_job
from convoy.distributed import WorkerContext
from convoy.models.registry import build_model, count_parameters
from convoy.outputs import read_metrics
from convoy.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "mlp (digits)": ("mlp", {}, {"num_classes": 10, "in_channels": 1, "image_size": 8}),
    "vit_tiny (digits)": ("vit_tiny", {}, {"num_classes": 10, "in_channels": 1, "image_size": 8}),
    "vit_course (32x32)": (
        "vit_course",
        {},
        {"num_classes": 10, "in_channels": 3, "image_size": 32},
    ),
}


def model_with_optimizer_state(name: str, kwargs: dict, shape: dict) -> tuple:
    torch.manual_seed(0)
    model = build_model(name, kwargs, shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    size = shape["image_size"]
    images = torch.randn(8, shape["in_channels"], size, size)
    F.cross_entropy(model(images), torch.randint(0, 10, (8,))).backward()
    optimizer.step()
    return model, optimizer


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def time_saves(label: str, repeats: int, root: Path) -> dict[str, float]:
    name, kwargs, shape = MODELS[label]
    model, optimizer = model_with_optimizer_state(name, kwargs, shape)
    sync_s, async_block_s, async_total_s, load_s, size = [], [], [], [], 0
    for i in range(repeats):
        run_dir = root / f"{name}-{i}"
        manager = CheckpointManager(RunStorage.at(run_dir), WorkerContext(), keep_latest=4)
        start = time.perf_counter()
        saved = manager.save(Position(1, 0, 1), model, optimizer, {})
        sync_s.append(time.perf_counter() - start)
        size = directory_bytes(checkpoint_root(run_dir) / saved)
        start = time.perf_counter()
        manager.save(Position(2, 0, 2), model, optimizer, {}, asynchronous=True)
        async_block_s.append(time.perf_counter() - start)
        manager.wait()
        async_total_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.load_latest(model, optimizer)
        load_s.append(time.perf_counter() - start)
    return {
        "params": count_parameters(model),
        "bytes": size,
        "sync": statistics.median(sync_s),
        "async_block": statistics.median(async_block_s),
        "async_total": statistics.median(async_total_s),
        "load": statistics.median(load_s),
    }


def kill_to_resume(launcher: str, root: Path) -> float:
    extra = ["scaling.cpus_per_worker=0.5"] if launcher == "ray" else []
    job = load_job(
        REPO / "recipes" / "digits_mlp.yaml",
        [
            f"scaling.launcher={launcher}",
            "scaling.num_workers=2",
            "scaling.max_failures=1",
            "run.epochs=2",
            "run.log_every_steps=1",
            "run.progress=off",
            "checkpoint.every_steps=25",
            "fault.kind=kill",
            "fault.rank=1",
            "fault.at_step=30",
            f"run.storage_dir={root}",
            f"run.name=kill-{launcher}",
            *extra,
        ],
    )
    convoy.train(job)
    steps = [r for r in read_metrics(job.run_dir) if r["kind"] == "step"]
    killed_at = next(r["time"] for r in steps if r["step"] == 30)
    resumed = next(r["time"] for r in steps if r["time"] > killed_at and r["step"] == 26)
    assert committed_checkpoints(job.run_dir)
    return float(resumed - killed_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="convoy-ckpt-") as tmp:
        saves = {label: time_saves(label, args.repeats, Path(tmp)) for label in MODELS}
        kills = {launcher: kill_to_resume(launcher, Path(tmp)) for launcher in ("torchrun", "ray")}
    rows = [
        f"| {label} | {r['params'] / 1e6:.2f} M | {r['bytes'] / 2**20:.1f} | {r['sync']:.3f} "
        f"| {r['async_block']:.3f} | {r['async_total']:.3f} | {r['load']:.3f} |"
        for label, r in saves.items()
    ]
    save_table = "\n".join(
        [
            "| model | params | checkpoint (MiB) | sync save (s) | async: training blocked (s) "
            "| async: until committed (s) | load (s) |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    kill_table = "\n".join(
        [
            "| launcher | kill -> first step of the restarted attempt (s) |",
            "|---|---|",
            *(f"| {launcher} | {seconds:.1f} |" for launcher, seconds in kills.items()),
        ]
    )
    text = f"""# Checkpoint costs (CPU), {date.today().isoformat()}

Produced by `python benchmarks/checkpoint.py --repeats {args.repeats}`. Machine: {os.cpu_count()}
CPU cores ({platform.machine()}), no GPU; torch {torch.__version__}. Local disk.

## Save and load, one process (model + AdamW state), medians of {args.repeats}

{save_table}

*Sync save* blocks training for the whole write. An *async* save blocks only while the state
is staged to CPU memory. It commits on the next save or at the end of training: after a
barrier, rank 0 writes `meta.json`.

## Worker kill to training resumed

`recipes/digits_mlp.yaml`, `ddp` x 2. Rank 1 is SIGKILLed after step 30 and the checkpoint
is at step 25. The restarted attempt resumes at step 26, and the time runs from step 30's
log record to step 26's record in the new attempt: failure detection, restarting the
workers, the process group, the data and the model, and the checkpoint load.

{kill_table}
"""
    out = args.out / f"checkpoint_cpu_{date.today().isoformat()}.md"
    out.write_text(text)
    print(save_table)
    print()
    print(kill_table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
