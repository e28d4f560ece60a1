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


def test_efficiency_from_global_throughput() -> None:
    from convoy.bench.scaling import efficiencies

    # Weak scaling with flat step time doubles X: E = 100%, not the 1/N step times would say.
    assert efficiencies({1: 100.0, 2: 200.0, 4: 300.0}) == {1: 1.0, 2: 1.0, 4: 0.75}
    # Without a size 1, the smallest is the baseline, per worker.
    assert efficiencies({2: 200.0, 4: 200.0}) == {2: 1.0, 4: 0.5}


def test_strong_scaling_names_every_size_that_does_not_divide_the_batch() -> None:
    from convoy.bench.scaling import check_strong_split, global_batches

    check_strong_split([1, 2, 4], 32, 1, "1,2,4")
    with pytest.raises(ConfigError) as info:
        check_strong_split([1, 3, 5, 8], 32, 1, "1,3,5,8")
    assert info.value.field == "--workers" and "3, 5 do(es) not divide" in str(info.value)
    assert global_batches("weak", [1, 2, 4], 32, 16) == {1: 16, 2: 32, 4: 64}
    assert global_batches("strong", [1, 2, 4], 32, 16) == {1: 32, 2: 32, 4: 32}


def test_communication_volume_per_strategy() -> None:
    from convoy.bench.compare import comm_factor
    from convoy.config import load_job

    def factor(strategy: str, n: int, *extra: str) -> float:
        job = load_job(None, [f"strategy.name={strategy}", "scaling.num_workers=1", *extra])
        return comm_factor(job.strategy, n)

    assert factor("single", 1) == 0
    assert factor("ddp", 2) == 1.0 and factor("ddp", 8) == pytest.approx(1.75)  # 2(n-1)/n
    assert factor("fsdp", 4) == pytest.approx(2.25)  # 3(n-1)/n, full shard
    assert factor("fsdp2", 4) == pytest.approx(2.25)
    assert factor("fsdp2", 4, "strategy.reshard_after_forward=false") == pytest.approx(1.5)
    assert factor("fsdp", 4, "strategy.sharding=shard_grad_op") == pytest.approx(1.5)
    assert factor("ddp", 1) == 0
    # tp 2 on 4: fsdp2 over 2 data-parallel ranks, each moving its half: 3 (2-1)/2 / 2.
    split = ["strategy.tp_size=2", "scaling.num_workers=4", "scaling.launcher=torchrun"]
    assert factor("fsdp2", 4, *split) == pytest.approx(0.75)


def test_loss_gap_and_strategy_names() -> None:
    from convoy.bench.compare import loss_gap, parse_strategies

    assert loss_gap([2.0, 1.0], [2.0, 1.0]) == 0
    assert loss_gap([2.0, 1.1], [2.0, 1.0]) == pytest.approx(0.1)
    assert loss_gap([2.0], [2.0, 1.0]) is None  # fewer steps than the reference
    assert parse_strategies("single, ddp") == ["single", "ddp"]
    layouts = "fsdp2,fsdp2+ac,fsdp2+ac+compile,hsdp+compile,fsdp2+tp2,hsdp+tp2+ac"
    assert parse_strategies(layouts) == layouts.split(",")
    bad_layouts = ("ddp,zero3", "ddp,ddp", "", "fsdp2+tp", "ddp+ac+ac", "zero3+ac")
    for bad in (*bad_layouts, "ddp+tp2", "fsdp2+tp0", "fsdp2+tp2+tp4"):
        with pytest.raises(ConfigError, match="--strategies"):
            parse_strategies(bad)


def test_step_times_skip_warmup_and_take_the_slowest_rank() -> None:
    from convoy.bench.runs import RANK_TIMING, RECORD_TIMING, step_times

    records = [
        {"step": s, "time": 10.0 + s * 0.5, "rank_step_seconds": [0.1 * s, 0.2 * s]}
        for s in range(1, 6)
    ]
    times, how = step_times(records, warmup=2)
    assert how == RANK_TIMING and times == pytest.approx([0.6, 0.8, 1.0])
    for record in records:
        del record["rank_step_seconds"]
    times, how = step_times(records, warmup=2)
    assert how == RECORD_TIMING and times == pytest.approx([0.5, 0.5, 0.5])


