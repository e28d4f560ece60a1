"""Straggler detection on real workers: one rank slowed on purpose (``fault.kind: slow``).

Runs the default recipe (vit_tiny on digits, ddp x 2) under torchrun three times, side by
side: no fault; rank 1 slowed by 30 ms per step from step 40; and, for the cost of watching,
no fault with every step logged (one all-gather per step instead of one per 10). Prints the
log lines that name the straggler, what metrics.jsonl recorded, and a table.

    .venv/bin/python benchmarks/straggler.py [--out benchmarks/straggler_cpu_<date>.md]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convoy.config import load_job
from convoy.outputs import read_metrics, read_summary

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "default.yaml"
COMMON = [
    "scaling.launcher=torchrun",
    "scaling.num_workers=2",
    "run.epochs=3",
    "run.progress=plain",
    "checkpoint.every_epochs=null",
    "tracking.tensorboard=false",
]
SLOW = ["fault.kind=slow", "fault.rank=1", "fault.slow_seconds=0.03", "fault.at_step=40"]


def run(name: str, storage: Path, extra: list[str]) -> dict[str, object]:
    overrides = [*COMMON, f"run.storage_dir={storage}", f"run.name={name}", *extra]
    job = load_job(RECIPE, overrides)
    command = [sys.executable, "-m", "convoy", "train", str(RECIPE)]
    for override in overrides:
        command += ["-o", override]
    start = time.perf_counter()
    # The CLI, so the workers' output (their own processes) is captured as a user sees it.
    log = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    summary = read_summary(job.run_dir)
    records = read_metrics(job.run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    stragglers = [r for r in records if r["kind"] == "straggler"]
    return {
        "name": name,
        "wall": wall,
        "step_ms": 1e3 * float(summary["step_seconds_median"]),
        "local_ms": [
            1e3 * statistics.median(r["rank_local_seconds"][rank] for r in steps[-5:])
            for rank in (0, 1)
        ],
        "stragglers": stragglers,
        "named": [line for line in log.splitlines() if "straggler" in line],
        "logged_steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        storage = Path(tmp)
        rows = [
            run("plain", storage, ["run.log_every_steps=10"]),
            run("slowed", storage, ["run.log_every_steps=10", *SLOW]),
            run("every-step", storage, ["run.log_every_steps=1"]),
        ]
    lines = ["## Log lines of the slowed run", "", "```"]
    lines += [str(line) for line in rows[1]["named"]]  # type: ignore[attr-defined]
    lines += ["```", ""]
    first = rows[1]["stragglers"][0] if rows[1]["stragglers"] else None  # type: ignore[index]
    if first:
        lines += [f"First straggler record in metrics.jsonl: `{first}`", ""]
    lines += [
        "| run | logged steps | straggler records | step ms (median) | local ms rank 0 / 1 "
        "(last 5 logged) | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        local = row["local_ms"]
        lines.append(
            f"| {row['name']} | {row['logged_steps']} | {len(row['stragglers'])} | "  # type: ignore[arg-type]
            f"{row['step_ms']:.1f} | {local[0]:.1f} / {local[1]:.1f} | {row['wall']:.1f} |"  # type: ignore[index]
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        header = (
            f"# Straggler detection, {time.strftime('%Y-%m-%d')} (this machine: 2 CPU cores, "
            "gloo, torchrun)\n\nProduced by `benchmarks/straggler.py`: the default recipe, "
            "ddp x 2, 3 epochs (117 steps); the slowed run adds 30 ms to rank 1's every step "
            "from step 40 (`fault.kind: slow`).\n\n"
        )
        args.out.write_text(header + text + "\n")


if __name__ == "__main__":
    main()
