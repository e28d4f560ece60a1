"""What a fresh machine adds to ``make test``: Inductor's compiles and the test API server's build.

Question (issue 40): CI runs the suite on a fresh machine, where two caches a developer's
machine keeps warm are empty: Inductor's (``/tmp/torchinductor_<user>``: the C++ kernels the
``run.compile`` tests build) and the test API server's (``~/.cache/convoy-envtest``:
kube-apiserver, built from source by ``tests/cluster/k8s/build_apiserver.sh``, in the background
from ``make test``'s start). How many CPU-seconds does each add to a run that a warm machine's
figures do not show?

Method: each compile test module runs twice in a row, with ``TORCHINDUCTOR_CACHE_DIR`` a new
empty folder for the pair: first cold (what CI pays, and what ``make test`` now pays, since
``tests/run_tiers.py`` gives each run an empty cache), then warm (what a developer's machine
paid before). The build runs once into a new ``CONVOY_ENVTEST_DIR`` (``--build``; about 4
minutes on 2 cores). CPU-s: each command in a cgroup v1 ``cpuacct`` group of its own, which
every process it starts inherits (gcc and the linker included); wall from its start to its
exit. Must be run as root (the cgroup).

    .venv/bin/python benchmarks/fresh_machine.py [--build] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dated import publish  # this folder's helper

REPO = Path(__file__).resolve().parents[1]
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
ENVTEST_BUILD = REPO / "tests" / "cluster" / "k8s" / "build_apiserver.sh"
# The modules with a run.compile test: each compiles its model's blocks with Inductor.
COMPILE_TESTS = (
    "tests/unit/test_blocks.py",
    "tests/distributed/test_strategy_parity.py::test_tensor_parallel_composes_with_compile_and_checkpointing",
    "tests/distributed/test_task_parity.py::test_lm_losses_match_single_under_tensor_parallel",
    "tests/distributed/test_hf_parity.py::test_checkpointed_and_compiled_blocks_keep_the_losses",
)


def measured(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """``command``'s CPU-s (its cpuacct group's usage) and wall s; it must succeed."""
    group = CPUACCT / f"convoy-fresh-machine-{os.getpid()}"
    group.mkdir()
    try:
        start = time.monotonic()
        done = subprocess.run(
            command,
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
        )
        wall = time.monotonic() - start
    finally:  # what it left behind counts too; the group goes whatever happened
        end_leftovers(group)
        cpu = int((group / "cpuacct.usage").read_text()) / 1e9
        group.rmdir()
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return cpu, wall


def end_leftovers(group: Path, grace_s: float = 30.0) -> None:
    """Wait for the processes a command left behind in ``group`` (a compile worker, a
    tracker) to exit, so their CPU counts; SIGKILL what is left after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while pids := [int(p) for p in (group / "cgroup.procs").read_text().split()]:
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def compile_rows() -> list[str]:
    rows, totals = [], [0.0, 0.0]
    for test in COMPILE_TESTS:
        cache = tempfile.mkdtemp(prefix="convoy-inductor-bench-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "RAY_USAGE_STATS_ENABLED": "0"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
        try:
            (cold, cold_wall), (warm, warm_wall) = measured(command, env), measured(command, env)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        totals[0], totals[1] = totals[0] + cold, totals[1] + warm
        rows.append(
            f"| `{test.split('::')[-1]}` | {cold:.1f} | {warm:.1f} | {cold - warm:+.1f} "
            f"| {cold_wall:.0f} / {warm_wall:.0f} |"
        )
    rows.append(
        f"| **all four** | {totals[0]:.1f} | {totals[1]:.1f} | **{totals[0] - totals[1]:+.1f}** | |"
    )
    return rows


def build_row() -> str:
    folder = tempfile.mkdtemp(prefix="convoy-envtest-bench-")
    try:
        env = {**os.environ, "CONVOY_ENVTEST_DIR": folder}
        cpu, wall = measured(["bash", str(ENVTEST_BUILD)], env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return f"| kube-apiserver + etcd (`build_apiserver.sh`, a new folder) | **{cpu:.1f}** | {wall:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="store_true", help="also time the API server's build")
    parser.add_argument("--out", type=Path, help="write a dated markdown file here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    table = [
        "## Inductor: each compile test from an empty cache, then again from the one it filled",
        "",
        "| test (its module's compile test) | cold CPU-s | warm CPU-s | cold - warm | wall s, cold / warm |",
        "|---|---|---|---|---|",
        *compile_rows(),
    ]
    if args.build:
        table += [
            "",
            "## The test API server's build on a fresh machine",
            "",
            "| what | CPU-s | wall s |",
            "|---|---|---|",
            build_row(),
        ]
    header = (
        f"{len(os.sched_getaffinity(0))} cores, load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end. Method: this script's docstring "
        "(`benchmarks/fresh_machine.py`)."
    )
    publish(
        args.out,
        "fresh_machine",
        "What a fresh machine adds to make test",
        header,
        "\n".join(table),
    )


if __name__ == "__main__":
    main()
