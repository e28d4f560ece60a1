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
    return [line.split() for line in text.splitlines() if line and not line.startswith("#")]


def test_allreduce_over_torchrun_prints_rows_and_footer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
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
    rows = data_rows(out)
    assert [int(r[0]) for r in rows] == [8 * 2**i for i in range(14)]  # 8 B .. 64 KiB
    for size, count, dtype, redop, time_us, algbw, busbw, wrong in rows:
        assert int(count) == int(size) // 4 and (dtype, redop, wrong) == ("float32", "sum", "0")
        assert float(time_us) > 0
        assert float(busbw) == pytest.approx(float(algbw), abs=1e-3)  # factor 1 for n = 2
    assert "2 rank(s) on 1 host(s) via torchrun, gloo on cpu" in out
    assert "# Out of bounds values : 0 OK" in out
    assert out.splitlines()[-1].startswith("# Avg bus bandwidth    : ")
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


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--min-bytes", "1M", "--max-bytes", "8"], "--max-bytes: got '8'"),
        (["--factor", "1"], "--factor: got '1'"),
        (["--min-bytes", "12XB"], "--min-bytes: got '12XB'"),
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
