"""The test API server's two builds side by side: ``../shared/k8s-envtest/build.sh`` and
Convoy's ``tests/cluster/k8s/build_apiserver.sh``, what each costs to build and what its
server costs while the k8s tests run.

Question (issue 40): a fresh machine such as CI's builds kube-apiserver from source in every
``make test``. That build was 295-327 CPU-s of a 2,516-3,011 CPU-s run. Convoy's script
generates only the OpenAPI code and compiles without inlining. How much CPU does it save,
and how much of that does a server built without inlining give back while the tests run?

Method: each build runs once into a new ``CONVOY_ENVTEST_DIR``, the shared script first,
both at GOGC=400 (the Makefile's value until this change; Convoy's script sets it itself).
Then ``pytest tests/cluster/k8s`` runs against each build's binaries in turn, ``--runs``
times each, alternating (16 tests; one server for the module, started, given the KubeRay
CRDs, used and stopped). CPU-s: each command in a cgroup v1 ``cpuacct`` group of its own
(``fresh_machine.measured``), the compiler's and the server's processes included. Must be
run as root (the cgroup).

    .venv/bin/python benchmarks/envtest_build.py [--runs 2] [--out benchmarks]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from dated import publish  # this folder's helper
from fresh_machine import ENVTEST_BUILD, measured

REPO = Path(__file__).resolve().parents[1]
BUILDS = {
    "shared build.sh": REPO.parent / "shared" / "k8s-envtest" / "build.sh",
    "build_apiserver.sh": ENVTEST_BUILD,
}
K8S_TESTS = "tests/cluster/k8s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="k8s test runs per build")
    parser.add_argument("--out", type=Path, help="write a dated markdown file here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    folders = {name: Path(tempfile.mkdtemp(prefix="convoy-envtest-bench-")) for name in BUILDS}
    try:
        built: dict[str, tuple[float, float]] = {}
        for name, script in BUILDS.items():
            env = {**os.environ, "CONVOY_ENVTEST_DIR": str(folders[name]), "GOGC": "400"}
            built[name] = measured(["bash", str(script)], env)
            print(
                f"{name}: built in {built[name][0]:.1f} CPU-s, {built[name][1]:.0f} s", flush=True
            )
        tests: dict[str, list[float]] = {name: [] for name in BUILDS}
        for index in range(args.runs):
            for name in BUILDS if index % 2 == 0 else list(BUILDS)[::-1]:
                env = {**os.environ, "CONVOY_ENVTEST_DIR": str(folders[name])}
                cpu, _ = measured([sys.executable, "-m", "pytest", "-q", K8S_TESTS], env)
                tests[name].append(cpu)
                print(f"{name}: k8s tests {cpu:.1f} CPU-s", flush=True)
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
    rows = [
        "| build | build CPU-s | build wall (s) | k8s tests, CPU-s of each run | build + tests |",
        "|---|---|---|---|---|",
    ]
    for name in BUILDS:
        cpu, wall = built[name]
        each = ", ".join(f"{c:.1f}" for c in tests[name])
        total = cpu + statistics.median(tests[name])
        rows.append(f"| `{name}` | {cpu:.1f} | {wall:.0f} | {each} | **{total:.1f}** |")
    header = (
        f"{args.runs} k8s test runs per build, {os.cpu_count()} cores, load average {load:.1f} "
        f"at the start and {os.getloadavg()[0]:.1f} at the end. Method: "
        "`benchmarks/envtest_build.py`'s docstring."
    )
    publish(args.out, "envtest_build", "The test API server's build", header, "\n".join(rows))


if __name__ == "__main__":
    main()
