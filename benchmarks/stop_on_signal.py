"""What listening for stop requests costs when none comes: step time with ``run.stop_on_signal``
on (one two-element all-reduce per step for the ranks to agree on a request and its
deadline, asynchronous: read at the next step boundary; under Ray, also a read of Ray
Train's preemption mark) against off.

Two workers under torchrun (or an embedded Ray, ``--launcher ray``: the preemption poll) on
gloo, the same seeded job both ways, runs alternating over the repeats so machine noise hits
both alike. Reported: the median steady step time of each
(the engine's, after its warm-up steps), and on / off. ``digits_mlp`` has steps of a few
milliseconds, where a collective's latency shows most; ``lm_tiny`` (gpt_tiny) is a real
step.

    python benchmarks/stop_on_signal.py [--steps 60] [--repeats 3] [--launcher torchrun]
        [--models digits_mlp,gpt_tiny] [--out benchmarks/]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

import torch

import convoy
from convoy.config import load_job
from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
RECIPES = {
    "digits_mlp": ("digits_mlp.yaml", []),
    "gpt_tiny": ("lm_tiny.yaml", ["model.kwargs.dropout=0.0"]),
}


def step_seconds(
    recipe: str, listening: bool, storage: Path, steps: int, index: int, launcher: str
) -> float:
    name, extra = RECIPES[recipe]
    job = load_job(
        REPO / "recipes" / name,
        [
            *extra,
            "strategy={name: ddp}",
            f"scaling.launcher={launcher}",
            "scaling.num_workers=2",
            f"run.stop_on_signal={str(listening).lower()}",
            f"run.max_steps={steps}",
            "run.progress=off",
            f"run.storage_dir={storage}",
            f"run.name={recipe}-{listening}-{index}",
        ],
    )
    return float(convoy.train(job).summary["step_seconds_median"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launcher", choices=["torchrun", "ray"], default="torchrun")
    parser.add_argument("--models", default=",".join(RECIPES), help="comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="write a dated markdown here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="convoy-stop-") as tmp:
        for recipe in args.models.split(","):
            times: dict[bool, list[float]] = {True: [], False: []}
            for index in range(args.repeats):
                order = (False, True) if index % 2 == 0 else (True, False)
                for listening in order:
                    times[listening].append(
                        step_seconds(recipe, listening, Path(tmp), args.steps, index, args.launcher)
                    )
            on, off = statistics.median(times[True]), statistics.median(times[False])
            rows.append(f"| {recipe} | {1000 * off:.2f} | {1000 * on:.2f} | {on / off:.3f} |")
    table = "\n".join(
        [
            "| model | step ms, off (median) | step ms, on (median) | on / off |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    header = (
        f"{date.today()}, {platform.machine()}, torch {torch.__version__}, 2 workers "
        f"({args.launcher}, ddp, gloo), {args.steps} steps, {args.repeats} repeats (medians of the "
        "runs' median steady step times)"
    )
    stem = "stop_on_signal" if args.launcher == "torchrun" else f"stop_on_signal_{args.launcher}"
    title = "Listening for stop requests" + (
        " and preemption notices" if args.launcher == "ray" else ""
    )
    publish(args.out, stem, f"{title} (CPU)", header, table)


if __name__ == "__main__":
    main()
