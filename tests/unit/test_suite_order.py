"""The suite's own scheduling: the dearest tier first, modules kept whole and in order."""

from __future__ import annotations

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
