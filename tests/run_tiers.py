"""``make test``'s runner: the cluster tier beside the other tiers, ahead of them on the CPU;
lint beside them both; at the end, what the suite cost in CPU and whether each module kept
to its budget.

The cluster tier (test hosts, multi-node Ray, node kills and spot notices timed against its
runs) leaves this 2-core machine's cores idle about 40% of its time, waiting on node deaths,
drain deadlines and rendezvous timeouts; run after the other tiers, it added its whole length
to the suite. It runs beside them instead, in its own pytest, while the unit, distributed and
e2e tiers run on pytest-xdist workers in a CPU cgroup of low weight: when both want the CPU,
the timed tier gets it (4 CPU-s in 5), and its idle time goes to the others. Lint (``--lint``:
ruff, mypy, lint-imports; mypy alone is about 30 CPU-s from a cold cache) runs beside them in
the same low-weight group, instead of ahead of them all; its output is printed once the tests
end.

A nice value would not do it: the kernel shares the CPU fairly between sessions
(autogroups) whatever their nice values, and the launchers start their workers in sessions
of their own. Where no CPU cgroup can be made (not root, no cgroup v1 ``cpu`` controller),
the tiers run one after the other, as the runner says, and lint beside them at nice 10.

Every pytest process records each test's CPU (``tests/cpu_accounting.py``: a cgroup v1
cpuacct group, so every process a test starts counts). At the end the runner prints the CPU
of the install (what ``make`` ran before it), of lint and of the tests, the ten dearest
tests, and checks each module against ``tests/suite_budget.py`` (``tests/cpu_budget.py``
says how machines of different speeds are compared): a module over its budget fails the run.
A full run (no pytest arguments) writes its figures to ``tests/suite_cpu_measured.json``, the
figures ``tests/unit/test_suite_budget.py`` checks; commit them. Where no cpuacct group can
be made, the runner says so in one line and the tests run unmeasured.

    python tests/run_tiers.py [--workers 2] [--lint COMMAND] [pytest arguments for both]

The cluster tier's output is kept in a file and printed once it ends; the exit status is the
first failing run's (the tests', then lint's, then the budget's).

Inductor's cache starts empty for each run (``TORCHINDUCTOR_CACHE_DIR`` a new folder, shared by
every process of the run, removed at the end), as on CI's fresh machine: a machine's warm
``/tmp/torchinductor_<user>`` hid about 106 CPU-s of C++ kernel compiles in the four compile
tests (``tests/unit/test_blocks.py`` 48 CPU-s cold, 10 warm:
``benchmarks/fresh_machine_cpu_2026-11-29.md``), so a local run passed budgets that CI's
could not. A ``TORCHINDUCTOR_CACHE_DIR`` already set is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import cpu_budget
from cpu_accounting import (
    CPUACCT,
    OPTION,
    dearest,
    join,
    make_group,
    own_group,
    read_records,
    remove_group,
    totals,
    usage,
)

CLUSTER_TIER = "tests/cluster"
CPU_CGROUPS = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
# The untimed tiers' weight against the default 1024 of every other process: 1 CPU-s in 5.
UNTIMED_SHARES = 256
NOTHING_COLLECTED = 5  # pytest's exit code when a selection leaves a run without tests
BUDGET_FAILED = 1  # the exit code when the tests and lint passed but a module is over budget
TOP_TESTS = 10
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
ENVTEST_CPU = Path("/tmp/convoy-envtest-build.cpu")  # the Makefile's ENVTEST_CPU
# Where each run's per-test records (and its figures, beside them) are kept for a look after.
RECORDS_DIR = Path(tempfile.gettempdir())


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


@dataclass(frozen=True)
class Accounting:
    """A cpuacct group for each side's pytest: the xdist tiers' and the cluster tier's
    (``tests/cpu_accounting.py``); None where none can be made here."""

    tiers: Path | None = None
    cluster: Path | None = None

    def cpu(self) -> dict[str, float]:
        """CPU seconds each side has used so far, everything it started included."""
        groups = {"xdist tiers": self.tiers, "cluster tier": self.cluster}
        return {side: usage(group) for side, group in groups.items() if group is not None}


@contextlib.contextmanager
def accounting_groups(procs: Path | None) -> Iterator[Accounting]:
    """The two sides' cpuacct groups, removed after. Where the ``cpu`` and ``cpuacct``
    controllers share a hierarchy, the xdist tiers' group is made inside their low-weight
    group (``procs``' folder), which joining it would otherwise leave."""
    home = own_group()
    shared = procs is not None and CPU_CGROUPS.resolve() == CPUACCT.resolve()
    tiers = make_group(f"convoy-tiers-{os.getpid()}", procs.parent if shared and procs else home)
    cluster = make_group(f"convoy-cluster-{os.getpid()}", home)
    try:
        yield Accounting(tiers, cluster)
    finally:
        for group in (tiers, cluster):
            if group is not None:
                remove_group(group, home)


def joining(procs: Path | None, account: Path | None) -> Callable[[], None]:
    """What a child runs before its command: into the low-weight CPU group (its
    ``cgroup.procs``) and its side's cpuacct group, each where there is one."""

    def join_cgroups() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))
        if account is not None:
            join(account)

    return join_cgroups


