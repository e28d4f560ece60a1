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
- ``busy``: two processes spin at the user's priority on every core during the run, in the
  benchmark's own session (as a user's other work started from the same shell);
- ``busy elsewhere``: the same spinners, each in a session of its own (as other users' or
  other terminals' work): Linux shares the CPU between sessions (autogroups) before it
  shares it between processes, so which session the train workers are in decides their share.

Time to first step = from the process start to the end of the first optimizer step on rank 0;
steady-state step = median step time after 3 warm-up steps; total = process start to exit.
Each value is the median over repetitions; each ratio is the median over repetitions of the
ratio to the torchrun run of the same repetition (runs next to each other share the machine's
state, so pairing them cancels most of its drift). ``--src`` runs another checkout's code
(``PYTHONPATH``); ``--before PATH`` also runs a second checkout, interleaved with ``--src``
in every repetition, so a before/after pair is one run on one machine.

    python benchmarks/launcher_overhead.py [--repeats 3] [--epochs 5] [--modes torchrun,...]
        [--src PATH] [--before PATH] [--out FILE]
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
    "busy elsewhere: torchrun",
    "busy elsewhere: ray (cold)",
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
def busy_cores(mode: str) -> Iterator[None]:
    """Two spinning processes a core during ``busy`` modes; ``busy elsewhere`` starts each in
    a session of its own."""
    active = mode.startswith("busy")
    own_sessions = mode.startswith("busy elsewhere")
    spinners = (
        [
            subprocess.Popen(
                [sys.executable, "-c", "while True: pass"], start_new_session=own_sessions
            )
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
    mode: str, src: Path, env: dict[str, str], storage: Path, epochs: int, tag: str
) -> list[dict[str, float]]:
    launcher = "torchrun" if mode.endswith("torchrun") else "ray"
    copies = 2 if mode.startswith("2 at once") else 1
    slug = "".join(c if c.isalnum() else "-" for c in mode).strip("-")
    names = [f"{slug}-{tag}-{copy}" for copy in range(copies)]
    env = {**env, "PYTHONPATH": str(src.resolve())}
    with ray_head(env, mode == "ray (warm)"), busy_cores(mode):
        started = [start_run(src, env, launcher, storage, epochs, name) for name in names]
        return [finish(t, p, storage / name) for (t, p), name in zip(started, names, strict=True)]


def median_of(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def paired_ratio(runs: list[dict[str, float]], base: list[dict[str, float]], key: str) -> float:
    """The median over repetitions of a run's ``key`` over its repetition's torchrun run."""
    base_of = {r["repeat"]: r[key] for r in base}
    return statistics.median(r[key] / base_of[r["repeat"]] for r in runs)


def render(results: dict[str, list[dict[str, float]]]) -> str:
    rows = []
    for mode, runs in results.items():
        base = results[baseline_of(mode)]
        cells = [
            f"{median_of(runs, 'first_step'):.2f}",
            f"{median_of(runs, 'step_ms'):.2f}",
            f"{median_of(runs, 'total'):.2f}",
            *(f"{paired_ratio(runs, base, k):.3f}" for k in ("first_step", "step_ms", "total")),
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
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    parser.add_argument("--src", type=Path, default=REPO / "src", help="the convoy code to run")
    parser.add_argument("--before", type=Path, help="a second checkout's src, interleaved")
    parser.add_argument("--out", type=Path, help="write the table(s) to this markdown file")
    args = parser.parse_args()
    modes = [m for m in MODES if m in args.modes.split(",")]
    sources = {"after": args.src, "before": args.before} if args.before else {"": args.src}
    results = {(label, m): [] for label in sources for m in modes}  # type: ignore[var-annotated]
    with tempfile.TemporaryDirectory(prefix="cvb", dir="/tmp") as tmp:
        env = {
            **os.environ,
            "RAY_TMPDIR": tmp,  # this benchmark's Ray, and only it, lives here
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        env.pop("RAY_ADDRESS", None)
        for index in range(args.repeats):
            order = modes if index % 2 == 0 else modes[::-1]
            labels = list(sources) if index % 2 == 0 else list(sources)[::-1]
            for mode in order:
                for label in labels:
                    runs = measure(
                        mode, sources[label], env, Path(tmp) / "runs", args.epochs,
                        f"{label}{index}",
                    )  # fmt: skip
                    results[label, mode].extend({**r, "repeat": index} for r in runs)
                    print(f"{label} {mode}: {runs}", flush=True)
        shutil.rmtree(Path(tmp) / "runs", ignore_errors=True)
    tables = []
    for label, src in sources.items():
        table = render({m: results[label, m] for m in modes})
        tables.append(f"{label} ({src}):\n\n{table}" if label else table)
    print("\n\n".join(tables))
    if args.out:
        args.out.write_text(
            f"<!-- {date.today()} {platform.machine()} {os.cpu_count()} cores, "
            f"{args.repeats} repeats, {args.epochs} epochs -->\n" + "\n\n".join(tables) + "\n"
        )


if __name__ == "__main__":
    main()
