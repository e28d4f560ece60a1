"""Where the test suite's CPU goes: CPU seconds and wall seconds of every test, for real.

A test's processes are not only pytest's: launchers, Ray's daemons and actors, torchrun's
workers, test hosts. So each pytest process (each xdist worker, the cluster tier's pytest) is
put in a cgroup v1 ``cpuacct`` group of its own, which every process it starts inherits,
whatever session it moves to; a test's CPU is the group's usage across it (setup and teardown
included, so a module fixture's cost lands on the module's first test, and the session Ray's
start and idle on the tests that run while it is up). Needs cgroup v1's cpuacct controller and
root, as the cluster tier does.

The group is made inside the process's current cpuacct group, not at the top: where the
``cpu`` and ``cpuacct`` controllers share a hierarchy, a group at the top would take the
process out of ``tests/run_tiers.py``'s low-weight CPU group. cpuacct charges every ancestor,
so a group made by ``run_tiers.py`` for a whole side (the xdist tiers, the cluster tier, lint)
counts what its pytest processes' own groups count, and what ran outside any test.

This module is a pytest plugin (``tests/conftest.py`` registers it), idle unless a run asks:

    pytest --suite-cpu-out FILE ...    # one JSON line a test: test, worker, cpu, wall

``tests/run_tiers.py`` (``make test``) asks, and ``benchmarks/suite_cpu.py`` summarizes a
records file as markdown tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")  # cgroup v1's cpuacct controller
OPTION = "--suite-cpu-out"


def own_group(pid: int | str = "self") -> Path:
    """The cpuacct group a process is in (its folder under ``CPUACCT``)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return CPUACCT / path.lstrip("/")
    return CPUACCT


def make_group(name: str, parent: Path | None = None) -> Path | None:
    """A new cpuacct group ``name`` inside ``parent`` (this process's group by default);
    None where one cannot be made here (no cgroup v1 cpuacct, not root)."""
    group = (parent if parent is not None else own_group()) / name
    try:
        group.mkdir()
        usage(group)  # a plain folder where the controller is not mounted has no usage file
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            group.rmdir()
        return None
    return group


def join(group: Path, pid: int | str = "self") -> None:
    """Moves a process (this one by default) into ``group``."""
    (group / "cgroup.procs").write_text(str(os.getpid() if pid == "self" else pid))


def usage(group: Path) -> float:
    """CPU seconds every process of ``group`` and of the groups inside it has used."""
    return int((group / "cpuacct.usage").read_text()) / 1e9


def remove_group(group: Path, home: Path, tries: int = 5) -> None:
    """Removes ``group`` and the groups inside it, moving any process left in them (a test's
    orphan) to ``home`` first; a group that cannot be emptied is left. Tried again a few
    times: an interrupted run's orphans may still be forking or exiting into it."""
    if not group.is_dir():
        return
    for inner in [path for path in group.iterdir() if path.is_dir()]:
        remove_group(inner, home, tries)
    for attempt in range(tries):
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    join(home, pid)
            group.rmdir()
            return
        time.sleep(0.1 * (attempt + 1))


class Recorder:
    """One pytest process's group and its records file."""

    def __init__(self, group: Path, out: Path) -> None:
        self.group, self.out = group, out
        self.home = group.parent
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")

    def record(self, test: str, cpu: float, wall: float) -> None:
        line = {"test": test, "worker": self.worker, "cpu": round(cpu, 2), "wall": round(wall, 2)}
        # One short line per write in append mode: the processes sharing the file (xdist
        # workers, the cluster tier's pytest) do not interleave within a line.
        with self.out.open("a") as out:
            out.write(json.dumps(line) + "\n")


RECORDER_KEY = pytest.StashKey[Recorder]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        default=None,
        help="record each test's CPU seconds (every process it starts, through a cgroup v1 "
        "cpuacct group) and wall seconds, one JSON line a test, to this file",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Into a cpuacct group of this process's own, where the run asks for records; where no
    group can be made, one line says so and the tests run unrecorded."""
    out = config.getoption("suite_cpu_out", None)
    if not out:
        return
    group = make_group(f"convoy-pytest-{os.getpid()}")
    if group is None:
        print(f"cpu_accounting: no cpuacct group could be made under {CPUACCT}; not recorded")
        return
    join(group)
    config.stash[RECORDER_KEY] = Recorder(group, Path(out))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the group this process came from; its own removed (kept while a process of a
    test is left in it)."""
    recorder = config.stash.get(RECORDER_KEY, None)
    if recorder is not None:
        with contextlib.suppress(OSError):
            join(recorder.home)
        remove_group(recorder.group, recorder.home)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    recorder = item.config.stash.get(RECORDER_KEY, None)
    if recorder is None:
        yield
        return
    cpu, wall = usage(recorder.group), time.monotonic()
    yield
    recorder.record(item.nodeid, usage(recorder.group) - cpu, time.monotonic() - wall)


# What the records say, for make test's summary and the benchmark's tables.


@dataclass
class Figure:
    """What some tests used together: CPU seconds, wall seconds, how many tests."""

    cpu: float = 0.0
    wall: float = 0.0
    tests: int = 0

    def add(self, record: dict) -> None:
        self.cpu += record["cpu"]
        self.wall += record["wall"]
        self.tests += 1


def read_records(path: Path) -> list[dict]:
    """The records of a ``--suite-cpu-out`` file (none when it is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def module_of(test: str) -> str:
    """``tests/e2e/test_x.py`` of ``tests/e2e/test_x.py::test_y[z]``."""
    return test.split("::", 1)[0]


def tier_of(test: str) -> str:
    """``e2e`` of ``tests/e2e/test_x.py::test_y``: the folder under ``tests/``."""
    parts = module_of(test).split("/")
    return parts[1] if len(parts) > 2 else parts[0]


def totals(records: Iterable[dict], key: str = "module") -> dict[str, Figure]:
    """The records summed by module (``key="module"``) or by tier (``key="tier"``)."""
    name_of = module_of if key == "module" else tier_of
    figures: dict[str, Figure] = {}
    for record in records:
        figures.setdefault(name_of(record["test"]), Figure()).add(record)
    return figures


def dearest(records: Iterable[dict], top: int) -> list[dict]:
    """The ``top`` records of the most CPU, dearest first."""
    return sorted(records, key=lambda record: -record["cpu"])[:top]
