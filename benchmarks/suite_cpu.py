"""Where the test suite's time goes: CPU seconds and wall seconds of every test.

Question: on a 2-core machine the suite is CPU-bound, so its wall time is at least its CPU
time over 2; which tiers, modules and tests hold that CPU? A test's processes are not only
pytest's: launchers, Ray's daemons and actors, torchrun's workers, test hosts. So each pytest
process (each xdist worker) is put in a cpuacct cgroup of its own, which every process it
starts inherits, and a test's CPU is the cgroup's usage across it (setup and teardown
included, so a module fixture's cost lands on the module's first test). Needs cgroup v1's
cpuacct controller and root (as the suite's cluster tier does).

    PYTHONPATH=benchmarks pytest -p suite_cpu -n 2 --dist loadscope ...   # records
    python benchmarks/suite_cpu.py [--out FILE] [--top 30]                  # summarizes

Records go to ``$SUITE_CPU_OUT`` (default ``/tmp/suite_cpu.jsonl``), one JSON line a test.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT = Path(os.environ.get("SUITE_CPU_OUT", "/tmp/suite_cpu.jsonl"))
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
GROUP = CPUACCT / f"convoy-suite-{os.getppid()}-{WORKER}"


def _usage() -> float:
    return int((GROUP / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    if not CPUACCT.is_dir():
        raise pytest.UsageError(f"suite_cpu: {CPUACCT} is missing (needs cgroup v1's cpuacct)")
    GROUP.mkdir(exist_ok=True)
    (GROUP / "cgroup.procs").write_text(str(os.getpid()))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the root group, and the group removed (kept while a process is left in it)."""
    try:
        (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
        GROUP.rmdir()
    except OSError:
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    cpu, wall = _usage(), time.monotonic()
    yield
    record = {
        "test": item.nodeid,
        "worker": WORKER,
        "cpu": round(_usage() - cpu, 2),
        "wall": round(time.monotonic() - wall, 2),
    }
    with OUT.open("a") as out:
        out.write(json.dumps(record) + "\n")


def summarize(records: list[dict], top: int) -> str:
    """Markdown tables: CPU and wall per tier, the dearest modules and the dearest tests."""
    tiers: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for record in records:
        module = record["test"].split("::")[0]
        for key, table in ((module.split("/")[1], tiers), (module, modules)):
            row = table[key]
            row[0] += record["cpu"]
            row[1] += record["wall"]
            row[2] += 1
    lines = ["| tier | tests | CPU s | wall s |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {n} | {cpu:.0f} | {wall:.0f} |"
        for name, (cpu, wall, n) in sorted(tiers.items(), key=lambda kv: -kv[1][0])
    ]
    total_cpu = sum(r["cpu"] for r in records)
    lines += [f"| all | {len(records)} | {total_cpu:.0f} | |", ""]
    lines += ["| module | tests | CPU s | wall s |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {n} | {cpu:.0f} | {wall:.0f} |"
        for name, (cpu, wall, n) in sorted(modules.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    lines += ["", "| test | CPU s | wall s |", "|---|---|---|"]
    lines += [
        f"| {r['test']} | {r['cpu']:.0f} | {r['wall']:.0f} |"
        for r in sorted(records, key=lambda r: -r["cpu"])[:top]
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the records to summarize")
    parser.add_argument("--top", type=int, default=30, help="how many modules and tests")
    args = parser.parse_args()
    records = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    print(summarize(records, args.top))


if __name__ == "__main__":
    main()
