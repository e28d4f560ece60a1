"""Where a Ray run's CPU goes: per-process CPU seconds during one ``convoy train`` on Ray.

Question: which of the processes a Ray run starts (its daemons, Ray Train's helper actors, the
train workers) take the CPU the workers could have had, at start-up and in steady state? The
script starts ``python -m convoy train recipes/default.yaml`` (a private local Ray, as ``make
run``), samples every descendant's CPU time (``/proc/<pid>/stat`` utime + stime) every
0.25 s, and splits the run at rank 0's first optimizer step (from the run's summary): before
it is start-up, after it is training. Processes are grouped by their Ray name
(``ray::RayTrainWorker``, ``raylet``, ``gcs_server``, ...). Each group's *first seen* time
(seconds from the run's start) and the times the driver printed its lines give the start-up's
timeline. ``--warm`` joins a ``ray start --head`` started first (its processes are followed
too), as a user with a running Ray would.

``--recipe`` and ``-o`` pick the job (``recipes/digits_mlp.yaml -o scaling.launcher=ray -o
scaling.num_workers=2``, issue 40's launch); the table ends with the total.

    python benchmarks/ray_process_cpu.py [--epochs 10] [--warm] [--src PATH]
        [--recipe recipes/default.yaml] [-o KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from launcher_overhead import ray_head  # this folder's script: its `ray start --head`

REPO = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def name_of(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    first = cmdline[0].decode(errors="replace")
    if first.startswith("ray::"):
        return first.split(".")[0].split(" ")[0]
    if first.startswith("ray-dashboard-"):
        return "dashboard modules"
    for arg in cmdline[:3]:
        text = arg.decode(errors="replace")
        for known in (
            "gcs_server",
            "raylet",
            "dashboard.py",
            "agent.py",
            "log_monitor.py",
            "monitor.py",
            "convoy",
        ):
            if text.endswith(known) or f"/{known}" in text:
                return known
    return Path(first).name or "?"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--src", type=Path, default=REPO / "src")
    parser.add_argument("--warm", action="store_true", help="join a `ray start --head`")
    parser.add_argument("--recipe", default="recipes/default.yaml", help="relative to the src")
    parser.add_argument("-o", dest="overrides", action="append", default=[], help="KEY=VALUE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cvp", dir="/tmp") as tmp:
        env = {**os.environ, "PYTHONPATH": str(args.src.resolve()), "RAY_TMPDIR": tmp}
        env.pop("RAY_ADDRESS", None)
        with ray_head(env, args.warm):
            measure(args, env, tmp)


def started_under(folder: str) -> list[int]:
    """The processes whose command line names ``folder`` (a ``ray start`` head's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if folder.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def measure(args: argparse.Namespace, env: dict[str, str], tmp: str) -> None:
    """Run the job once, sampling the CPU of its processes (and of a warm head's)."""
    roots = started_under(tmp) if args.warm else []
    recipe = args.src.resolve().parent / args.recipe
    command = [sys.executable, "-m", "convoy", "train", str(recipe), "-o", f"run.epochs={args.epochs}",
               "-o", "run.progress=off", "-o", f"run.storage_dir={tmp}/runs", "-o", "run.name=p"]  # fmt: skip
    command += [part for override in args.overrides for part in ("-o", override)]
    start = time.time()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    printed: list[tuple[float, str]] = []
    reader = threading.Thread(target=read_lines, args=(process, printed), daemon=True)
    reader.start()
    samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
    first_seen: dict[str, float] = {}
    while process.poll() is None:
        seen = {}
        pids = {p for root in [process.pid, *roots] for p in descendants(root)}
        for pid in pids:
            try:
                seen[pid] = (name_of(pid), cpu_seconds(pid))
            except (OSError, IndexError):
                continue
            first_seen.setdefault(seen[pid][0], time.time() - start)
        samples.append((time.time(), seen))
        time.sleep(0.25)
    reader.join(timeout=5)
    summary = json.loads((Path(tmp) / "runs" / "p" / "summary.json").read_text())
    first_step, end = summary["first_step_end_time"], summary["end_time"]
    phases = {"start-up": (start, first_step), "training": (first_step, end)}
    table: dict[str, dict[str, float]] = defaultdict(lambda: {p: 0.0 for p in phases})
    for phase, (low, high) in phases.items():
        before = next((s for t, s in reversed(samples) if t <= low), {})
        after = next((s for t, s in reversed(samples) if t <= high), {})
        for pid, (name, cpu) in after.items():
            table[name][phase] += cpu - before.get(pid, (name, 0.0))[1]
    spans = {p: high - low for p, (low, high) in phases.items()}
    print(f"start-up {spans['start-up']:.1f} s, training {spans['training']:.1f} s "
          f"({summary['step_seconds_median'] * 1000:.1f} ms a step), {os.cpu_count()} cores")  # fmt: skip
    print(
        "| process | first seen (s) | start-up CPU s | training CPU s | training share of a core |"
    )
    print("|---|---|---|---|---|")
    for name, row in sorted(table.items(), key=lambda kv: -kv[1]["training"]):
        share = row["training"] / spans["training"] * 100
        seen_at = f"{first_seen[name]:.1f}" if name in first_seen else "-"
        print(
            f"| {name} | {seen_at} | {row['start-up']:.2f} | {row['training']:.2f} | {share:.1f}% |"
        )
    totals = {p: sum(row[p] for row in table.values()) for p in phases}
    whole = last_cpu(samples)
    print(f"| total | - | {totals['start-up']:.2f} | {totals['training']:.2f} | - |")
    print(f"\nwhole command (last sample of each process): {sum(whole.values()):.2f} CPU-s, "
          f"wall {time.time() - start:.1f} s")  # fmt: skip
    for name, cpu in sorted(whole.items(), key=lambda kv: -kv[1]):
        print(f"  {name}: {cpu:.2f}")
    print(f"\nthe driver's lines (s from start; first step at {first_step - start:.1f} s):")
    for at, line in printed[:8]:
        print(f"  {at - start:6.1f}  {line[:100]}")


def last_cpu(samples: list[tuple[float, dict[int, tuple[str, float]]]]) -> dict[str, float]:
    """Each process's CPU at its last sample, summed by name: the whole command's, start-up,
    training and shut-down together (a process's last 0.25 s before it ended is missed)."""
    last: dict[int, float] = {}
    named: dict[int, str] = {}
    for _, seen in samples:
        for pid, (name, cpu) in seen.items():
            # Its latest name that says what it is: a Ray worker starts as `python` and
            # names itself (ray::...) later; an ending process's command line is empty (?).
            if pid not in named or name not in ("?", "python"):
                named[pid] = name
            last[pid] = cpu
    by_name: dict[str, float] = defaultdict(float)
    for pid, cpu in last.items():
        by_name[named[pid]] += cpu
    return dict(by_name)


def read_lines(process: subprocess.Popen[str], printed: list[tuple[float, str]]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        printed.append((time.time(), line.rstrip()))


if __name__ == "__main__":
    main()