def run_untimed_tiers(
    workers: str, pytest_args: list[str], procs: Path | None, account: Path | None = None
) -> int:
    """The unit, distributed, e2e and GPU tiers on ``workers`` xdist workers, in the
    low-weight cgroup when there is one (the pytest process joins it before it starts)."""
    command = pytest_command(
        "-n", workers, "--dist", "loadscope", f"--ignore={CLUSTER_TIER}", *pytest_args
    )  # fmt: skip
    return subprocess.run(command, preexec_fn=joining(procs, account)).returncode


def run_beside(
    workers: str, pytest_args: list[str], procs: Path, groups: Accounting = Accounting()
) -> tuple[int, int]:
    """The cluster tier in the background (its output to a file, printed after), the others
    in the foreground: both exit codes."""
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        cluster = subprocess.Popen(
            cluster_command(pytest_args),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # ended as a group if this runner is interrupted
            preexec_fn=joining(None, groups.cluster),
        )
        try:
            others = run_untimed_tiers(workers, pytest_args, procs, groups.tiers)
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


def run_in_turn(workers: str, pytest_args: list[str], groups: Accounting) -> tuple[int, int]:
    """Without a CPU cgroup: the xdist tiers, then the cluster tier (both exit codes)."""
    print(f"run_tiers: no CPU cgroup here ({CPU_CGROUPS}); {CLUSTER_TIER} runs after")
    others = run_untimed_tiers(workers, pytest_args, None, groups.tiers)
    cluster = subprocess.run(cluster_command(pytest_args), preexec_fn=joining(None, groups.cluster))
    return others, cluster.returncode


def start_lint(command: str, procs: Path | None, log: IO[str]) -> subprocess.Popen:
    """``command`` (a shell command line) in the background, its output to ``log``, at the
    untimed tiers' low weight: in their CPU group, else at nice 10 in a session (autogroup)
    of nice 10, which is what the kernel weighs between sessions."""

    def lower_priority() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))
            return
        os.nice(10)
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text("10")

    return subprocess.Popen(
        command,
        shell=True,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # after os.setsid: lower_priority's autogroup is lint's own
        preexec_fn=lower_priority,
    )


def finish_lint(lint: subprocess.Popen, log: IO[str], command: str) -> tuple[int, float]:
    """Waits for lint and prints its output: its exit code and CPU seconds (``wait4``: every
    process it waited for, ruff's and mypy's included)."""
    _, status, rusage = os.wait4(lint.pid, 0)
    lint.returncode = os.waitstatus_to_exitcode(status)
    log.seek(0)
    print(f"\n===== lint (run beside the tests): {command} =====", flush=True)
    print(log.read(), flush=True)
    print(f"lint: {'passed' if lint.returncode == 0 else f'failed (exit {lint.returncode})'}")
    return lint.returncode, rusage.ru_utime + rusage.ru_stime


def stop(process: subprocess.Popen | None) -> None:
    """Ends a background run started in a session of its own, and everything it started."""
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait()


def cpu_before_tests() -> float | None:
    """CPU seconds of what the ``make`` that started this runner has run and waited for so
    far (the install, when it had to be done); None when no ``make`` started it."""
    pid = os.getppid()
    for _ in range(3):  # make, or the shell make ran this line in
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (OSError, IndexError):
            return None
        if name == "make":
            # cutime and cstime: the CPU of its children it has waited for, in clock ticks.
            return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
        pid = int(fields[1])
    return None


def envtest_build_cpu(path: Path = ENVTEST_CPU) -> float | None:
    """CPU seconds of the test API server's build that ``make test`` started in the background
    (the Makefile's ``envtest-build``: a shell's ``times`` once it ended, the second line its
    children's user and system time, ``1m2.5s 0m3.25s``); None when it has not ended or did
    not run. A machine that built it before spends about nothing here; a fresh one minutes."""
    try:
        children = path.read_text().splitlines()[1].split()
    except (OSError, IndexError):
        return None
    seconds = 0.0
    for field in children:
        minutes, _, rest = field.partition("m")
        seconds += 60 * float(minutes) + float(rest.rstrip("s"))
    return seconds


def print_cpu(
    before: float | None, lint: tuple[int, float] | None, tests: dict[str, float]
) -> None:
    """What the run cost in CPU seconds: the install, the test API server's build, lint, each
    side of the tests."""
    print("\n===== CPU seconds (every process counted) =====")
    if before is not None:
        print(f"install and make's other steps before the tests: {before:,.1f}")
    build = envtest_build_cpu()
    if before is not None and build is not None:  # a make started it (and removed an old one)
        print(f"the test API server's build, in the background from make's start: {build:,.1f}")
    if lint is not None:
        print(f"lint, beside the tests: {lint[1]:,.1f}")
    if not tests:
        print(f"tests: not measured, no cgroup v1 cpuacct group can be made here ({CPUACCT})")
        return
    sides = ", ".join(f"{side} {cpu:,.1f}" for side, cpu in tests.items())
    print(f"tests: {sum(tests.values()):,.1f} ({sides})")


