"""The peak memory of ``convoy export`` on a run, against the largest file it writes.

Question: does ``convoy export`` hold about one output file, not the model? Each export is
``python -m convoy export RUN --out <tmp> --format F --max-shard-size S`` in a subprocess of
its own, and its peak resident memory is the child's ``ru_maxrss`` (``os.wait4``: that
process alone, whatever ran before). The script itself imports neither torch nor Convoy and
trains nothing in its own process: Linux carries a parent's peak into its child's
``ru_maxrss`` across fork and exec, so a big parent would raise every figure. The baseline is
the same command on a tiny run of the same model family (``gpt_tiny``, or a two-block Llama
for ``model.name: hf`` runs) that the script trains first, one step in a process of its own
(or ``--baseline RUN``): what importing torch, Convoy (and ``transformers``) and reading a
checkpoint cost, whatever the model. The table
gives, per max shard size, the files written, the largest one, the peak, and the peak over
the baseline as a multiple of the largest file (issue 41 asks for at most 1.5).

    python benchmarks/export_memory.py RUN [--format hf] [--max-shard-size 5GB ...]
        [--baseline RUN] [--work DIR] [--out benchmarks/]

To measure the code of another checkout (e.g. before a change), put its ``src`` first on
``PYTHONPATH``: the exports run ``python -m convoy`` with this environment.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import yaml

from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
ONE_STEP = [
    "strategy={name: single}",
    "scaling.launcher=local",
    "scaling.num_workers=1",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batch_size=64",
    "run.epochs=1",
    "run.max_steps=1",
    "run.progress=off",
    "run.name=baseline",
]
TRAIN = """
import sys
from pathlib import Path

import convoy
from convoy.config import load_job

recipe, *overrides = sys.argv[1:]
convoy.train(load_job(Path(recipe), overrides))
"""
"""Trains a recipe with overrides (its arguments), in a process of its own."""
TINY = {
    "gpt": ("lm_tiny.yaml", []),
    "hf": (
        "lm_llama_hf.yaml",
        [
            "model.kwargs.config.hidden_size=32",
            "model.kwargs.config.intermediate_size=64",
            "model.kwargs.config.num_hidden_layers=2",
            "model.kwargs.config.max_position_embeddings=64",
        ],
    ),
}
"""The tiny baseline run of each model family: a recipe and its overrides."""


@dataclass(frozen=True)
class Export:
    """One ``convoy export``: what it wrote and the peak resident memory it took."""

    files: int
    largest: int
    total: int
    peak_rss: int
    seconds: float


def model_name(run: Path) -> str:
    """The run's ``model.name``, from the ``config.yaml`` it saved."""
    return str(yaml.safe_load((run / "config.yaml").read_text())["model"]["name"])


def train_baseline(family: str, storage: Path) -> Path:
    """A tiny run of ``family`` (``gpt`` or ``hf``), one step in a child process; its folder."""
    recipe, overrides = TINY[family]
    arguments = [str(REPO / "recipes" / recipe), *ONE_STEP, *overrides]
    subprocess.run(
        [sys.executable, "-c", TRAIN, *arguments, f"run.storage_dir={storage}"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return storage / "baseline"


def export(run: Path, out: Path, export_format: str, max_shard_size: str | None) -> Export:
    """``convoy export`` of ``run`` into ``out`` in a child process, and what it took; no
    ``--max-shard-size`` for None (its default, and a Convoy from before it had one)."""
    command = [sys.executable, "-m", "convoy", "export", str(run), "--out", str(out)]
    command += ["--format", export_format]
    command += ["--max-shard-size", max_shard_size] if max_shard_size else []
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({child.returncode})")
    sizes = [path.stat().st_size for path in out.glob("*.safetensors")]
    return Export(len(sizes), max(sizes), sum(sizes), usage.ru_maxrss * 1024, seconds)


def row(name: str, size: str | None, done: Export, baseline: Export | None) -> str:
    """One table row; the multiple of the largest file is left out for the baseline."""
    over = done.peak_rss - baseline.peak_rss if baseline else 0
    ratio = f"{over / done.largest:.2f}" if baseline else "-"
    over_cell = f"{over / MIB:,.0f}" if baseline else "-"
    cells = [
        name,
        size or "default (5GB)",
        str(done.files),
        f"{done.largest / MIB:,.1f}",
        f"{done.total / MIB:,.1f}",
        f"{done.peak_rss / MIB:,.0f}",
        over_cell,
        ratio,
        f"{done.seconds:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    """Export the run (and the baseline) at each max shard size; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="the run directory to export")
    parser.add_argument("--format", default="safetensors", choices=("safetensors", "hf"))
    parser.add_argument(
        "--max-shard-size", action="append", help="repeatable (default: the command's, 5GB)"
    )
    parser.add_argument("--baseline", type=Path, help="a tiny run (default: trained here)")
    parser.add_argument("--work", type=Path, help="where the exports go (default: a tmp dir)")
    parser.add_argument("--out", type=Path, help="write the dated markdown file here")
    args = parser.parse_args()
    sizes = args.max_shard_size or [None]
    with tempfile.TemporaryDirectory(dir=args.work, prefix="export-memory-") as tmp:
        work = Path(tmp)
        family = "hf" if model_name(args.run) == "hf" else "gpt"
        baseline_run = args.baseline or train_baseline(family, work / "runs")
        baseline = export(baseline_run, work / "baseline", args.format, sizes[0])
        rows = [row(f"baseline ({model_name(baseline_run)})", sizes[0], baseline, None)]
        for size in sizes:
            done = export(args.run, work / f"export-{size or 'default'}", args.format, size)
            rows.append(row(args.run.name, size, done, baseline))
    header = (
        f"{date.today()}, {platform.node()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}: `convoy export {args.run} --format {args.format}`, "
        "peak RSS of the export's process (`ru_maxrss`), in MiB; over baseline / largest file "
        "is what the export holds beyond the baseline, in largest output files."
    )
    table = "\n".join(
        [
            "| run | max shard size | files | largest file | weights | peak RSS "
            "| over baseline | over baseline / largest file | seconds |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    publish(args.out, "export_memory", "Peak memory of convoy export", header, table)


if __name__ == "__main__":
    main()
