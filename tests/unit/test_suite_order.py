"""The suite's own scheduling: the dearest tier first, modules kept whole and in order."""

from __future__ import annotations

import os

from conftest import TIER_ORDER, tier_rank, tier_scope


def test_tiers_rank_dearest_first() -> None:
    ranks = [tier_rank(f"tests/{tier}/test_x.py::test_y") for tier in TIER_ORDER]
    assert ranks == sorted(ranks) == list(range(len(TIER_ORDER)))
    assert tier_rank("tests/e2e/test_tune_sweeps.py::test_a") < tier_rank(
        "tests/unit/test_config.py::test_b"
    )
    # Outside the tiers (a file at the top of tests/, a path elsewhere): last.
    assert tier_rank("tests/test_loose.py::test_c") == len(TIER_ORDER)
    assert tier_rank("benchmarks/test_z.py::test_d") == len(TIER_ORDER)


def test_sorting_by_tier_keeps_each_module_whole_and_in_order() -> None:
    collected = [
        "tests/unit/test_a.py::test_1",
        "tests/unit/test_a.py::test_2",
        "tests/e2e/test_b.py::test_1",
        "tests/distributed/test_c.py::test_1",
        "tests/e2e/test_b.py::test_2",
        "tests/unit/test_d.py::test_1",
    ]
    ordered = sorted(collected, key=tier_rank)
    assert ordered == [
        "tests/e2e/test_b.py::test_1",
        "tests/e2e/test_b.py::test_2",
        "tests/distributed/test_c.py::test_1",
        "tests/unit/test_a.py::test_1",
        "tests/unit/test_a.py::test_2",
        "tests/unit/test_d.py::test_1",
    ]


def test_the_cluster_tier_is_one_scope_and_other_tests_their_module() -> None:
    assert tier_scope("tests/cluster/test_multinode.py::test_a") == "tests/cluster"
    assert tier_scope("tests/cluster/test_preemption.py::test_b[ddp]") == "tests/cluster"
    assert tier_scope("tests/e2e/test_cli.py::test_c[x-y]") == "tests/e2e/test_cli.py"


def test_the_runner_reports_the_first_failure_and_ignores_an_empty_side() -> None:
    from run_tiers import NOTHING_COLLECTED, combined_exit_code

    assert combined_exit_code((0, 0)) == 0
    assert combined_exit_code((1, 0)) == 1 and combined_exit_code((0, 2)) == 2
    assert combined_exit_code((NOTHING_COLLECTED, 0)) == 0  # -k matched cluster tests only
    assert combined_exit_code((NOTHING_COLLECTED, 1)) == 1
    assert combined_exit_code((NOTHING_COLLECTED, NOTHING_COLLECTED)) == NOTHING_COLLECTED


def test_the_low_weight_cgroup_is_made_and_removed(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import run_tiers

    if os.access(run_tiers.CPU_CGROUPS, os.W_OK):  # root with cgroup v1's cpu controller
        with run_tiers.low_weight_cgroup() as procs:
            assert procs is not None and procs.is_file()
            assert (procs.parent / "cpu.shares").read_text().strip() == "256"
        assert not procs.parent.exists()
    monkeypatch.setattr(run_tiers, "CPU_CGROUPS", tmp_path / "no-such-controller")
    with run_tiers.low_weight_cgroup() as procs:
        assert procs is None  # the tiers then run one after the other
