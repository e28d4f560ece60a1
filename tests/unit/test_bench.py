"""Benchmarks' arithmetic and input checks: no process group."""

from __future__ import annotations

import pytest

from convoy.bench import allreduce
from convoy.bench.common import (
    format_bytes,
    load_job_without_data,
    parse_int_list,
    parse_size,
    quantile,
    spread,
)
from convoy.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8", 8),
        ("64K", 65536),
        ("64k", 65536),
        ("32M", 32 * 2**20),
        ("32MiB", 32 * 2**20),
        ("1G", 2**30),
        ("1GB", 2**30),
        ("512B", 512),
        (" 4 K ", 4096),
    ],
)
def test_sizes_parse_in_binary_units(text: str, expected: int) -> None:
    assert parse_size(text, "--max-bytes") == expected


@pytest.mark.parametrize("text", ["12XB", "", "-8", "1.5M", "M", "8 bytes"])
def test_bad_sizes_name_the_flag_and_the_forms(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, "--min-bytes")
    message = str(info.value)
    assert message.startswith("--min-bytes: got")
    assert "32M" in message and "K = 1024" in message


def test_sweep_doubles_from_min_to_max_inclusive() -> None:
    assert allreduce.size_sweep(8, 64, 2) == [8, 16, 32, 64]
    assert allreduce.size_sweep(8, 100, 4) == [8, 32]
    sweep = allreduce.make_sweep("8", "32M", "2", 20, 5, "float32")
    assert sweep.sizes[0] == 8 and sweep.sizes[-1] == 32 * 2**20 and len(sweep.sizes) == 23


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("1M", "8", "2"), "--max-bytes"),  # min > max
        (("8", "1M", "1"), "--factor"),
        (("8", "1M", "x"), "--factor"),
        (("12XB", "1M", "2"), "--min-bytes"),
        (("8", "1Q", "2"), "--max-bytes"),
        (("2", "1M", "2"), "--min-bytes"),  # less than one float32
    ],
)
def test_bad_sweeps_are_refused_naming_the_flag(args: tuple[str, str, str], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        allreduce.make_sweep(*args, 20, 5, "float32")
    assert info.value.field == flag


def test_bad_dtype_and_counts_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"--dtype: got 'float8'.*'bfloat16'"):
        allreduce.make_sweep("8", "1M", "2", 20, 5, "float8")
    with pytest.raises(ConfigError, match="--iters"):
        allreduce.make_sweep("8", "1M", "2", 0, 5, "float32")
    with pytest.raises(ConfigError, match="--warmup"):
        allreduce.make_sweep("8", "1M", "2", 20, -1, "float32")


def test_bus_bandwidth_factor_and_units() -> None:
    assert allreduce.busbw_factor(1) == 0
    assert allreduce.busbw_factor(2) == 1
    assert allreduce.busbw_factor(8) == pytest.approx(1.75)
    # 32 MiB in 1 ms: 33.554 GB/s (GB = 1e9 B)
    assert allreduce.algbw_gbps(32 * 2**20, 1e-3) == pytest.approx(33.554432)


def row(size: int, busbw: float | None) -> dict[str, object]:
    return {
        "size_bytes": size,
        "count": size // 4,
        "type": "float32",
        "redop": "sum",
        "time_us": 10.0,
        "algbw_gbps": 1.0,
        "busbw_gbps": busbw,
        "wrong": 0,
    }


def result(world_size: int, rows: list[dict[str, object]]) -> dict[str, object]:
    busbws = [r["busbw_gbps"] for r in rows if r["busbw_gbps"] is not None]
    return {
        "world_size": world_size,
        "hosts": 1,
        "launcher": "torchrun",
        "backend": "gloo",
        "device": "cpu",
        "torch": "2.x",
        "iters": 20,
        "warmup": 5,
        "dtype": "float32",
        "busbw_factor": allreduce.busbw_factor(world_size),
        "rows": rows,
        "wrong": 0,
        "avg_busbw_gbps": sum(busbws) / len(busbws) if busbws else None,
    }  # type: ignore[arg-type]


def test_table_has_nccl_tests_shape_and_states_the_formula() -> None:
    text = allreduce.format_table(result(4, [row(8, 1.5), row(16, 2.5)]))
    lines = text.splitlines()
    assert "busbw = algbw x 2(n-1)/n = algbw x 1.500 (n = 4)" in text
    assert "in-place only" in text
    assert any(line.split()[:2] == ["#", "size"] for line in lines)
    data = [line.split() for line in lines if not line.startswith("#")]
    assert [d[:4] for d in data] == [["8", "2", "float32", "sum"], ["16", "4", "float32", "sum"]]
    assert lines[-1] == "# Avg bus bandwidth    : 2.000 GB/s (mean over 2 sizes)"


def test_one_rank_says_busbw_is_not_applicable() -> None:
    text = allreduce.format_table(result(1, [row(8, None)]))
    assert "factor 2(n-1)/n is 0" in text
    assert text.splitlines()[-1].startswith("# Avg bus bandwidth    : n/a")
    assert "n/a" in next(line for line in text.splitlines() if not line.startswith("#"))


def test_quantiles_interpolate() -> None:
    values = [float(v) for v in range(1, 12)]  # 1..11
    assert quantile(values, 0.5) == 6
    assert quantile(values, 0.1) == 2
    assert spread(values) == {"median": 6, "p10": 2, "p90": 10}


def test_int_lists() -> None:
    assert parse_int_list("1,2,4", "--workers") == [1, 2, 4]
    for bad in ("1,x", "0,2", "2,2", ""):
        with pytest.raises(ConfigError, match="--workers"):
            parse_int_list(bad, "--workers")


def test_format_bytes() -> None:
    assert [format_bytes(s) for s in (8, 2048, 32 * 2**20, 1.5 * 2**30)] == [
        "8 B",
        "2 KiB",
        "32 MiB",
        "1.5 GiB",
    ]


def test_allreduce_job_ignores_a_batch_that_does_not_split() -> None:
    # The default recipe's batch (32) does not split over 3 workers; all-reduce needs no batch.
    job = load_job_without_data(None, ["scaling.num_workers=3", "scaling.launcher=torchrun"])
    assert job.scaling.num_workers == 3
    with pytest.raises(ConfigError, match=r"scaling\.launcher"):
        load_job_without_data(None, ["scaling.launcher=mpi"])
