"""torch.compile per block on CPU: compiled vs eager step time, compile time, and the losses.

Question: what does ``run.compile: true`` (each of the model's blocks compiled as one graph,
Inductor's C++ code on CPU) buy or cost on this machine, and does it change the math? Each
model trains the same seeded job for ``--steps`` optimizer steps eagerly and compiled, one
worker (the local launcher, every core), dropout off, in fp32; the runs alternate over the
repeats so machine noise hits both alike. Reported from each run's summary: the median step
time after 3 warm-up steps (compiling is left out of the step times by the engine), the time
spent compiling (from a cold start: Dynamo reset and an empty Inductor cache before each
run), and the largest relative gap between the two runs' per-step losses.

    python benchmarks/compile_blocks.py [--steps 20] [--repeats 2] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

import convoy
from convoy.config import load_job
from convoy.outputs import read_metrics
from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    # gpt_tiny on the embedded pydoc corpus (4 blocks, hidden 128, 128-token sequences)
    "gpt_tiny": ("lm_tiny.yaml", ["model.kwargs.dropout=0.0"]),
    # the course ViT (12 blocks, hidden 384) on CIFAR-shaped synthetic images, batch 32
    "vit_course": ("course_vit_synthetic.yaml", ["precision=fp32", "data.batch_size=32"]),
}


def run(model: str, compiled: bool, storage: Path, steps: int, index: int) -> dict:
    recipe, extra = MODELS[model]
    job = load_job(
        REPO / "recipes" / recipe,
        [
            *extra,
            "strategy={name: single}",  # a fresh section: the recipe's fsdp2 options go
            "scaling.launcher=local",
            "scaling.num_workers=1",
            f"run.compile={str(compiled).lower()}",
            f"run.max_steps={steps}",
            "run.log_every_steps=1",
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={model}-{compiled}-{index}",
        ],
    )
    # A cold compile each time: no traces kept in this process, an empty Inductor cache.
    torch._dynamo.reset()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(storage / f"inductor-{model}-{compiled}-{index}")
    result = convoy.train(job)
    losses = [r["train/loss"] for r in read_metrics(job.run_dir) if r["kind"] == "step"]
    summary = result.summary
    return {
        "step_s": summary["step_seconds_median"],
        "compile_s": summary.get("compile_seconds") or 0.0,
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-compile-") as tmp:
        for model in MODELS:
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for index in range(args.repeats):
                order = (False, True) if index % 2 == 0 else (True, False)
                for compiled in order:
                    runs[compiled].append(run(model, compiled, Path(tmp), args.steps, index))
            eager = statistics.median(r["step_s"] for r in runs[False])
            fast = statistics.median(r["step_s"] for r in runs[True])
            gap = max(
                abs(a - b) / abs(b)
                for c, e in zip(runs[True], runs[False], strict=True)
                for a, b in zip(c["losses"], e["losses"], strict=True)
            )
            rows.append(
                f"| {model} | {1000 * eager:.1f} | {1000 * fast:.1f} | {fast / eager:.3f} | "
                f"{statistics.median(r['compile_s'] for r in runs[True]):.1f} | {gap:.1e} |"
            )
    table = "\n".join(
        [
            "| model | eager step (ms) | compiled step (ms) | compiled / eager | compile (s) | "
            "max rel. loss gap |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    header = (
        f"{date.today()}, {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, {args.steps} steps, {args.repeats} repeats (medians)"
    )
    publish(args.out, "compile_blocks", "torch.compile per block (CPU)", header, table)


if __name__ == "__main__":
    main()
