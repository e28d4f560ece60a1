"""Where the test suite's time goes: CPU seconds and wall seconds of every test.

Question: on a 2-core machine the suite is CPU-bound, so its wall time is at least its CPU
time over 2; which tiers, modules and tests hold that CPU? A test's processes are not only
pytest's: launchers, Ray's daemons and actors, torchrun's workers, test hosts. The recording
is built into the suite (``tests/cpu_accounting.py``, a pytest plugin ``tests/conftest.py``
registers): each pytest process in a cgroup v1 cpuacct group of its own, which every process
it starts inherits, and a test's CPU is the group's usage across it. ``make test`` records
every run (``tests/run_tiers.py`` prints where the records went); to record a selection:

    pytest --suite-cpu-out /tmp/suite_cpu.jsonl -n 2 --dist loadscope ...   # records
    python benchmarks/suite_cpu.py [--out FILE] [--top 30]                   # summarizes

``PYTHONPATH=benchmarks pytest -p suite_cpu ...`` records too, to ``$SUITE_CPU_OUT``
(default ``/tmp/suite_cpu.jsonl``), as this script did before the recording moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cpu_accounting import dearest, totals  # the tests' folder, added above

OUT = Path(os.environ.get("SUITE_CPU_OUT", "/tmp/suite_cpu.jsonl"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """As a plugin (``-p suite_cpu``): the records go to ``OUT`` unless the run names a file."""
    if not config.getoption("suite_cpu_out", None):
        config.option.suite_cpu_out = str(OUT)


def summarize(records: list[dict], top: int) -> str:
    """Markdown tables: CPU and wall per tier, the dearest modules and the dearest tests."""

    def rows(figures: dict) -> list[tuple]:
        return sorted(figures.items(), key=lambda kv: -kv[1].cpu)

    lines = ["| tier | tests | CPU s | wall s |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {f.tests} | {f.cpu:.0f} | {f.wall:.0f} |"
        for name, f in rows(totals(records, "tier"))
    ]
    total_cpu = sum(r["cpu"] for r in records)
    lines += [f"| all | {len(records)} | {total_cpu:.0f} | |", ""]
    lines += ["| module | tests | CPU s | wall s |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {f.tests} | {f.cpu:.0f} | {f.wall:.0f} |"
        for name, f in rows(totals(records))[:top]
    ]
    lines += ["", "| test | CPU s | wall s |", "|---|---|---|"]
    lines += [f"| {r['test']} | {r['cpu']:.0f} | {r['wall']:.0f} |" for r in dearest(records, top)]
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
