"""Language-model throughput by strategy: gpt_tiny under single, ddp, fsdp and fsdp2.

Question: what does each strategy cost for a small GPT on CPU workers? The same job
(``recipes/lm_tiny.yaml``: gpt_tiny on the embedded pydoc corpus, BPE 2,048, 128-token
sequences, global batch 32) runs for a fixed number of optimizer steps under each strategy,
interleaved over the repeats so that machine noise hits every strategy alike: ``single`` is
one worker (the local launcher) with every core, the others are 2 gloo workers under torchrun
with one core each. Dropout is off, because its masks depend on how the batch is split over ranks.
Reported: real (non-padding) training tokens per second over all workers and the median step
time after 3 warm-up steps, both from the run's summary; the ratio is against ``single``. The
loss after the last step is shown too: the strategies train the same model on the same global
batches, so it must agree.

    python benchmarks/tasks.py [--steps 40] [--repeats 2] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

import convoy
from convoy.config import load_job
from convoy.outputs import read_metrics

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("single", "ddp", "fsdp", "fsdp2")


def job_for(strategy: str, storage: Path, steps: int, index: int) -> convoy.Job:
    workers = ["scaling.launcher=local", "scaling.num_workers=1"]
    if strategy != "single":
        workers = ["scaling.launcher=torchrun", "scaling.num_workers=2"]
    return load_job(
        REPO / "recipes" / "lm_tiny.yaml",
        [
            f"strategy.name={strategy}",
            *workers,
            "model.kwargs.dropout=0.0",  # dropout masks depend on the rank layout
            f"run.max_steps={steps}",
            "run.log_every_steps=1",
            "run.progress=off",
            "checkpoint.every_epochs=null",
            f"run.storage_dir={storage}",
            f"run.name={strategy}-{index}",
        ],
    )


def measure(strategy: str, storage: Path, steps: int, index: int) -> dict[str, float]:
    job = job_for(strategy, storage, steps, index)
    summary = convoy.train(job).summary
    losses = [r["train/loss"] for r in read_metrics(job.run_dir) if r["kind"] == "step"]
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "step_ms": 1000 * summary["step_seconds_median"],
        "last_loss": losses[-1],
    }


def table(results: dict[str, list[dict[str, float]]]) -> str:
    base = statistics.median(r["tokens_per_second"] for r in results["single"])
    lines = [
        "| strategy | workers | tokens/s (median) | vs single | step ms (median) | loss at last step |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, runs in results.items():
        rate = statistics.median(r["tokens_per_second"] for r in runs)
        step = statistics.median(r["step_ms"] for r in runs)
        loss = runs[-1]["last_loss"]
        workers = 1 if strategy == "single" else 2
        lines.append(
            f"| {strategy} | {workers} | {rate:,.0f} | {rate / base:.2f}x | {step:.0f} | {loss:.5f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown file here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in STRATEGIES}
    with tempfile.TemporaryDirectory(prefix="convoy-bench-tasks-") as tmp:
        for index in range(args.repeats):
            for strategy in STRATEGIES:
                results[strategy].append(measure(strategy, Path(tmp), args.steps, index))
                print(f"{strategy} #{index + 1}: {results[strategy][-1]}", flush=True)
    hardware = f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    report = (
        f"# gpt_tiny throughput by strategy ({hardware}, {date.today().isoformat()})\n\n"
        f"`python benchmarks/tasks.py --steps {args.steps} --repeats {args.repeats}`; "
        f"torch {torch.__version__}, python {sys.version.split()[0]}.\n"
        "Job: recipes/lm_tiny.yaml without dropout (gpt_tiny, 1.09 M parameters with the "
        "2,048-token BPE; 128-token sequences, global batch 32 = 4,096 tokens per step), "
        f"{args.steps} steps per run, "
        f"{args.repeats} interleaved repeats per strategy.\n\n{table(results)}\n"
    )
    print(report)
    if args.out:
        path = args.out / f"tasks_cpu_{date.today().isoformat()}.md"
        path.write_text(report)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