def report(records: list[dict], path: Path, full: bool) -> int:
    """The tiers and the ten dearest tests of the run's records, then each module against its
    budget: ``BUDGET_FAILED`` when one is over. The figures go beside the records and, from a
    full run, to the committed file the budget's unit test reads."""
    if not records:
        return 0
    tiers = sorted(totals(records, "tier").items(), key=lambda kv: -kv[1].cpu)
    print(f"per-test records {sum(r['cpu'] for r in records):,.1f}: " + ", ".join(
        f"{tier} {figure.cpu:,.1f} ({figure.tests} tests)" for tier, figure in tiers
    ))  # fmt: skip
    print(f"the {TOP_TESTS} dearest tests (CPU-s, wall s):")
    for record in dearest(records, TOP_TESTS):
        print(f"  {record['cpu']:8.1f} {record['wall']:8.1f}  {record['test']}")
    budget = cpu_budget.load_budget()
    calibration = cpu_budget.calibrate()
    modules = {
        module: {"cpu_s": round(f.cpu, 2), "wall_s": round(f.wall, 2), "tests": f.tests}
        for module, f in totals(records).items()
    }
    source = "make test (tests/run_tiers.py), " + ("full run" if full else "partial run")
    data = cpu_budget.measured(modules, calibration, budget, complete=full, source=source)
    print(
        f"calibration: {calibration:.2f} CPU-s here, {budget.reference_cpu_s:g} on the "
        f"reference machine: module figures divided by {data['factor']} (tests/cpu_budget.py)"
    )
    over = cpu_budget.overruns(cpu_budget.reference_figures(data, budget), budget)
    for overrun in over:
        print(f"OVER BUDGET: {overrun}")
    rel_budget = cpu_budget.BUDGET_FILE.relative_to(cpu_budget.REPO)
    if over:
        print(f"budgets: {rel_budget} (a module's own limit needs its reason there)")
    else:
        print(f"budget: each of the {len(modules)} modules within its budget ({rel_budget})")
    targets = [path.with_suffix(".json")] + ([cpu_budget.MEASURED_FILE] if full else [])
    for target in targets:
        target.write_text(json.dumps(data, indent=1) + "\n")
    print(f"figures: {', '.join(map(str, targets))} (records: {path})")
    return BUDGET_FAILED if over else 0


@contextlib.contextmanager
def fresh_compile_cache() -> Iterator[None]:
    """An empty Inductor cache for the run (module docstring), unless one was chosen."""
    if os.environ.get(INDUCTOR_CACHE):
        yield
        return
    folder = tempfile.mkdtemp(prefix=f"convoy-inductor-{os.getpid()}-")
    os.environ[INDUCTOR_CACHE] = folder
    try:
        yield
    finally:
        del os.environ[INDUCTOR_CACHE]
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--workers", default="2", help="pytest-xdist workers (0: one process)")
    parser.add_argument(
        "--lint", metavar="COMMAND", help="a shell command run beside the tests (make test's "
        "lint); its output comes after theirs and its failure fails the run",
    )  # fmt: skip
    options, pytest_args = parser.parse_known_args()
    before = cpu_before_tests()
    records = RECORDS_DIR / f"convoy-suite-cpu-{os.getpid()}.jsonl"
    records.unlink(missing_ok=True)
    lint_result = None
    with (
        fresh_compile_cache(),
        low_weight_cgroup() as procs,
        accounting_groups(procs) as groups,
        tempfile.TemporaryFile("w+", errors="replace") as lint_log,
    ):
        args = (
            [*pytest_args, f"{OPTION}={records}"] if groups.tiers or groups.cluster else pytest_args
        )
        lint = start_lint(options.lint, procs, lint_log) if options.lint else None
        try:
            if procs is None:
                codes = run_in_turn(options.workers, args, groups)
            else:
                codes = run_beside(options.workers, args, procs, groups)
        except BaseException:
            stop(lint)
            raise
        if lint is not None:
            lint_result = finish_lint(lint, lint_log, options.lint)
        tests_cpu = groups.cpu()
    print_cpu(before, lint_result, tests_cpu)
    budget_code = report(read_records(records), records, full=not pytest_args)
    tests_code = combined_exit_code(codes)
    codes_in_turn = (tests_code, lint_result[0] if lint_result else 0, budget_code)
    return next((c for c in codes_in_turn if c not in (0, NOTHING_COLLECTED)), tests_code)


def combined_exit_code(codes: tuple[int, ...]) -> int:
    """The first failing run's code; 0 when one run had nothing selected and the other passed
    (``-k`` naming tests of one side only); ``NOTHING_COLLECTED`` when neither had any."""
    failed = [code for code in codes if code not in (0, NOTHING_COLLECTED)]
    return failed[0] if failed else min(codes)


if __name__ == "__main__":
    sys.exit(main())
