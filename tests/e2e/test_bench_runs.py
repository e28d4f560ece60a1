"""``convoy bench``: all-reduce, scaling and compare end to end through the real launchers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from convoy.cli import main

pytestmark = pytest.mark.e2e
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
MLP = str(RECIPES / "digits_mlp.yaml")


def bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def data_rows(text: str) -> list[list[str]]:
    """The table's data rows: not its # header and footer, nor the "plot: PATH" line."""
    return [
        line.split() for line in text.splitlines() if line and not line.startswith(("#", "plot:"))
    ]


def driver_state() -> tuple[dict[str, str], dict[int, object], str, bool]:
    """What torchrun's agent, run in this process, changes while it runs: the environment,
    the signal handlers, the thread's name and the fault handler."""
    import faulthandler
    import os
    import signal

    from torch.multiprocessing import _get_thread_name

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
    handlers = {s: signal.getsignal(s) for s in signals}
    return dict(os.environ), handlers, _get_thread_name(), faulthandler.is_enabled()


def test_allreduce_over_torchrun_prints_rows_and_footer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = driver_state()
    code, out, _ = bench(
        capsys,
        "allreduce",
        MLP,
        "-o",
        "scaling.launcher=torchrun",
        "-o",
        "scaling.num_workers=2",
        "--max-bytes",
        "64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--out",
        str(tmp_path),
        "--plot",
        str(tmp_path / "ar.png"),
    )
    assert code == 0
    assert driver_state() == before  # the agent ran in this process and left it as it was
    rows = data_rows(out)
    assert [int(r[0]) for r in rows] == [8 * 2**i for i in range(14)]  # 8 B .. 64 KiB
    for size, count, dtype, redop, time_us, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and (dtype, redop, wrong) == ("float32", "sum", "0")
        assert float(time_us) > 0
        assert float(busbw) == pytest.approx(float(algbw), abs=1e-3)  # factor 1 for n = 2
    assert "2 rank(s) on 1 host(s) via torchrun, gloo on cpu" in out
    assert "# Out of bounds values : 0 OK" in out
    assert out.splitlines()[-2].startswith("# Avg bus bandwidth    : ")
    assert out.splitlines()[-1] == f"plot: {tmp_path / 'ar.png'}"
    assert (tmp_path / "ar.png").stat().st_size > 0


def test_allreduce_json_on_one_local_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = bench(
        capsys,
        "allreduce",
        MLP,
        "--min-bytes",
        "1K",
        "--max-bytes",
        "4K",
        "--iters",
        "2",
        "--dtype",
        "bfloat16",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    result = json.loads(out)
    assert result["world_size"] == 1 and result["in_place"] is True
    assert result["busbw_factor"] == 0 and result["avg_busbw_gbps"] is None
    assert [r["size_bytes"] for r in result["rows"]] == [1024, 2048, 4096]
    assert [r["count"] for r in result["rows"]] == [512, 1024, 2048]
    assert all(r["busbw_gbps"] is None and r["algbw_gbps"] > 0 for r in result["rows"])


def test_allreduce_plot_into_a_missing_folder_keeps_stdout_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figure = tmp_path / "figures" / "new" / "allreduce.png"
    code, out, err = bench(
        capsys,
        "allreduce",
        MLP,
        "--max-bytes",
        "16",
        "--iters",
        "1",
        "--json",
        "--plot",
        str(figure),
        "--out",
        str(tmp_path / "runs"),
    )
    assert code == 0
    assert json.loads(out)["benchmark"] == "allreduce"  # stdout stays one JSON document
    assert f"plot: {figure}" in err and figure.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--min-bytes", "1M", "--max-bytes", "8"], "--max-bytes: got '8'"),
        (["--factor", "1"], "--factor: got '1'"),
        (["--min-bytes", "12XB"], "--min-bytes: got '12XB'"),
        (["--plot", "/proc/nope/a.png"], "--plot: got '/proc/nope/a.png'"),
        (["--plot", "figure.txt"], "--plot: got 'figure.txt'"),
    ],
)
def test_allreduce_refuses_bad_sizes_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    code, out, err = bench(capsys, "allreduce", MLP, "--out", str(tmp_path), *flags)
    assert code == 2 and out == ""
    assert err.startswith(f"convoy: error: {named}") and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing launched