def test_compare_table_says_when_losses_disagree() -> None:
    from convoy.bench.compare import format_report

    def row(strategy: str, agrees: bool, gap: float) -> dict[str, object]:
        return {
            "strategy": strategy,
            "world_size": 2,
            "samples_per_second": 100.0,
            "step_seconds": {"median": 0.01, "p10": 0.009, "p90": 0.012},
            "peak_memory_bytes_per_rank": None,
            "peak_memory_source": "n/a",
            "comm_factor": 1.0,
            "comm_bytes_per_step_per_rank": 1024.0,
            "loss_agrees": agrees,
            "loss_max_relative_gap": gap,
        }

    result = {
        "model": "mlp",
        "data": "digits",
        "launcher": "torchrun",
        "precision": "fp32",
        "global_batch": 32,
        "seed": 0,
        "backend": "gloo",
        "device": "cpu",
        "torch": "2.x",
        "timed_steps": 2,
        "warmup_steps": 3,
        "parameter_bytes": 1024,
        "loss_steps": 5,
        "loss_reference": "ddp",
        "loss_rtol": 1e-4,
        "timing": "t",
        "bench_dir": "d",
        "losses_agree": False,
        "strategies": [row("ddp", True, 0.0), row("fsdp2", False, 0.02)],
    }
    text = format_report(result)
    assert "LOSSES DISAGREE" in text
    assert (
        "| fsdp2 | 2 | 10.0 | 12.0 | 100 | n/a | 1 KiB (1.00 psi) | DIFFER (max rel. gap 2.0e-02) |"
        in text
    )


def test_compare_counts_what_trains_under_lora() -> None:
    """With ``model.lora`` the compared model has its adapters: every parameter in psi,
    the adapters as what trains; ddp's all-reduce is counted in their bytes alone."""
    pytest.importorskip("peft")
    from convoy.bench.compare import _lora_lines, _parameters, gradient_psi, parameter_sizes
    from convoy.config import load_job

    base = ["data.batch_size=8", "model.kwargs={dropout: 0.0, depth: 2, hidden: 32, heads: 2}"]
    job = load_job("recipes/lm_tiny.yaml", [*base, "model.lora={r: 2, target_modules: [q, v]}"])
    sizes, plain = parameter_sizes(job), parameter_sizes(load_job("recipes/lm_tiny.yaml", base))
    assert sizes is not None and plain is not None
    adapters = 2 * 2 * (2 * 32 + 32 * 2)  # blocks x (q, v) x (A 2 x 32 + B 32 x 2)
    assert (sizes.trainable_count, sizes.count) == (adapters, plain.count + adapters)
    assert (sizes.trainable_bytes, sizes.bytes) == (4 * adapters, 4 * sizes.count)
    assert plain.trainable_count == plain.count
    ddp = job.model_copy(update={"strategy": load_job(None, ["strategy.name=ddp"]).strategy})
    fsdp2 = job.model_copy(update={"strategy": load_job(None, ["strategy.name=fsdp2"]).strategy})
    assert (gradient_psi(ddp, sizes), gradient_psi(fsdp2, sizes)) == (4 * adapters, sizes.bytes)
    result = _parameters(job, sizes)
    line = "".join(_lora_lines(result))
    assert f"{adapters:,} of {sizes.count:,} parameters train" in line
    assert line.startswith("LoRA r=2 on q, v") and "upper bound" in line
    assert _lora_lines(_parameters(load_job("recipes/lm_tiny.yaml", base), plain)) == []


