"""``make test``'s runner: the cluster tier beside the other tiers, ahead of them on the CPU.

The cluster tier (test hosts, multi-node Ray, node kills and spot notices timed against its
runs) leaves this 2-core machine's cores idle about 40% of its time, waiting on node deaths,
drain deadlines and rendezvous timeouts; run after the other tiers, it added its whole length
to the suite. It runs beside them instead, in its own pytest, while the unit, distributed and
e2e tiers run on pytest-xdist workers in a CPU cgroup of low weight: when both want the CPU,
the timed tier gets it (4 CPU-s in 5), and its idle time goes to the others.

A nice value would not do it: the kernel shares the CPU fairly between sessions
(autogroups) whatever their nice values, and the launchers start their workers in sessions
of their own. Where no CPU cgroup can be made (not root, no cgroup v1 ``cpu`` controller),
the tiers run one after the other, as the runner says.

    python tests/run_tiers.py [--workers 2] [pytest arguments for both]

The cluster tier's output is kept in a file and printed once it ends; the exit status is the
first failing run's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

CLUSTER_TIER = "tests/cluster"
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
# The untimed tiers' weight against the default 1024 of every other process: 1 CPU-s in 5.
UNTIMED_SHARES = 256
NOTHING_COLLECTED = 5  # pytest's exit code when a selection leaves a run without tests


def pytest_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def cluster_command(pytest_args: list[str]) -> list[str]:
    return pytest_command(CLUSTER_TIER, *pytest_args)


@contextlib.contextmanager
def low_weight_cgroup() -> Iterator[Path | None]:
    """A CPU cgroup of weight ``UNTIMED_SHARES`` (its ``cgroup.procs``), removed after;
    None where one cannot be made here."""
    group = CPU_CGROUPS / f"convoy-untimed-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.shares").write_text(str(UNTIMED_SHARES))
    except OSError:
        yield None
        return
    try:
        yield group / "cgroup.procs"
    finally:
        # Processes left in it (a test's orphan) go back to the root group first.
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (CPU_CGROUPS / "cgroup.procs").write_text(pid)
            group.rmdir()


def run_untimed_tiers(workers: str, pytest_args: list[str], procs: Path | None) -> int:
    """The unit, distributed, e2e and GPU tiers on ``workers`` xdist workers, in the
    low-weight cgroup when there is one (the pytest process joins it before it starts)."""

    def join_cgroup() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))

    command = pytest_command(
        "-n", workers, "--dist", "loadscope", f"--ignore={CLUSTER_TIER}", *pytest_args
    )  # fmt: skip
    return subprocess.run(command, preexec_fn=join_cgroup).returncode


def run_beside(workers: str, pytest_args: list[str], procs: Path) -> tuple[int, int]:
    """The cluster tier in the background (its output to a file, printed after), the others
    in the foreground: both exit codes."""
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        cluster = subprocess.Popen(
            cluster_command(pytest_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # ended as a group if this runner is interrupted
        )
        try:
            others = run_untimed_tiers(workers, pytest_args, procs)
            cluster_code = cluster.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cluster.pid, signal.SIGTERM)
            cluster.wait()
            raise
        log.seek(0)
        print(f"\n===== {CLUSTER_TIER} (run beside the other tiers) =====", flush=True)
        print(log.read(), flush=True)
    return others, cluster_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (0: one process)")
    options, pytest_args = parser.parse_known_args()
    with low_weight_cgroup() as procs:
        if procs is None:
            print(f"run_tiers: no CPU cgroup here ({CPU_CGROUPS}); {CLUSTER_TIER} runs after")
            others = run_untimed_tiers(options.workers, pytest_args, None)
            codes = (others, subprocess.run(cluster_command(pytest_args)).returncode)
        else:
            codes = run_beside(options.workers, pytest_args, procs)
    return combined_exit_code(codes)


def combined_exit_code(codes: tuple[int, int]) -> int:
    """The first failing run's code; 0 when one run had nothing selected and the other passed
    (``-k`` naming tests of one side only); ``NOTHING_COLLECTED`` when neither had any."""
    failed = [code for code in codes if code not in (0, NOTHING_COLLECTED)]
    return failed[0] if failed else min(codes)


if __name__ == "__main__":
    sys.exit(main())
