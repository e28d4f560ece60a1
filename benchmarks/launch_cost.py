"""Launch cost: one small ``convoy train``, whole, on each launcher, in two source trees.

Question (issue 40): what does a launch cost a user on ``ray``, ``torchrun`` and ``local``:
its wall time, its time to the first step, and the CPU-seconds of every process it starts
(the driver, the workers, Ray's daemons and actors, torchrun's agent)? And how do two source
trees (before and after a change) compare on the same machine?

Method: each run is ``convoy train <tree>/recipes/digits_mlp.yaml -o run.epochs=1`` (39
steps; ``--recipe`` names another recipe of ``recipes/``, ``--overrides`` adds ``-o``s), with
``-o scaling.launcher=ray|torchrun -o scaling.num_workers=2`` (a private Ray)
or the recipe's ``local`` (1 worker); ``ray-data`` is ``ray`` with ``-o data.loader=ray_data``
(asked for by name); and ``PYTHONPATH=<tree>/src``, which comes before the virtualenv's
editable install. The trees alternate in every repetition (before, after; then
after, before), so the machine's load falls on both alike.

- total CPU-s: the run starts in a cgroup v1 ``cpuacct`` group of its own, which every
  process it starts inherits (the private Ray's daemons too); the group's usage is read once
  its last process has gone (a process still there 30 s after the command is killed and
  named).
- per process: the group's ``cgroup.procs`` sampled every 0.2 s, each process's last
  utime + stime from ``/proc/<pid>/stat``, named by its command line and summed by name; what
  ran between a process's last sample and its end (or in a process shorter than a sample) is
  the ``between samples`` row.
- time to first step: from the command's start to ``first_step_end_time`` in the run's
  ``summary.json`` (the end of rank 0's first optimizer step); wall: to the command's exit.
- which code ran: a ``sitecustomize`` on ``PYTHONPATH`` records where each process found
  ``convoy``; a run fails when one found it outside its tree or a worker did not record.

Each figure is the median over repetitions; a ratio is the median over repetitions of after
over before in the same repetition. Must be run as root (the cgroup).

    .venv/bin/python benchmarks/launch_cost.py [--repeats 2] [--launchers ray,torchrun,local]
        [--trees before=/work/before,after=.] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from dated import compile_sources, publish  # this folder's helpers
from ray_process_cpu import cpu_seconds

REPO = Path(__file__).resolve().parents[1]
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
RECIPE = "digits_mlp"
LAUNCHERS = {
    "ray": ("-o", "scaling.launcher=ray", "-o", "scaling.num_workers=2"),
    "torchrun": ("-o", "scaling.launcher=torchrun", "-o", "scaling.num_workers=2"),
    "local": (),
    # Not in the default list: the ray launcher with Ray Data feeding the workers.
    "ray-data": (
        *("-o", "scaling.launcher=ray", "-o", "scaling.num_workers=2"),
        *("-o", "data.loader=ray_data"),
    ),
}
WORKERS = {
    "ray": "ray::RayTrainWorker",
    "torchrun": "torchrun worker",
    "local": "convoy driver",
    "ray-data": "ray::RayTrainWorker",
}
# A fragment of a command line's first 4 words -> the process's name in the tables; the first
# that matches wins (a starting Ray worker names the raylet in its later arguments).
FORKED = "fork server and forked workers"
NAMES = (
    ("default_worker.py", "ray worker (starting)"),
    ("torch.distributed.run", "torchrun agent"),
    ("convoy.launchers.torchrun --agent", "torchrun agent"),  # Convoy's wrapper of the agent
    ("convoy.launchers.torchrun", "torchrun worker"),
    # Python's fork server and the workers forked from it share its command line.
    ("multiprocessing.forkserver", FORKED),
    ("bin/convoy", "convoy driver"),
    ("gcs_server", "gcs_server"),
    ("raylet", "raylet"),
    ("dashboard/agent.py", "dashboard agent"),
    ("runtime_env/agent", "runtime-env agent"),
    ("log_monitor.py", "log monitor"),
    ("dashboard.py", "dashboard (API server)"),  # started without the dashboard too
    ("monitor.py", "autoscaler monitor"),
)
# Put on PYTHONPATH after the tree: the first import of `convoy` in every process writes
# where it was found (the spec the import then uses) to $LAUNCH_COST_IMPORTS/<pid>.
PROBE = """\
import importlib.util, os, sys

