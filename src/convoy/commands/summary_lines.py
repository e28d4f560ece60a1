"""The table ``convoy train`` prints at the end of a run: every metric of every split, then
the run's layout, step time, data wait, throughput, compute rate and memory, one line each."""

from __future__ import annotations

from typing import Any

from convoy.config import layout_name
from convoy.engine.progress import PERCENT_METRICS

# Metrics that count things: shown as integers, after the other columns.
COUNT_COLUMNS = ("samples", "tokens")


def format_summary(summary: dict[str, Any], run_dir: str) -> str:
    """The table printed at the end of ``convoy train``: every metric of every split, the
    data's reference figures (e.g. gzip's bits per byte) beside them."""
    metrics = dict(summary["metrics"])
    references = summary.get("reference_metrics") or {}
    columns = _metric_columns(metrics, references)
    lines = ["", f"{'split':<8}" + "".join(f"{c:>12}" for c in columns)]
    for split in ("train", "val", "test"):
        if f"{split}/loss" not in metrics:
            continue
        values = {**references, **metrics}
        cells = [_cell(column, values.get(f"{split}/{column}")) for column in columns]
        lines.append(f"{split:<8}" + "".join(cells))
    # A Lightning run's metrics keep the names the module logged (val_loss, test_acc).
    named = {key: value for key, value in metrics.items() if "/" not in key}
    if named:
        if len(lines) == 2:  # no split/name rows: drop their empty header
            lines = []
        lines += ["", f"{'metric':<16}{'value':>12}"]
        lines += [f"{key:<16}{value:>12.4f}" for key, value in named.items()]
    memory = ", ".join(f"{m / 2**20:,.0f}" for m in summary["peak_memory_bytes_per_rank"])
    step = summary["step_seconds_median"]
    lines += [
        "",
        f"{summary.get('task', 'classification')}: "
        f"{layout_name(summary['strategy'], summary.get('tp_size', 1))} x "
        f"{summary['world_size']} on {summary['launcher']}, "
        f"{summary['precision']}, {summary['steps']} steps",
        f"wall {summary['wall_seconds']:.1f} s | step {1000 * step:.1f} ms (median after "
        f"warm-up) | data wait {data_wait(summary)}"
        if step is not None
        else f"wall {summary['wall_seconds']:.1f} s",
        *rates_line(summary),
        f"peak memory per rank (MiB): {memory}",
    ]
    if summary.get("compile_seconds") is not None:
        lines.append(
            f"torch.compile: {summary['compile_seconds']:.1f} s compiling (not in the step times)"
        )
    throughput = throughput_line(summary)
    if throughput:
        lines.append(throughput)
    lines.append(f"run dir: {run_dir}")
    return "\n".join(lines)


def data_wait(summary: dict[str, Any]) -> str:
    """The data-wait fraction; with the first batch apart where it weighs (a pipeline's
    start is paid once, and a short run shows mostly that)."""
    whole = f"{100 * summary['data_wait_fraction']:.1f}%"
    first, after = summary.get("first_batch_seconds"), summary.get("data_wait_fraction_after_first")
    if first is None or after is None or summary["data_wait_fraction"] - after < 0.01:
        return whole
    return f"{whole} ({100 * after:.1f}% after the first batch, which took {first:.2f} s)"


def rates_line(summary: dict[str, Any]) -> list[str]:
    """``steady 13,900 samples/s | whole run 12,400 samples/s``: the median step's rate beside
    the whole run's (which counts the first steps and each epoch's start)."""
    count = "tokens" if "tokens_per_second" in summary else "samples"
    steady = summary.get(f"steady_{count}_per_second")
    whole = summary.get(f"{count}_per_second", summary.get("samples_per_second"))
    if whole is None:
        return []
    if steady is None:
        return [f"whole run {whole:,.0f} {count}/s"]
    return [f"steady {steady:,.0f} {count}/s (median step) | whole run {whole:,.0f} {count}/s"]


def throughput_line(summary: dict[str, Any]) -> str:
    """``compute: 5.76 GFLOP/sample | steady 0.22 TFLOP/s MFU 45.1% | whole run 0.18 TFLOP/s
    MFU 41.0% of 989 TFLOP/s per device (NVIDIA H100)``."""
    # torch's: imported when a table is printed, not when the CLI is built.
    from convoy.engine.flops import format_flops, format_throughput

    flops = summary.get("flops_per_sample")
    if flops is None or summary.get("tflops_per_second") is None:
        return ""
    device = summary.get("device_name", "cpu")
    text = format_throughput(summary["tflops_per_second"], summary.get("mfu"), device == "cpu")
    if summary.get("steady_tflops_per_second") is not None:
        steady = format_throughput(
            summary["steady_tflops_per_second"], summary.get("steady_mfu"), device == "cpu"
        )
        text = f"steady {steady} | whole run {text}"
    peak = summary.get("peak_flops_per_device")
    where = f" of {peak / 1e12:,.0f} TFLOP/s per device" if peak else ""
    return f"compute: {format_flops(flops, 'FLOP/sample')} | {text}{where} ({device})"


def _metric_columns(metrics: dict[str, float], references: dict[str, float]) -> list[str]:
    """Metric names in the order first seen (loss first, counts last), plus references."""
    names = dict.fromkeys(["loss"])
    for key in [*metrics, *references]:
        names.setdefault(key.partition("/")[2])
    ordered = [n for n in names if n not in COUNT_COLUMNS and n != "bytes"]
    return ordered + [n for n in COUNT_COLUMNS if n in names]


def _cell(column: str, value: float | None) -> str:
    if value is None:
        return f"{'-':>12}"
    if column in PERCENT_METRICS:
        return f"{100 * value:>11.2f}%"
    if column in COUNT_COLUMNS:
        return f"{int(value):>12}"
    return f"{value:>12.4f}"
