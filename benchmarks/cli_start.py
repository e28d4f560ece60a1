"""CLI start cost: ``convoy`` commands that train nothing, in two source trees.

Question (issue 40): what does a ``convoy`` command that trains nothing cost before it does
its work: ``convoy --help``, ``convoy list``, ``convoy config show``, ``convoy k8s status``
(the same start as ``logs``, ``delete``, ``gc``), ``convoy k8s validate``? Each builds the
whole CLI first, and a module that imports torch at its top makes every one of them pay for
it; some need torch for their work (``config show`` builds the model).

Method: each command runs with ``PYTHONPATH=<tree>/src`` (before the virtualenv's editable
install) in the tree's folder; the trees alternate in every repetition, so the machine's
load falls on both alike. CPU-s: the child's user + system time (``os.wait4``); wall: to its
exit. A command that exits with another code than its own fails the benchmark. Each figure is the median over
repetitions; the ratio is after / before of the medians.

    .venv/bin/python benchmarks/cli_start.py --trees before=/tmp/before,after=. \
        [--repeats 5] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dated import compile_sources, publish  # this folder's helpers

COMMANDS = {  # label: (arguments, the exit code it ends with)
    "convoy --help": (["--help"], 0),
    "convoy list": (["list"], 0),
    "convoy config show (preflight: builds the model)": (
        ["config", "show", "recipes/digits_mlp.yaml"],
        0,
    ),
    "convoy k8s status (no kubeconfig: exits 2 once it is imported)": (
        ["k8s", "status", "some-run", "--kubeconfig", "/nonexistent"],
        2,
    ),
    "convoy k8s validate (a rendered RayJob: looks for its run's checkpoints)": (
        ["k8s", "validate", "{manifests}"],
        0,
    ),
}


def run_once(tree: Path, args: list[str], expected: int) -> tuple[float, float]:
    """CPU-s and wall s of one ``convoy`` command run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "RAY_USAGE_STATS_ENABLED": "0"}
    # Its stderr to a file: a pipe nobody reads while it runs could fill and stall it.
    with tempfile.TemporaryFile() as stderr:
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "convoy", *args],
            cwd=tree,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.monotonic() - started
        code = os.waitstatus_to_exitcode(status)
        process.returncode = code  # reaped here: Popen must not wait for it again
        if code != expected:
            stderr.seek(0)
            said = stderr.read().decode(errors="replace")
            raise SystemExit(f"{tree}: convoy {' '.join(args)} exited {code}\n{said}")
    return usage.ru_utime + usage.ru_stime, wall


def rendered_manifests(tree: Path, folder: Path) -> Path:
    """The default recipe's manifests, rendered once (by the tree given)."""
    path = folder / "manifests.yaml"
    subprocess.run(
        [
            *(sys.executable, "-m", "convoy", "k8s", "render", "recipes/default.yaml"),
            *("-o", "k8s.image=registry.example.com/convoy:0.1.0", "-o", "k8s.pvc=convoy-runs"),
            *("--out", str(path)),
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree / "src")},
        check=True,
        capture_output=True,
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="after=.", help="name=path,name=path (2 at most)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trees = {
        name: Path(path).resolve()
        for name, _, path in (item.partition("=") for item in args.trees.split(","))
    }
    for tree in trees.values():
        compile_sources(tree)
    with tempfile.TemporaryDirectory() as folder:
        manifests = rendered_manifests(next(reversed(trees.values())), Path(folder))
        found: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for repeat in range(args.repeats):
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for label, (command, expected) in COMMANDS.items():
                filled = [part.format(manifests=manifests) for part in command]
                for name in order:
                    measured = run_once(trees[name], filled, expected)
                    found.setdefault((label, name), []).append(measured)
    names = list(trees)
    header = (
        f"Trees: {', '.join(f'{n} = {p}' for n, p in trees.items())}. {args.repeats} "
        f"repetitions, interleaved; {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Method: `benchmarks/cli_start.py`'s docstring."
    )
    rows = [
        "| command | "
        + " | ".join(f"{n} CPU-s | {n} wall s" for n in names)
        + (f" | CPU {names[1]} / {names[0]} |" if len(names) == 2 else " |"),
        "|---|" + "---|---|" * len(names) + ("---|" if len(names) == 2 else ""),
    ]
    for label in COMMANDS:
        medians = [
            (
                statistics.median(c for c, _ in found[(label, n)]),
                statistics.median(w for _, w in found[(label, n)]),
            )
            for n in names
        ]
        cells = " | ".join(f"{c:.2f} | {w:.2f}" for c, w in medians)
        ratio = f" | **{medians[1][0] / medians[0][0]:.2f}** |" if len(names) == 2 else " |"
        rows.append(f"| {label} | {cells}{ratio}")
    publish(args.out, "cli_start", "CLI start cost", header, "\n".join(rows))


if __name__ == "__main__":
    main()
