"""Tensor parallelism (``strategy.tp_size``): what it saves per rank, and what it costs on CPU.

Question 1 (memory): on ``gpt_small`` (124 M parameters, 1,024-token sequences, fp32, AdamW)
over 8 ranks, one sequence per data-parallel rank, how does a rank's peak change from fsdp2
to fsdp2 + tp 2 / tp 4? ``convoy plan`` plans each layout (one rank's share of the model:
half or a quarter of every split linear, heads included) and ``convoy plan --check`` runs two
real training steps of the wrapped DTensor model under torch's ``FSDPMemTracker`` (fake
process group, fake tensors) to check it.

Question 2 (time): with 2 workers on this machine, the step time of fsdp2 + tp 2 against
fsdp2 on ``gpt_tiny`` (``convoy bench compare``, dropout off so the losses must agree). On
CPU with gloo, TP's per-layer all-reduces of activations are not hidden behind compute: this
measures that cost, not a GPU's.

    python benchmarks/tensor_parallel.py [--steps 10] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

from convoy.config import load_job
from convoy.plan import Planner, quiet_warnings
from convoy.plan.check import check_layouts
from convoy.plan.parse import format_bytes
from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
WORLD = 8
TP_SIZES = (1, 2, 4)
GPT_SMALL = [
    "model.name=gpt_small",
    "model.kwargs.dropout=0.0",
    "data.seq_len=1024",
    "strategy={name: fsdp2}",
    "scaling.launcher=torchrun",
    f"scaling.num_workers={WORLD}",
]


def memory_rows() -> list[str]:
    rows = []
    for tp in TP_SIZES:
        # One sequence per data-parallel rank: the global batch is the data-parallel ranks.
        job = load_job(
            REPO / "recipes" / "lm_tiny.yaml",
            [*GPT_SMALL, f"strategy.tp_size={tp}", f"data.batch_size={WORLD // tp}"],
        )
        with quiet_warnings():
            [row] = check_layouts(job, ["fsdp2"], [WORLD], Planner(job), [tp])
        layout, tracked = row.layout, row.tracked_total or 0
        rows.append(
            f"| {layout.name} x {WORLD} | {layout.micro_batch} | {format_bytes(layout.params)} | "
            f"{format_bytes(layout.activations)} | {format_bytes(layout.peak)} | "
            f"{format_bytes(tracked)} | {row.ratio:.3f} |"
        )
    return rows


def time_rows(steps: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="convoy-tp-") as tmp:
        command = [
            sys.executable, "-m", "convoy", "bench", "compare", str(REPO / "recipes" / "lm_tiny.yaml"),
            "--strategies", "fsdp2,fsdp2+tp2", "--workers", "2", "--steps", str(steps),
            "--warmup", "3", "--json", "--out", tmp,
            "-o", "model.kwargs.dropout=0.0", "-o", "scaling.launcher=torchrun",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout[done.stdout.index("{") :])
    rows, base = [], None
    for row in result["strategies"]:
        median = row["step_seconds"]["median"]
        base = base or median
        rows.append(
            f"| {row['strategy']} x 2 | {1000 * median:.1f} | {median / base:.3f} | "
            f"{row['loss_max_relative_gap']:.1e} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown here")
    args = parser.parse_args()
    memory = [
        "| layout | sequences / rank | params / rank | activations / rank | planned peak | "
        "tracked peak | planned / tracked |",
        "|---|---|---|---|---|---|---|",
        *memory_rows(),
    ]
    timing = [
        "| layout | step ms (median) | / fsdp2 | max rel. loss gap (steps 1-5) |",
        "|---|---|---|---|",
        *time_rows(args.steps),
    ]
    header = (
        f"{date.today()}, {platform.machine()}, torch {torch.__version__}. Memory: gpt_small, "
        f"seq 1024, fp32, AdamW, {WORLD} ranks, one sequence per data-parallel rank (rank 0's "
        f"bytes). Time: gpt_tiny (lm_tiny recipe, dropout 0), 2 workers under torchrun on gloo, "
        f"{args.steps} timed steps after 3."
    )
    table = "\n\n".join(["\n".join(memory), "\n".join(timing)])
    publish(args.out, "tensor_parallel", "Tensor parallelism (CPU)", header, table)


if __name__ == "__main__":
    main()