@pytest.mark.ray
def test_allreduce_over_ray(
    tmp_path: Path, ray_session, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    code, out, _ = bench(
        capsys,
        "allreduce",
        MLP,
        "-o",
        "scaling.launcher=ray",
        "-o",
        "scaling.num_workers=2",
        "-o",
        "scaling.cpus_per_worker=0.5",
        "--max-bytes",
        "1K",
        "--iters",
        "2",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    result = json.loads(out[out.index("{") :])
    assert (result["world_size"], result["launcher"], result["backend"]) == (2, "ray", "gloo")
    assert len(result["rows"]) == 8 and result["wrong"] == 0
    assert result["avg_busbw_gbps"] > 0


def scaling_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, *flags: str) -> dict:  # type: ignore[type-arg]
    code, out, _ = bench(
        capsys,
        "scaling",
        MLP,
        "--workers",
        "1,2",
        "-o",
        "scaling.launcher=torchrun",
        "-o",
        "scaling.threads_per_worker=1",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--json",
        "--out",
        str(tmp_path),
        *flags,
    )
    assert code == 0
    return json.loads(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["strong", "weak"])
def test_scaling_one_and_two_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    result = scaling_json(capsys, tmp_path, "--mode", mode)
    sizes = {s["world_size"]: s for s in result["sizes"]}
    assert sorted(sizes) == [1, 2] and result["mode"] == mode
    if mode == "strong":  # the recipe's global batch of 32, split
        assert [sizes[n]["global_batch"] for n in (1, 2)] == [32, 32]
        assert [sizes[n]["per_worker_batch"] for n in (1, 2)] == [32, 16]
    else:  # the recipe's 32 over its 1 worker, per worker
        assert [sizes[n]["global_batch"] for n in (1, 2)] == [32, 64]
        assert result["per_worker_batch"] == 32
    for n, size in sizes.items():
        assert size["timed_steps"] == 3
        assert size["efficiency"] == pytest.approx(
            size["throughput"] / (n * sizes[1]["throughput"])
        )
        assert (
            size["step_seconds"]["p10"]
            <= size["step_seconds"]["median"]
            <= size["step_seconds"]["p90"]
        )
    assert sizes[1]["efficiency"] == 1.0
    assert "rank_step_seconds" in result["timing"]
    runs = Path(result["bench_dir"])
    assert sorted(p.name for p in runs.iterdir()) == ["n1", "n2"]
    assert not list(runs.glob("*/checkpoints/*"))  # no checkpoints


def test_strong_scaling_refuses_sizes_before_launching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = bench(
        capsys,
        "scaling",
        MLP,
        "--workers",
        "1,3,5",
        "--mode",
        "strong",
        "--out",
        str(tmp_path),
    )
    assert code == 2 and "--workers: got '1,3,5'" in err and "3, 5 do(es) not divide" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.ray
def test_scaling_refuses_what_the_cluster_cannot_place_before_any_run(
    tmp_path: Path,
    ray_session,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    code, _, err = bench(
        capsys,
        "scaling",
        MLP,
        "--workers",
        "1,8",
        "--mode",
        "weak",
        "-o",
        "scaling.launcher=ray",
        "--steps",
        "1",
        "--out",
        str(tmp_path),
    )
    assert code == 2 and "can place at most" in err
    assert not list(tmp_path.glob("*/n1"))  # the size that fits never ran


def test_compare_every_strategy_agrees_on_the_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = bench(
        capsys,
        "compare",
        MLP,
        "-o",
        "scaling.launcher=torchrun",
        "-o",
        "scaling.threads_per_worker=1",
        "--steps",
        "2",
        "--warmup",
        "3",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0
    result = json.loads(out)
    rows = {r["strategy"]: r for r in result["strategies"]}
    assert list(rows) == ["single", "ddp", "fsdp", "fsdp2", "hsdp"]
    assert [rows[s]["world_size"] for s in rows] == [1, 2, 2, 2, 2]
    assert result["losses_agree"], [r["first_losses"] for r in rows.values()]
    assert all(len(r["first_losses"]) == 5 for r in rows.values())
    psi = result["parameter_bytes"]
    assert psi > 0
    # hsdp on 2 workers: 2 replicas of a 1-rank shard group, an all-reduce between them.
    comm = [rows[s]["comm_bytes_per_step_per_rank"] for s in rows]
    assert comm == [0, psi, 1.5 * psi, 1.5 * psi, psi]
    assert all(r["timed_steps"] == 2 for r in rows.values())
