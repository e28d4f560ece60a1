"""Launcher overhead: the same job under torchrun and Ray Train, measured side by side.

Question: what does running through Ray Train cost compared with vanilla torchrun, at start-up
and in steady state, alone, two runs at once, and on a machine whose cores are busy? Every run
is a ``python -m convoy train`` process, as a user starts it; each repetition runs the modes in
an interleaved order:

- ``torchrun``: ``python -m torch.distributed.run`` spawning 2 gloo workers;
- ``ray (cold)``: the embedded local Ray that ``make run`` uses, started and stopped inside
  the measurement;
- ``ray (warm)``: a Ray that is already running (``ray start --head`` before the
  measurement; the run joins it): only Ray Train's own start-up is measured;
- ``2 at once``: two runs of the same launcher started together (medians over both);
- ``busy``: two processes spin at the user's priority on every core during the run.

Time to first step = from the process start to the end of the first optimizer step on rank 0;
steady-state step = median step time after 3 warm-up steps; total = process start to exit.
``--src`` runs another checkout's code (``PYTHONPATH``), so a before/after pair is measured by
the same script on the same machine.

    python benchmarks/launcher_overhead.py [--repeats 3] [--epochs 5] [--src PATH] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = (
    "torchrun",
    "ray (cold)",
    "ray (warm)",
    "2 at once: torchrun",
    "2 at once: ray (cold)",
    "busy: torchrun",
    "busy: ray (cold)",
)


def baseline_of(mode: str) -> str:
    """The torchrun row a mode's ratios are taken against (same conditions)."""
    group, _, _ = mode.rpartition(": ")
    return f"{group}: torchrun" if group else "torchrun"


def command(src: Path, launcher: str, storage: Path, epochs: int, name: str) -> list[str]:
    return [
        sys.executable, "-m", "convoy", "train", str(src.parent / "recipes" / "default.yaml"),
        "-o", f"scaling.launcher={launcher}", "-o", f"run.epochs={epochs}",
        "-o", "run.progress=off", "-o", f"run.storage_dir={storage}", "-o", f"run.name={name}",
    ]  # fmt: skip


def start_run(src: Path, env: dict[str, str], launcher: str, storage: Path, epochs: int, name: str):  # type: ignore[no-untyped-def]
    return time.time(), subprocess.Popen(
        command(src, launcher, storage, epochs, name),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(start: float, process: subprocess.Popen[str], run_dir: Path) -> dict[str, float]:
    output, _ = process.communicate()
    end = time.time()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, process.args))} failed:\n{output}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "first_step": summary["first_step_end_time"] - start,
        "step_ms": 1000 * summary["step_seconds_median"],
        "total": end - start,
        "test_acc": summary["metrics"]["test/acc"],
    }


@contextmanager
def busy_cores(active: bool) -> Iterator[None]:
    spinners = (
        [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
        if active
        else []
    )
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@contextmanager
def ray_head(env: dict[str, str], active: bool) -> Iterator[None]:
    """A ``ray start --head`` for the warm mode, in the benchmark's private Ray temp folder."""
    if not active:
        yield
        return
    ray = str(Path(sys.executable).parent / "ray")
    subprocess.run(
        [ray, "start", "--head", "--port=0", "--include-dashboard=false", "--disable-usage-stats"],
        env=env,
        check=True,
        capture_output=True,
    )
    try:
        yield
    finally:
        # Not `ray stop`, which stops every Ray on the machine: the processes under our folder.
        subprocess.run(["pkill", "-9", "-f", env["RAY_TMPDIR"]], capture_output=True)
        (Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").unlink(missing_ok=True)


def measure(
    mode: str, src: Path, env: dict[str, str], storage: Path, epochs: int, index: int
) -> list[dict[str, float]]:
    launcher = "torchrun" if mode.endswith("torchrun") else "ray"
    copies = 2 if mode.startswith("2 at once") else 1
    slug = "".join(c if c.isalnum() else "-" for c in mode).strip("-")
    names = [f"{slug}-{index}-{copy}" for copy in range(copies)]
    with ray_head(env, mode == "ray (warm)"), busy_cores(mode.startswith("busy")):
        started = [start_run(src, env, launcher, storage, epochs, name) for name in names]
        return [finish(t, p, storage / name) for (t, p), name in zip(started, names, strict=True)]


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(results: dict[str, list[dict[str, float]]]) -> str:
    rows = []
    for mode, runs in results.items():
        base = results[baseline_of(mode)]

        def ratio(
            key: str, runs: list[dict[str, float]] = runs, base: list[dict[str, float]] = base
        ) -> str:
            return f"{median_of(runs, key) / median_of(base, key):.3f}"

        cells = [
            f"{median_of(runs, 'first_step'):.2f}",
            f"{median_of(runs, 'step_ms'):.2f}",
            f"{median_of(runs, 'total'):.2f}",
            ratio("first_step"),
            ratio("step_ms"),
            ratio("total"),
            f"{median_of(runs, 'test_acc') * 100:.2f}%",
        ]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    header = (
        "| launcher | first step (s) | steady step (ms) | total (s) "
        "| first step / torchrun | step / torchrun | total / torchrun | test acc |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the convoy code to run")
    parser.add_argument("--out", type=Path, help="write the table to this markdown file")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="cvb", dir="/tmp") as tmp:
        env = {
            **os.environ,
            "PYTHONPATH": str(args.src.resolve()),
            "RAY_TMPDIR": tmp,  # this benchmark's Ray, and only it, lives here
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        env.pop("RAY_ADDRESS", None)
        for index in range(args.repeats):
            order = MODES if index % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                results[mode].extend(
                    measure(mode, args.src, env, Path(tmp) / "runs", args.epochs, index)
                )
                print(f"{mode}: {results[mode][-1]}", flush=True)
        shutil.rmtree(Path(tmp) / "runs", ignore_errors=True)
    table = render(results)
    print(table)
    if args.out:
        args.out.write_text(
            f"<!-- {date.today()} {platform.machine()} {os.cpu_count()} cores, "
            f"src {args.src} -->\n{table}\n"
        )


if __name__ == "__main__":
    main()
