"""Activation checkpointing on gpt_small: peak memory kept, step time paid, and the planner.

Question: at a sequence length where activations dominate, what does
``strategy.activation_checkpointing`` save in peak memory and cost in step time on one rank,
and does ``convoy plan`` predict both peaks? gpt_small (12 blocks, hidden 768, 87 M
parameters) on the lm_tiny recipe's corpus at ``--seq-len`` tokens and a global batch of
``--batch`` sequences, fp32, AdamW, one rank (``single``):

- memory: ``convoy plan --check``'s measurement (the loop's own train step under torch's
  MemTracker and FakeTensorMode, so the model never needs real memory) against the plan;
- time: the loop's own train step (``convoy.engine.step.train_step``) on real tensors, the
  median over ``--steps`` steps after 2 warm-up steps, modes alternated over the repeats.

    python benchmarks/activation_checkpointing.py [--seq-len 512] [--batch 8] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

from convoy.config import DataParallelRank, Job, load_job
from convoy.engine.amp import Precision
from convoy.engine.schedule import build_optimizer, build_scheduler, no_decay_names, peak_lr
from convoy.engine.step import StepParts, train_step
from convoy.models.registry import build_model
from convoy.plan import Planner, quiet_warnings
from convoy.plan.check import check_layouts
from convoy.plan.parse import format_bytes
from convoy.strategies import build_strategy
from convoy.strategies.blocks import prepare_blocks
from convoy.tasks import build_task
from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "every_n", "full")
VOCAB = 2048  # the recipe's BPE vocabulary


def job_for(mode: str, seq_len: int, batch: int) -> Job:
    return load_job(
        REPO / "recipes" / "lm_tiny.yaml",
        [
            "model.name=gpt_small",
            "model.kwargs.dropout=0.0",
            f"data.seq_len={seq_len}",
            f"data.batch_size={batch}",
            "strategy.name=single",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            f"strategy.activation_checkpointing={mode}",
        ],
    )


def memory(job: Job) -> tuple[int, int, str]:
    """(planned peak, tracked peak, planned moment) of ``single`` x 1."""
    with quiet_warnings():
        (row,) = check_layouts(job, ["single"], [1], Planner(job))
    assert row.tracked_total is not None, row.tracked.note
    return row.layout.peak, row.tracked_total, row.layout.peak_moment


def step_seconds(job: Job, steps: int) -> list[float]:
    """The loop's train step on random tokens: each step's wall time after 2 warm-up steps."""
    torch.manual_seed(0)
    shape = {"vocab_size": VOCAB, "seq_len": job.data.seq_len}
    model = build_model(job.model.name, {**job.model.kwargs}, shape)
    no_decay = no_decay_names(model)
    strategy = build_strategy(job.strategy, torch.device("cpu"), torch.float32)
    model = strategy.wrap(prepare_blocks(model, job.strategy, compile_mode=False))
    optimizer = build_optimizer(job.optim, model, no_decay, peak_lr(job.optim, job.data.batch_size))
    parts = StepParts(
        model=model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, job.optim, steps + 2),
        strategy=strategy,
        precision=Precision(torch.float32, torch.device("cpu"), strategy),
        task=build_task(job.task.name, job.task.kwargs),
    )
    tokens = torch.randint(0, VOCAB, (job.data.batch_size, job.data.seq_len + 1))
    batch = [(tokens[:, :-1], tokens[:, 1:])]
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        train_step(parts, batch, DataParallelRank(0, 1, counts=True), job.optim.grad_clip_norm)
        times.append(time.perf_counter() - start)
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown here")
    args = parser.parse_args()
    jobs = {mode: job_for(mode, args.seq_len, args.batch) for mode in MODES}
    peaks = {mode: memory(job) for mode, job in jobs.items()}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for index in range(args.repeats):
        for mode in MODES if index % 2 == 0 else MODES[::-1]:
            times[mode] += step_seconds(jobs[mode], args.steps)
    base_peak, base_time = peaks["none"][1], statistics.median(times["none"])
    rows = []
    for mode in MODES:
        planned, tracked, moment = peaks[mode]
        step = statistics.median(times[mode])
        rows.append(
            f"| {mode} | {format_bytes(tracked)} | {tracked / base_peak:.3f} | "
            f"{format_bytes(planned)} ({moment}) | {planned / tracked:.3f} | "
            f"{step:.2f} | {step / base_time:.3f} |"
        )
    table = "\n".join(
        [
            "| activation_checkpointing | tracked peak | / none | planned peak (moment) | "
            "planned / tracked | step (s) | / none |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    header = (
        f"{date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; gpt_small, sequence {args.seq_len}, batch {args.batch}, fp32, "
        f"adamw, one rank; step time: median of {args.steps} steps x {args.repeats} repeats"
    )
    publish(
        args.out,
        "activation_checkpointing",
        "Activation checkpointing on gpt_small (CPU)",
        header,
        table,
    )


if __name__ == "__main__":
    main()
