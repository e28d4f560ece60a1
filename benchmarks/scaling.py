"""Scaling from 1 to 2 workers on CPU (gloo), weak and strong, for two recipes.

Question: how much of a second worker's CPU turns into throughput, for a small ViT on digits
(``recipes/default.yaml``) and a small GPT on text (``recipes/lm_tiny.yaml``)? Runs
``convoy bench scaling --workers 1,2`` in both modes for both recipes, in one go, through the
torchrun launcher with one thread per worker (so that N = 1 and N = 2 use one core per worker
alike; torch's default of all cores per process oversubscribes a shared 2-core machine).

    python benchmarks/scaling.py [--steps 20] [--warmup 5] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

from convoy.bench.scaling import format_report, plot

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"default": "recipes/default.yaml", "lm_tiny": "recipes/lm_tiny.yaml"}


def run(recipe: str, mode: str, storage: Path, steps: int, warmup: int) -> dict:  # type: ignore[type-arg]
    command = [
        sys.executable, "-m", "convoy", "bench", "scaling", str(REPO / recipe),
        "--workers", "1,2", "--mode", mode, "--steps", str(steps), "--warmup", str(warmup),
        "-o", "scaling.launcher=torchrun", "-o", "scaling.threads_per_worker=1",
        "--json", "--out", str(storage),
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{") :])  # type: ignore[no-any-return]


def summary_row(name: str, result: dict) -> str:  # type: ignore[type-arg]
    one, two = result["sizes"][0], result["sizes"][1]
    unit = result["count_name"]
    return (
        f"| {name} | {result['mode']} | {one['global_batch']} -> {two['global_batch']} | "
        f"{one['throughput']:,.0f} | {two['throughput']:,.0f} {unit}/s | "
        f"{100 * two['efficiency']:.1f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    import torch

    stem = f"scaling_cpu_{date.today().isoformat()}"
    results = {}
    with tempfile.TemporaryDirectory(prefix="convoy-scaling-") as tmp:
        for name, recipe in RECIPES.items():
            for mode in ("weak", "strong"):
                results[(name, mode)] = run(recipe, mode, Path(tmp), args.steps, args.warmup)
    sections = []
    for (name, mode), result in results.items():
        png = f"{stem}_{name}_{mode}.png"
        plot(result, str(args.out / png))
        report = format_report(result).rsplit("\nruns:", 1)[0]  # the temporary dir is gone
        sections.append(f"## {RECIPES[name]}, {mode}\n\n{report}\n\n![{name} {mode}]({png})\n")
    header = (
        "| recipe | mode | global batch N=1 -> N=2 | X_1 | X_2 | E_2 = X_2 / (2 X_1) |\n"
        "|---|---|---|---|---|---|"
    )
    table = "\n".join([header, *(summary_row(n, r) for (n, _), r in results.items())])
    text = f"""# Scaling 1 -> 2 workers on CPU (gloo), weak and strong, {date.today().isoformat()}

Produced by `python benchmarks/scaling.py --steps {args.steps} --warmup {args.warmup}`, which
runs `convoy bench scaling --workers 1,2` through the torchrun launcher, one thread per worker.

- Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU;
  Python {platform.python_version()}, torch {torch.__version__}. **The machine was shared**
  with other work while this ran, so the figures are noisy; all eight runs ran back to back
  in one go, N = 2 before N = 1 for each.
- Throughput X = global samples/s (tokens/s for lm_tiny) over the {args.steps} timed steps
  after {args.warmup} warm-up; a step's time is its slowest rank's; efficiency
  E = X_N / (N x X_1), right for both modes. Weak: the recipe's per-worker batch (its global
  batch / its 2 workers = 16) is kept, so the global batch doubles; strong: the recipe's
  global batch (32) is split.
- With 2 cores and 2 workers, N = 2 has every core busy, also with gloo's all-reduce and the
  other users of the machine: E below 100% is expected here; it says what DDP's
  communication and synchronisation cost on this machine, not on a cluster.

{table}

{chr(10).join(sections)}"""
    out = args.out / f"{stem}.md"
    out.write_text(text)
    print(table)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