class _WhereConvoy:
    def find_spec(self, name, path=None, target=None):
        if name != "convoy":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        folder = os.environ["LAUNCH_COST_IMPORTS"]
        with open(os.path.join(folder, str(os.getpid())), "w") as record:
            record.write(spec.origin if spec else "?")
        return spec

sys.meta_path.insert(0, _WhereConvoy())
"""


def process_name(pid: int) -> str:
    words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    if words[0].startswith("ray::"):
        return words[0].split(" ")[0].split(".")[0]  # ray::RayTrainWorker, ray::IDLE, ...
    head = " ".join(words[:4])
    return next((name for part, name in NAMES if part in head), Path(words[0]).name or "?")


def sample(group: Path, seen: dict[int, tuple[str, float]]) -> bool:
    """Each process of ``group``: its name and CPU-s so far into ``seen``; False when empty."""
    pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
    for pid in pids:
        try:
            name, cpu = process_name(pid), cpu_seconds(pid)
        except (OSError, IndexError):
            continue  # gone since the list was read
        if name == "?":  # a zombie's command line is empty: the name it had when alive
            name = seen.get(pid, (name, 0.0))[0]
        seen[pid] = (name, cpu)
    return bool(pids)


@contextlib.contextmanager
def probed_folder(prefix: str) -> Iterator[Path]:
    """A temporary folder for a benchmark's runs, with ``PROBE`` as ``probe/sitecustomize.py``
    (what ``run_once`` puts on ``PYTHONPATH``); removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir="/tmp") as folder:
        tmp = Path(folder)
        (tmp / "probe").mkdir()
        (tmp / "probe" / "sitecustomize.py").write_text(PROBE)
        yield tmp


def run_once(
    tree: Path,
    launcher: str,
    tmp: Path,
    name: str,
    recipe: str = RECIPE,
    extra: tuple[str, ...] = (),
) -> dict:
    """One ``convoy train`` in a cpuacct group of its own, sampled until its last process."""
    imports = tmp / f"imports-{name}"
    imports.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tmp / 'probe'}",
        "LAUNCH_COST_IMPORTS": str(imports),
    }
    command = [
        str(Path(sys.executable).parent / "convoy"), "train",
        str(tree / "recipes" / f"{recipe}.yaml"), "-o", "run.epochs=1", *LAUNCHERS[launcher],
        "-o", f"run.storage_dir={tmp / 'runs'}", "-o", f"run.name={name}",
        *(flag for override in extra for flag in ("-o", override)),
    ]  # fmt: skip
    start = time.time()
    run, seen = measure_command(command, env, tmp, name)
    summary = json.loads((tmp / "runs" / name / "summary.json").read_text())
    shutil.rmtree(tmp / "runs" / name)
    return {
        **run,
        "first_step": summary["first_step_end_time"] - start,
        "test": test_metric(summary["metrics"]),
        "imported": check_imports(imports, tree, seen, WORKERS[launcher]),
    }