def _namespace(tmp_path: object, **fields: object) -> object:
    import argparse

    defaults: dict[str, object] = {
        "recipe": None,
        "override": ["scaling.launcher=torchrun"],
        "steps": 2,
        "warmup": 1,
        "out": str(tmp_path),
        "workers": 2,
        "strategies": "single,ddp",
        "loss_rtol": 1e-4,
        "mode": "weak",
        "per_worker_batch": None,
    }
    return argparse.Namespace(**{**defaults, **fields})


def test_plot_path_is_checked_before_anything_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench.plots import check_plot_path

    with pytest.raises(ConfigError, match=r"--plot: got .*this is a folder"):
        check_plot_path(str(tmp_path))
    with pytest.raises(ConfigError, match=r"--plot: got .*ending in \.png"):
        check_plot_path(str(tmp_path / "figure.txt"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--plot: got .*file/sub/a\.png'.*not a writable"):
        check_plot_path(str(tmp_path / "file" / "sub" / "a.png"))
    check_plot_path(str(tmp_path / "new" / "dir" / "a.png"))  # a missing folder is fine...
    assert not (tmp_path / "new").exists()  # ...and the check leaves nothing behind


def test_plot_into_a_missing_folder_creates_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench import plots

    plt = plots.pyplot()
    figure, _ = plt.subplots()
    path = tmp_path / "a" / "b" / "figure.png"
    assert plots.save(figure, str(path)) == str(path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_out_folder_is_checked_and_nothing_is_left_behind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench.common import bench_storage
    from convoy.config import load_job
    from convoy.storage import check_writable_dir as check_out_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out: got .*is a file"):
        check_out_dir(str(tmp_path / "file"), "--out")
    with pytest.raises(ConfigError, match=r"--out: got .*not a writable folder"):
        check_out_dir(str(tmp_path / "file" / "x"), "--out")
    with pytest.raises(ConfigError, match=r"run\.storage_dir: got .*/proc/nope.*cannot create"):
        bench_storage(load_job(None, ["run.storage_dir=/proc/nope"]), None)
    check_out_dir(str(tmp_path / "a" / "b"), "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_unknown_and_repeated_strategies_are_named() -> None:
    from convoy.bench.compare import parse_strategies

    with pytest.raises(ConfigError, match=r"unknown 'fsdp3' \(did you mean 'fsdp'\?\)"):
        parse_strategies("ddp,fsdp3")
    with pytest.raises(ConfigError, match=r"; ddp repeated;"):
        parse_strategies("ddp,single,ddp")


def test_compare_refuses_a_negative_loss_tolerance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench.compare import make_plan

    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match=r"--loss-rtol: got"):
            make_plan(_namespace(tmp_path, loss_rtol=bad))  # type: ignore[arg-type]


def test_compare_gives_other_strategies_a_fresh_section(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The course recipe's fsdp2-only ``reshard_after_forward`` stays with fsdp2: single and
    ddp would refuse it as an unknown key."""
    from pathlib import Path

    from convoy.bench.compare import make_plan
    from convoy.config import load_job

    recipe = str(Path(__file__).resolve().parents[2] / "recipes/course_vit_synthetic.yaml")
    plan = make_plan(
        _namespace(
            tmp_path,
            recipe=recipe,
            strategies="single,ddp,fsdp2",
            override=["strategy.reshard_after_forward=false"],
        )  # type: ignore[arg-type]
    )
    assert [job.strategy.name for job in plan.jobs.values()] == ["single", "ddp", "fsdp2"]
    assert plan.jobs["fsdp2"].strategy.reshard_after_forward is False  # the recipe's options
    assert plan.jobs["ddp"].strategy == load_job(None, ["strategy.name=ddp"]).strategy


def test_world_size_errors_name_the_workers_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench import compare, scaling

    # The default recipe's batch (64) does not split over 3 workers.
    with pytest.raises(ConfigError) as info:
        compare.make_plan(_namespace(tmp_path, workers=3, strategies="ddp"))  # type: ignore[arg-type]
    assert info.value.field == "--workers" and "data.batch_size = 64" in str(info.value)
    # The local launcher runs one worker.
    with pytest.raises(ConfigError) as info:
        scaling.make_plan(
            _namespace(
                tmp_path,
                workers="1,2",
                override=["scaling.launcher=local", "scaling.num_workers=1"],
            )  # type: ignore[arg-type]
        )
    assert info.value.field == "--workers" and "'local' launcher" in str(info.value)
    assert not any(tmp_path.iterdir())


def test_per_worker_batch_zero_is_refused_not_replaced(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.bench.scaling import make_plan

    with pytest.raises(ConfigError, match=r"--per-worker-batch: got 0"):
        make_plan(_namespace(tmp_path, workers="1,2", per_worker_batch=0))  # type: ignore[arg-type]


def test_scaling_report_flags_efficiency_above_ideal() -> None:
    from convoy.bench.scaling import format_report

    def size(n: int, x: float, e: float) -> dict[str, object]:
        times = {"median": 0.1, "p10": 0.1, "p90": 0.1}
        return {
            "world_size": n,
            "per_worker_batch": 16,
            "global_batch": 16 * n,
            "throughput": x,
            "ideal_throughput": n * 100.0,
            "step_seconds": times,
            "efficiency": e,
        }

    result = {
        "mode": "weak",
        "model": "gpt_tiny",
        "data": "text",
        "strategy": "ddp",
        "launcher": "torchrun",
        "precision": "fp32",
        "per_worker_batch": 16,
        "backend": "gloo",
        "device": "cpu",
        "torch": "2.x",
        "timed_steps": 5,
        "warmup_steps": 1,
        "count_name": "tokens",
        "baseline_workers": 1,
        "timing": "t",
        "bench_dir": "d",
        "sizes": [size(1, 100.0, 1.0), size(2, 190.0, 0.95), size(3, 1460.0, 4.87)],
    }
    text = format_report(result)
    assert "note: efficiency above 110% at N = 3:" in text
    assert "threads_per_worker" in text
    result["sizes"] = result["sizes"][:2]  # type: ignore[index]
    assert "note:" not in format_report(result)


@pytest.mark.parametrize("benchmark", ["allreduce", "scaling", "compare"])
def test_help_is_wrapped_and_every_option_explained(
    benchmark: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from convoy.cli import main

    with pytest.raises(SystemExit):
        main(["bench", benchmark, "--help"])
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "--max-\n" not in out
    if benchmark == "scaling":
        assert "weak: per-worker batch fixed" in out


def test_threads_per_worker_are_held_fixed_across_sizes(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """1 worker would otherwise get every core and 2 workers half each: not like for like."""
    from convoy.bench import compare, scaling

    monkeypatch.setattr("convoy.distributed.usable_cpus", lambda: 8.0)
    plan = scaling.make_plan(
        _namespace(tmp_path, workers="1,2,4", override=["scaling.launcher=torchrun"])  # type: ignore[arg-type]
    )
    assert {job.scaling.threads_per_worker for job in plan.jobs.values()} == {2}
    plan = compare.make_plan(
        _namespace(
            tmp_path, workers=2, strategies="single,ddp", override=["scaling.launcher=torchrun"]
        )  # type: ignore[arg-type]
    )
    assert {job.scaling.threads_per_worker for job in plan.jobs.values()} == {4}
    # The user's own count, and Ray's per-worker CPUs, are left alone.
    plan = scaling.make_plan(
        _namespace(
            tmp_path,
            workers="1,2",
            override=["scaling.launcher=torchrun", "scaling.threads_per_worker=3"],
        )  # type: ignore[arg-type]
    )
    assert {job.scaling.threads_per_worker for job in plan.jobs.values()} == {3}
    plan = scaling.make_plan(
        _namespace(tmp_path, workers="1,2", override=["scaling.launcher=ray"])  # type: ignore[arg-type]
    )
    assert {job.scaling.threads_per_worker for job in plan.jobs.values()} == {None}
