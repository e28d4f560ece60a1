"""single / ddp / fsdp / fsdp2 like for like on CPU (gloo), 2 workers.

Question: on this machine, what does each strategy cost per step and in memory per rank for
the default recipe (a small ViT on digits), and do they train the same model? Runs
``convoy bench compare recipes/default.yaml --workers 2`` through the torchrun launcher with
one thread per worker: the same seed, global batch (32) and wrap units for every strategy;
``single`` trains the whole global batch on one worker.

    python benchmarks/compare.py [--steps 20] [--warmup 5] [--out benchmarks/]
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

from convoy.bench.compare import format_report, plot

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/default.yaml"


def run(storage: Path, steps: int, warmup: int) -> dict:  # type: ignore[type-arg]
    command = [
        sys.executable, "-m", "convoy", "bench", "compare", str(REPO / RECIPE),
        "--workers", "2", "--steps", str(steps), "--warmup", str(warmup),
        "-o", "scaling.launcher=torchrun", "-o", "scaling.threads_per_worker=1",
        "--json", "--out", str(storage),
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out[out.index("{") :])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    import torch

    stem = f"compare_cpu_{date.today().isoformat()}"
    with tempfile.TemporaryDirectory(prefix="convoy-compare-") as tmp:
        result = run(Path(tmp), args.steps, args.warmup)
    plot(result, str(args.out / f"{stem}.png"))
    report = format_report(result).rsplit(" runs:", 1)[0]  # the temporary dir is gone
    losses = "\n".join(
        f"| {r['strategy']} | " + " | ".join(f"{v:.6f}" for v in r["first_losses"]) + " |"
        for r in result["strategies"]
    )
    steps = result["loss_steps"]
    text = f"""# Strategies like for like on CPU (gloo, 2 workers), {date.today().isoformat()}

Produced by `python benchmarks/compare.py --steps {args.steps} --warmup {args.warmup}`, which
runs `convoy bench compare {RECIPE} --workers 2 -o scaling.launcher=torchrun
-o scaling.threads_per_worker=1`.

- Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU;
  Python {platform.python_version()}, torch {torch.__version__}. **The machine was shared**
  with other work while this ran: the strategies ran back to back in one go, but the step
  times are noisy.
- Same seed, global batch and wrap units (one per transformer block) for every strategy;
  the optimizer is created after sharding. `single` is the whole global batch on 1 worker.
- Peak memory per rank on CPU comes from torch's trackers, run by `convoy.plan.check` for two
  steps of the same job (MemTracker for single and ddp, FSDPMemTracker for fsdp2); FSDP1
  cannot be tracked (flat parameters), so it is n/a. It is never the resident set, which
  holds the whole Python and torch runtime.

{report}

![compare]({stem}.png)

## First {steps} losses per strategy

| strategy | {" | ".join(f"step {i}" for i in range(1, steps + 1))} |
|---|{"---|" * steps}
{losses}

On a CPU with 2 cores and 2 workers, FSDP's extra collectives (an all-gather per block in
forward and again in backward, a reduce-scatter per block: 1.5x DDP's bytes, in many more,
smaller messages) cost more than they save: the model is tiny, and gloo's per-call latency
(~0.2-1 ms, see the all-reduce evidence of the same day) dominates. Sharding pays off when
the model's states, not the latency, are the limit.
"""
    out = args.out / f"{stem}.md"
    out.write_text(text)
    print(report)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