def measure_command(
    command: list[str], env: dict[str, str], tmp: Path, name: str
) -> tuple[dict, dict[int, tuple[str, float]]]:
    """``command`` in a cpuacct group of its own, on a private Ray's folder under ``tmp``,
    sampled until its last process: its wall, total CPU-s, CPU-s by process name, what ran
    between samples and what was left running (and killed); and each process seen. Its
    output goes to ``tmp/<name>.log``; a failure raises with the log's end."""
    log = tmp / f"{name}.log"
    env = {**env, "RAY_TMPDIR": str(tmp), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # a private Ray, not one a shell points at
    group = CPUACCT / f"convoy-launch-cost-{os.getpid()}"
    group.mkdir()
    seen: dict[int, tuple[str, float]] = {}
    try:
        with log.open("w") as out:
            clock = time.monotonic()
            process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
            )  # fmt: skip
            while sample(group, seen) and process.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.2)  # returns at the exit: the wall's resolution
            process.wait()
            wall = time.monotonic() - clock
        left = wait_for_empty(group, seen)
        total = int((group / "cpuacct.usage").read_text()) / 1e9
    finally:
        group.rmdir()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{log.read_text()[-3000:]}")
    processes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for process_label, cpu in seen.values():
        processes[process_label][0] += 1
        processes[process_label][1] += cpu
    run = {
        "wall": wall,
        "cpu": total,
        "processes": {k: tuple(v) for k, v in processes.items()},
        "between": total - sum(cpu for _, cpu in seen.values()),
        "left": left,
    }
    return run, seen


def wait_for_empty(group: Path, seen: dict[int, tuple[str, float]]) -> list[str]:
    """Sample ``group`` until its last process ends; after 30 s, kill (and name) what is left."""
    deadline = time.monotonic() + 30
    while sample(group, seen):
        if time.monotonic() > deadline:
            left = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            for pid in left:
                os.kill(pid, signal.SIGKILL)  # this run's own processes, by pid
            time.sleep(1)
            return [seen.get(pid, ("?", 0))[0] for pid in left]
        time.sleep(0.2)
    return []


def check_imports(imports: Path, tree: Path, seen: dict, worker: str) -> int:
    """Every process that imported ``convoy`` took it from ``tree``, and every worker did;
    how many imported it."""
    found = {int(p.name): p.read_text() for p in imports.iterdir()}
    src = f"{tree / 'src'}{os.sep}"
    foreign = {pid: origin for pid, origin in found.items() if not origin.startswith(src)}
    silent = [pid for pid, (name, _) in seen.items() if name == worker and pid not in found]
    # A forked worker holds the modules of its fork server, which records where it found them.
    forked = [pid for pid, (name, _) in seen.items() if name == FORKED]
    if forked and not any(pid in found for pid in forked):
        silent += forked
    if foreign or silent:
        raise RuntimeError(f"convoy not from {tree}: {foreign}; workers unrecorded: {silent}")
    return len(found)


def test_metric(metrics: dict[str, float]) -> tuple[str, float]:
    """The run's test accuracy, else its first test metric by name (a language model's
    bits per byte, ``test/bpb``)."""
    names = sorted(k for k in metrics if k.startswith("test/"))
    name = "test/acc" if "test/acc" in names else names[0]
    return name, metrics[name]


def shown(metric: tuple[str, float]) -> str:
    name, value = metric
    return f"{value * 100:.2f}%" if name == "test/acc" else f"{value:.4f}"


def median(values: list[float]) -> float:
    return statistics.median(values)


def launcher_tables(launcher: str, runs: dict[str, list[dict]]) -> str:
    lines = [
        f"### {launcher}\n",
        "| tree | wall (s) | first step (s) | total CPU-s | CPU-s of each run | "
        f"{next(iter(runs.values()))[0]['test'][0]} |",
        "|---|---|---|---|---|---|",
    ]
    for tree, results in runs.items():
        accs = sorted({shown(r["test"]) for r in results})
        each = ", ".join(f"{r['cpu']:.1f}" for r in results)
        lines.append(
            f"| {tree} | {median([r['wall'] for r in results]):.1f} "
            f"| {median([r['first_step'] for r in results]):.1f} "
            f"| {median([r['cpu'] for r in results]):.1f} "
            f"| {each} | {', '.join(accs)} |"
        )
    trees = list(runs)
    if len(trees) == 2:
        pairs = {key: [] for key in ("cpu", "wall", "first_step")}
        for before, after in zip(runs[trees[0]], runs[trees[1]], strict=False):
            for key, values in pairs.items():
                values.append(after[key] / before[key])
        lines.append(
            f"\n{trees[1]} / {trees[0]}: total CPU-s **{median(pairs['cpu']):.2f}**, "
            f"wall {median(pairs['wall']):.2f}, first step {median(pairs['first_step']):.2f}"
        )
    lines += ["", *process_rows(runs)]
    return "\n".join(lines)


