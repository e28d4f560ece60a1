"""The test suite's CPU budget: what each test module may cost, and whether it keeps to it.

The budget is written in one place, ``tests/suite_budget.py``: a default per tier, in CPU-s a
module, and named exceptions, each with its own limit and its reason. It is checked twice:
at the end of every ``make test`` against that run's own figures (``tests/run_tiers.py``),
and by ``tests/unit/test_suite_budget.py`` against the figures of the last full run,
committed in ``tests/suite_cpu_measured.json``, which must also hold a figure for every test
module in the tree (a new module must be measured before it lands).

Budgets are in *reference* CPU-s: what a module costs on the fast sort of CI machine. The
machines CI gets are of one kind but run the same tree in 21 minutes or in 66-90, and a
budget in raw CPU-s would fail on every slow one. So each run measures a fixed calibration
workload (``CALIBRATION``: a fresh interpreter importing torch, then a small fixed torch
loop) and divides its modules' CPU-s by ``factor = calibration CPU-s / reference CPU-s``.
The workload is what a launch mostly is (an interpreter importing torch, then a little
compute), so it slows down with the suite; it runs when the suite is done, on a machine
quiet again, three times, and the least is kept (a neighbour's load only adds CPU-s).

    python tests/cpu_budget.py              # the calibration here: CPU-s and factor
    python tests/cpu_budget.py --headroom   # each committed figure against its limit
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import suite_budget

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
BUDGET_FILE = TESTS / "suite_budget.py"
MEASURED_FILE = TESTS / "suite_cpu_measured.json"
# How the committed figures are made again: a full run (no PYTEST_ARGS) writes them.
REGENERATE = f"make test (a full run writes {MEASURED_FILE.relative_to(REPO)}), then commit it"

# A fresh interpreter's import of torch, then 1,500 forward/backward steps of a small MLP on
# one thread: about 2 CPU-s on the fast sort of machine.
CALIBRATION = """
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for _ in range(1500):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad
"""
CALIBRATION_TRIES = 3


@dataclass(frozen=True)
class Allowance:
    """A module allowed more than its tier's default, and why."""

    cpu_s: float
    reason: str


@dataclass(frozen=True)
class Budget:
    """The reference calibration, the defaults per tier, the exceptions."""

    reference_cpu_s: float
    defaults: dict[str, float]  # tier -> CPU-s a module
    exceptions: dict[str, Allowance]  # module -> its own limit and reason

    def limit(self, module: str) -> float:
        """The module's limit in reference CPU-s: its exception's, else its tier's default
        (the ``other`` default where its tier has none)."""
        if module in self.exceptions:
            return self.exceptions[module].cpu_s
        parts = module.split("/")
        tier = parts[1] if len(parts) > 2 else ""
        return self.defaults.get(tier, self.defaults["other"])


def load_budget() -> Budget:
    """The budget ``tests/suite_budget.py`` writes."""
    return Budget(
        reference_cpu_s=suite_budget.REFERENCE_CALIBRATION_CPU_S,
        defaults=dict(suite_budget.DEFAULTS),
        exceptions={
            module: Allowance(cpu_s, reason)
            for module, (cpu_s, reason) in suite_budget.EXCEPTIONS.items()
        },
    )


@dataclass(frozen=True)
class Overrun:
    """A module over its limit, in reference CPU-s."""

    module: str
    cpu_s: float
    limit: float

    def __str__(self) -> str:
        over = self.cpu_s - self.limit
        return (
            f"{self.module}: {self.cpu_s:.1f} CPU-s (reference) over its {self.limit:g} "
            f"by {over:.1f} ({over / self.limit:.0%})"
        )


def overruns(figures: dict[str, float], budget: Budget) -> list[Overrun]:
    """The modules whose figure (reference CPU-s) is over their limit, dearest overrun first."""
    over = [
        Overrun(module, cpu, budget.limit(module))
        for module, cpu in figures.items()
        if cpu > budget.limit(module)
    ]
    return sorted(over, key=lambda o: o.limit - o.cpu_s)


