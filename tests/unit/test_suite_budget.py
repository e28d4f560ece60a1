"""The suite's CPU budget (``tests/suite_budget.py``): the committed figures of the last full
run (``tests/suite_cpu_measured.json``) keep to it and cover every test module in the tree;
the checker, the scaling and ``make test``'s runner can each fail."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_budget
from cpu_accounting import make_group, own_group, remove_group, usage
from cpu_budget import (
    MEASURED_FILE,
    REGENERATE,
    Allowance,
    Budget,
    load_budget,
    overruns,
    read_measured,
    reference_figures,
    stale,
    tree_modules,
    unmeasured,
)


def test_every_module_of_the_last_full_run_is_within_its_budget() -> None:
    data, budget = read_measured(), load_budget()
    over = overruns(reference_figures(data, budget), budget)
    assert not over, (
        f"over budget in {MEASURED_FILE.name} ({data['source']}, {data['date']}):\n"
        + "\n".join(map(str, over))
        + "\nmake the module cheaper, or give it its own limit and reason in tests/suite_budget.py"
    )


def test_every_test_module_in_the_tree_has_a_figure_of_a_full_run() -> None:
    data = read_measured()
    missing = unmeasured(data, tree_modules())
    assert not missing, (
        f"{len(missing)} test modules have no figure in {MEASURED_FILE.name} "
        f"({data['source']}): {', '.join(missing)}; regenerate: {REGENERATE}"
    )
    gone = stale(data, tree_modules())
    assert not gone, f"figures of modules no longer in the tree: {gone}; regenerate: {REGENERATE}"
    assert data["complete"], f"{MEASURED_FILE.name} is not a full run's; regenerate: {REGENERATE}"


def test_each_named_exception_is_a_module_of_the_tree_with_its_reason() -> None:
    budget = load_budget()
    modules = tree_modules()
    for module, allowance in budget.exceptions.items():
        assert module in modules, f"{module}: named in tests/suite_budget.py, not in the tree"
        assert len(allowance.reason.split()) >= 5, f"{module}: say why it needs its limit"
        default = Budget(budget.reference_cpu_s, budget.defaults, {}).limit(module)
        assert allowance.cpu_s > default, f"{module}: its limit is not above its tier's {default}"


SYNTHETIC = Budget(
    reference_cpu_s=2.0,
    defaults={"unit": 10.0, "e2e": 50.0, "other": 5.0},
    exceptions={"tests/e2e/test_big.py": Allowance(120.0, "starts four Ray clusters")},
)


def test_the_checker_names_each_module_over_its_limit_and_by_how_much() -> None:
    figures = {
        "tests/unit/test_cheap.py": 9.0,  # under the unit default
        "tests/unit/test_grown.py": 12.5,  # over it
        "tests/e2e/test_big.py": 110.0,  # over the e2e default, under its own limit
        "tests/e2e/test_other.py": 60.0,  # over the e2e default, not named
        "tests/test_loose.py": 6.0,  # outside the tiers: the "other" default
    }
    over = {o.module: (o.cpu_s, o.limit) for o in overruns(figures, SYNTHETIC)}
    assert over == {
        "tests/unit/test_grown.py": (12.5, 10.0),
        "tests/e2e/test_other.py": (60.0, 50.0),
        "tests/test_loose.py": (6.0, 5.0),
    }
    # A named module is held to its own limit.
    assert [o.module for o in overruns({"tests/e2e/test_big.py": 121.0}, SYNTHETIC)] == [
        "tests/e2e/test_big.py"
    ]
    assert "over its 10 by 2.5 (25%)" in str(
        overruns({"tests/unit/test_grown.py": 12.5}, SYNTHETIC)[0]
    )


def test_figures_are_scaled_by_the_machines_calibration() -> None:
    modules = {"tests/e2e/test_x.py": {"cpu_s": 120.0, "wall_s": 300.0, "tests": 3}}
    # A machine three times slower than the reference: 120 CPU-s there are 40 reference CPU-s.
    slow = cpu_budget.measured(modules, 6.0, SYNTHETIC, complete=True, source="synthetic")
    assert slow["factor"] == 3.0
    assert reference_figures(slow, SYNTHETIC) == {"tests/e2e/test_x.py": pytest.approx(40.0)}
    assert not overruns(reference_figures(slow, SYNTHETIC), SYNTHETIC)
    # The same 120 CPU-s on the reference machine are over the e2e default of 50.
    fast = cpu_budget.measured(modules, 2.0, SYNTHETIC, complete=True, source="synthetic")
    assert [o.module for o in overruns(reference_figures(fast, SYNTHETIC), SYNTHETIC)] == [
        "tests/e2e/test_x.py"
    ]


def test_a_new_module_has_no_figure_until_a_run_measures_it(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    for module in ("unit/test_old.py", "e2e/test_new.py", "cluster/k8s/test_deep.py"):
        (tests / module).parent.mkdir(parents=True, exist_ok=True)
        (tests / module).write_text("")
    (tests / "unit" / "helpers.py").write_text("")  # not a test module
    modules = tree_modules(tests)
    assert modules == [
        "tests/cluster/k8s/test_deep.py",
        "tests/e2e/test_new.py",
        "tests/unit/test_old.py",
    ]
    data: dict = {"modules": {"tests/unit/test_old.py": {}, "tests/unit/test_removed.py": {}}}
    assert unmeasured(data, modules) == ["tests/cluster/k8s/test_deep.py", "tests/e2e/test_new.py"]
    assert stale(data, modules) == ["tests/unit/test_removed.py"]


def test_the_committed_figures_fail_the_budget_once_a_module_grows() -> None:
    data, budget = read_measured(), load_budget()
    grown = copy.deepcopy(data)
    module = next(iter(grown["modules"]))
    grown["modules"][module]["cpu_s"] += budget.limit(module) * 10 * grown["factor"]
    assert [o.module for o in overruns(reference_figures(grown, budget), budget)] == [module]


BURN = "import time\nwhile time.process_time() < 0.3:\n    pass\n"


def test_a_group_counts_the_processes_its_members_start_in_sessions_of_their_own() -> None:
    group = make_group(f"convoy-budget-test-{os.getpid()}")
    if group is None:
        pytest.skip("no cgroup v1 cpuacct group can be made here (needs root)")
    try:
        # A child that starts a grandchild in a session of its own (as the launchers start
        # their workers), the grandchild burning 0.3 CPU-s.
        starter = (
            "import subprocess, sys\n"
            f"subprocess.run([sys.executable, '-c', {BURN!r}], start_new_session=True, check=True)\n"
        )
        subprocess.run(
            [sys.executable, "-c", starter],
            preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
            check=True,
        )
        assert usage(group) >= 0.3
    finally:
        remove_group(group, own_group())
    assert not group.exists()


# make test's runner with stand-ins for pytest and lint: a module over its budget, or lint
# failing, fails the run after the tests passed.
FAKE_PYTEST = (
    "import json, sys\n"
    "out = [a.split('=', 1)[1] for a in sys.argv if a.startswith('--suite-cpu-out=')]\n"
    "side = 'cluster' if sys.argv[1] == 'tests/cluster' else 'e2e'\n"
    "record = {'test': f'tests/{side}/test_fake.py::test_x', 'worker': 'main', 'wall': 1.0,\n"
    "          'cpu': float([a for a in sys.argv if a.startswith('cpu=')][0][4:])}\n"
    "if out: open(out[0], 'a').write(json.dumps(record) + '\\n')\n"
)


def run_fake_suite(
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    tmp_path: Path,
    cpu: float,
    lint: str,
) -> tuple[int, str]:
    import run_tiers

    probe = make_group(f"convoy-budget-probe-{os.getpid()}")
    if probe is None:
        pytest.skip("no cgroup v1 cpuacct group can be made here (needs root): nothing recorded")
    remove_group(probe, own_group())
    monkeypatch.setattr(
        run_tiers, "pytest_command", lambda *args: [sys.executable, "-c", FAKE_PYTEST, *args]
    )
    # The calibration says this machine is the reference one (no torch run in a unit test).
    monkeypatch.setattr(cpu_budget, "calibrate", lambda: load_budget().reference_cpu_s)
    argv = ["run_tiers.py", "--workers", "0", "--lint", lint, f"cpu={cpu}"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(run_tiers, "RECORDS_DIR", tmp_path)
    code = run_tiers.main()
    return code, capfd.readouterr().out


def test_the_runner_fails_a_passing_run_with_a_module_over_budget(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    limit = load_budget().defaults["e2e"]
    committed = MEASURED_FILE.read_bytes()
    code, out = run_fake_suite(monkeypatch, capfd, tmp_path, cpu=limit * 2, lint="true")
    assert code == 1, out
    assert "OVER BUDGET: tests/e2e/test_fake.py" in out
    assert "OVER BUDGET: tests/cluster/test_fake.py" in out
    assert "the 10 dearest tests" in out and "tests/suite_budget.py" in out
    # A partial run (here: pytest arguments given) leaves the committed figures alone.
    assert MEASURED_FILE.read_bytes() == committed
    assert (
        "tests/e2e/test_fake.py" in (tmp_path / f"convoy-suite-cpu-{os.getpid()}.json").read_text()
    )


def test_the_runner_passes_within_budget_and_fails_on_lint(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out = run_fake_suite(monkeypatch, capfd, tmp_path, cpu=1.0, lint="true")
    assert code == 0, out
    assert "within its budget" in out
    code, out = run_fake_suite(
        monkeypatch, capfd, tmp_path, cpu=1.0, lint="echo lint output; exit 3"
    )
    assert code == 3
    assert out.index("lint output") < out.index("lint: failed (exit 3)")


def test_the_headroom_table_lists_the_fullest_module_first() -> None:
    modules = {
        "tests/unit/test_a.py": {"cpu_s": 2.0, "wall_s": 1.0, "tests": 1},
        "tests/e2e/test_big.py": {"cpu_s": 114.0, "wall_s": 1.0, "tests": 1},
    }
    data = cpu_budget.measured(modules, 2.0, SYNTHETIC, complete=True, source="synthetic")
    lines = cpu_budget.headroom_lines(data, SYNTHETIC)
    assert lines[1] == "  tests/e2e/test_big.py: 114.0 of 120 (named), 95%"
    assert lines[2] == "  tests/unit/test_a.py: 2.0 of 10, 20%"