def process_rows(runs: dict[str, list[dict]]) -> list[str]:
    """A table of each process's CPU-s (the median over repetitions, and the most processes of
    that name in one run), one column for each of ``runs``' labels; then what ran between
    samples, the total, and what was left running."""
    labels = list(runs)
    names = {name for results in runs.values() for r in results for name in r["processes"]}

    def cell(label: str, name: str) -> tuple[float, str]:
        counts = [r["processes"].get(name, (0, 0.0)) for r in runs[label]]
        cpu, most = median([c[1] for c in counts]), max(c[0] for c in counts)
        return cpu, f"{cpu:.1f}" + (f" ({most})" if most > 1 else "")

    lines = ["| process | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    rows = sorted(names, key=lambda name: -max(cell(label, name)[0] for label in labels))
    lines += [f"| {n} | " + " | ".join(cell(label, n)[1] for label in labels) + " |" for n in rows]
    for title, key in (("between samples", "between"), ("**total (cpuacct)**", "cpu")):
        cells = [f"{median([r[key] for r in runs[label]]):.1f}" for label in labels]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    left = {name for results in runs.values() for r in results for name in r["left"]}
    if left:
        lines.append(f"\nleft running 30 s after the command, then killed: {sorted(left)}")
    return lines


def describe(trees: dict[str, Path]) -> str:
    """Each tree's commit (and whether its sources have uncommitted changes)."""
    parts = []
    for label, tree in trees.items():
        git = ["git", "-C", str(tree)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "src"], capture_output=True, text=True
        )
        changed = " + uncommitted changes in src" if dirty.stdout.strip() else ""
        parts.append(f"{label} = {tree} ({head.stdout.strip()}{changed})")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--launchers", default="ray,torchrun,local", help=f"comma-separated, of {list(LAUNCHERS)}"
    )
    parser.add_argument(
        "--trees", default=f"before=/work/before,after={REPO}", help="label=path,label=path"
    )
    parser.add_argument("--recipe", default=RECIPE, help="a recipe of recipes/, by name")
    parser.add_argument("--overrides", default="", help="comma-separated key=value, as -o")
    parser.add_argument("--out", type=Path, help="write launch_cost_cpu_<date>.md in this folder")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    extra = tuple(filter(None, args.overrides.split(",")))
    trees = {k: Path(v).resolve() for k, v in (t.split("=", 1) for t in args.trees.split(","))}
    for tree in trees.values():
        compile_sources(tree)
    results: dict[str, dict[str, list[dict]]] = {n: {t: [] for t in trees} for n in launchers}
    load = os.getloadavg()[0]
    with probed_folder("lc") as tmp:
        for index in range(args.repeats):
            order = list(trees) if index % 2 == 0 else list(trees)[::-1]
            for launcher in launchers:
                for label in order:
                    name = f"{launcher}-{label}-{index}"
                    run = run_once(trees[label], launcher, tmp, name, args.recipe, extra)
                    results[launcher][label].append(run)
                    print(
                        f"{launcher} {label} #{index}: wall {run['wall']:.1f} s, first step "
                        f"{run['first_step']:.1f} s, {run['cpu']:.1f} CPU-s, "
                        f"{run['imported']} processes imported the tree's convoy",
                        flush=True,
                    )
    header = (
        f"{describe(trees)}. {args.repeats} repetitions, {os.cpu_count()} cores, load average "
        f"{load:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. Method and columns: "
        "`benchmarks/launch_cost.py`'s docstring."
    )
    tables = "\n\n".join(launcher_tables(n, results[n]) for n in launchers)
    publish(
        args.out,
        "launch_cost",
        f"Launch cost: {args.recipe}, 1 epoch, per launcher",
        header,
        tables,
    )


if __name__ == "__main__":
    main()