def tree_modules(root: Path = TESTS) -> list[str]:
    """Every test module in the tree, as pytest names it (``tests/unit/test_x.py``)."""
    return sorted(
        str(path.relative_to(root.parent)) for path in root.rglob("test_*.py") if path.is_file()
    )


def calibrate(tries: int = CALIBRATION_TRIES) -> float:
    """CPU seconds of the calibration workload here: the least of ``tries`` runs, each in a
    fresh interpreter (its whole CPU, start included, as ``wait4`` reports it)."""
    cpu = []
    for _ in range(tries):
        child = subprocess.Popen([sys.executable, "-c", CALIBRATION])
        _, status, rusage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise RuntimeError(f"the calibration workload failed (exit {child.returncode})")
        cpu.append(rusage.ru_utime + rusage.ru_stime)
    return min(cpu)


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count()}


def commit() -> str:
    """The tree's commit, with ``+changes`` where it has uncommitted ones ('' outside git)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ""
    return head + ("+changes" if head and dirty else "")


def measured(
    modules: dict[str, dict[str, float]],
    calibration_cpu_s: float,
    budget: Budget,
    complete: bool,
    source: str,
) -> dict[str, object]:
    """The measured file's content: ``modules`` maps a module to its ``cpu_s`` (raw),
    ``wall_s`` and ``tests``; each gets its ``reference_cpu_s`` (raw over the factor)."""
    factor = calibration_cpu_s / budget.reference_cpu_s
    return {
        "note": f"CPU-s of each test module in one run; regenerate: {REGENERATE}",
        "source": source,
        "complete": complete,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "machine": machine(),
        "calibration_cpu_s": round(calibration_cpu_s, 3),
        "reference_calibration_cpu_s": budget.reference_cpu_s,
        "factor": round(factor, 3),
        "modules": {
            module: {**figure, "reference_cpu_s": round(figure["cpu_s"] / factor, 2)}
            for module, figure in sorted(modules.items())
        },
    }


def read_measured(path: Path = MEASURED_FILE) -> dict:
    """The committed figures."""
    return json.loads(path.read_text())


def reference_figures(data: dict, budget: Budget) -> dict[str, float]:
    """Module -> reference CPU-s, from a measured file's content: its raw CPU-s scaled by its
    run's calibration against the budget's reference (so a changed reference applies to
    figures already committed)."""
    factor = data["calibration_cpu_s"] / budget.reference_cpu_s
    return {module: entry["cpu_s"] / factor for module, entry in data["modules"].items()}


def unmeasured(data: dict, modules: list[str]) -> list[str]:
    """The test modules of ``modules`` (the tree's) with no figure in ``data``."""
    return sorted(set(modules) - set(data["modules"]))


def stale(data: dict, modules: list[str]) -> list[str]:
    """The figures in ``data`` of modules no longer in ``modules`` (the tree's)."""
    return sorted(set(data["modules"]) - set(modules))


def headroom_lines(data: dict, budget: Budget) -> list[str]:
    """Each module of a measured file against its limit, the least headroom first."""
    figures = reference_figures(data, budget)
    rows = sorted(figures.items(), key=lambda kv: kv[1] / budget.limit(kv[0]), reverse=True)
    lines = [f"{data['source']}, {data['date']}: module, reference CPU-s, limit, use"]
    for module, cpu in rows:
        named = " (named)" if module in budget.exceptions else ""
        limit = budget.limit(module)
        lines.append(f"  {module}: {cpu:.1f} of {limit:g}{named}, {cpu / limit:.0%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--headroom",
        action="store_true",
        help=f"each module of {MEASURED_FILE.name} against its limit",
    )
    args = parser.parse_args()
    budget = load_budget()
    if args.headroom:
        print("\n".join(headroom_lines(read_measured(), budget)))
        return
    cpu = calibrate()
    print(f"calibration: {cpu:.2f} CPU-s here, {budget.reference_cpu_s:g} on the reference machine")
    print(f"factor: {cpu / budget.reference_cpu_s:.2f} (CPU-s here over this: reference CPU-s)")


if __name__ == "__main__":
    main()
