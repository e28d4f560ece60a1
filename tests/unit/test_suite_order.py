"""The suite's own scheduling: the dearest tier first, modules kept whole and in order."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

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


def test_each_run_compiles_from_an_empty_inductor_cache_unless_one_is_chosen(
    monkeypatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """As on CI's fresh machine: a new folder for the run, in the environment every test
    process inherits, gone at the end; a folder the user chose is kept and left alone."""
    import run_tiers

    monkeypatch.delenv(run_tiers.INDUCTOR_CACHE, raising=False)
    with run_tiers.fresh_compile_cache():
        folder = Path(os.environ[run_tiers.INDUCTOR_CACHE])
        assert folder.is_dir() and not any(folder.iterdir())
        (folder / "kernel.so").write_bytes(b"")  # what a compile leaves
    assert run_tiers.INDUCTOR_CACHE not in os.environ and not folder.exists()

    chosen = tmp_path / "my-cache"
    chosen.mkdir()
    monkeypatch.setenv(run_tiers.INDUCTOR_CACHE, str(chosen))
    with run_tiers.fresh_compile_cache():
        assert os.environ[run_tiers.INDUCTOR_CACHE] == str(chosen)
    assert os.environ[run_tiers.INDUCTOR_CACHE] == str(chosen) and chosen.is_dir()


def test_the_background_api_server_builds_cpu_is_read_from_its_shells_times(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The Makefile's ``envtest-build`` ends with ``times``: the second line is its children's."""
    import run_tiers

    record = tmp_path / "build.cpu"
    assert run_tiers.envtest_build_cpu(record) is None  # not ended (or not started)
    record.write_text("0m0.010000s 0m0.020000s\n5m12.340000s 0m45.500000s\n")  # dash's
    assert run_tiers.envtest_build_cpu(record) == pytest.approx(312.34 + 45.5)
    record.write_text("0m0.002s 0m0.000s\n0m0.150s 0m0.050s\n")  # bash's: built before
    assert run_tiers.envtest_build_cpu(record) == pytest.approx(0.2)


# A stand-in for pytest in the runner's tests: says which side it is, which CPU cgroup it runs
# in, and exits with the code the test gives that side.
FAKE_PYTEST = (
    "import sys\n"
    "side = 'cluster' if sys.argv[1] == 'tests/cluster' else 'others'\n"
    "cgroup = [l for l in open('/proc/self/cgroup') if ':cpu:' in l or ':cpu,' in l]\n"
    "print(side, 'ran in', cgroup[0].strip() if cgroup else '?', flush=True)\n"
    "sys.exit(int(dict(a.split('=') for a in sys.argv[2:] if '=' in a)[side]))\n"
)


def fake_pytest(monkeypatch, codes: str) -> None:  # type: ignore[no-untyped-def]
    import sys

    import run_tiers

    monkeypatch.setattr(
        run_tiers, "pytest_command", lambda *args: [sys.executable, "-c", FAKE_PYTEST, *args]
    )
    # The pytest arguments both sides get: here the exit code of each.
    monkeypatch.setattr(sys, "argv", ["run_tiers.py", "--workers", "0", *codes.split()])


def test_without_a_cgroup_the_cluster_tier_runs_after_and_its_failure_counts(
    monkeypatch, tmp_path, capfd
) -> None:  # type: ignore[no-untyped-def]
    import run_tiers

    fake_pytest(monkeypatch, "others=0 cluster=1")
    monkeypatch.setattr(run_tiers, "CPU_CGROUPS", tmp_path / "no-such-controller")
    assert run_tiers.main() == 1
    out = capfd.readouterr().out
    assert "runs after" in out
    assert out.index("others ran") < out.index("cluster ran")


def test_beside_the_cluster_tier_the_others_run_in_the_low_weight_cgroup(
    monkeypatch, capfd
) -> None:  # type: ignore[no-untyped-def]
    import run_tiers

    if not os.access(run_tiers.CPU_CGROUPS, os.W_OK):
        pytest.skip(f"no writable CPU cgroup controller at {run_tiers.CPU_CGROUPS} (needs root)")
    fake_pytest(monkeypatch, "others=3 cluster=0")
    assert run_tiers.main() == 3
    out = capfd.readouterr().out
    others = next(line for line in out.splitlines() if line.startswith("others ran"))
    assert "convoy-untimed-" in others
    # The cluster tier's output comes after its header, once it has ended.
    assert out.index("(run beside the other tiers)") < out.index("cluster ran in")
    # Its own group is gone (a `make test` around this test has one of its own, named for its
    # own runner's process).
    assert not (run_tiers.CPU_CGROUPS / f"convoy-untimed-{os.getpid()}").exists()


def test_an_interrupted_runner_ends_the_cluster_tier(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import sys

    import run_tiers

    # The stand-in cluster tier says it started, then records a SIGTERM if one comes before it
    # would end by itself.
    state = tmp_path / "cluster.state"
    cluster = (
        "import signal, sys, time\n"
        f"state = {str(state)!r}\n"
        "def ended(*_): open(state, 'w').write('terminated'); sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, ended)\n"
        "open(state, 'w').write('started')\n"
        "time.sleep(5)\n"
        "open(state, 'w').write('ran out')\n"
    )
    monkeypatch.setattr(run_tiers, "cluster_command", lambda args: [sys.executable, "-c", cluster])

    def interrupted(*args: object) -> int:
        while not state.exists() or state.read_text() != "started":
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_tiers, "run_untimed_tiers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tiers.run_beside("0", [], tmp_path / "unused")
    assert state.read_text() == "terminated"
