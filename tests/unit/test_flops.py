"""FLOPs per sample on the meta device, device peaks, and how throughput is shown."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from convoy.engine.flops import (
    count_train_flops_per_sample,
    format_throughput,
    mfu,
    peak_flops,
)
from convoy.models.registry import build_model
from convoy.tasks import build_task


def test_mlp_flops_match_the_hand_count() -> None:
    a, b, c, batch = 16, 32, 4, 8
    task = build_task("classification", {})
    inputs, targets = torch.randn(batch, a), torch.randint(0, c, (batch,))

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))

    per_sample = count_train_flops_per_sample(build, task.forward, task.loss_sum, (inputs, targets))
    # Forward 2ab + 2bc; backward: the first layer needs only its weight grad (2ab), the
    # second its weight and input grads (4bc).
    assert per_sample == 2 * a * b + 2 * b * c + 2 * a * b + 4 * b * c


def test_course_vit_counts_its_analytic_flops() -> None:
    """vit_course (32 px, patch 4, 12 x 384/768): 1.92 GFLOP forward, 3x for training."""
    task = build_task("classification", {})
    shape = {"channels": 3, "image_size": 32, "num_classes": 10}
    batch = (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    per_image = count_train_flops_per_sample(
        lambda: build_model("vit_course", {}, shape), task.forward, task.loss_sum, batch
    )
    layers, tokens, hidden, mlp, patches = 12, 65, 384, 768, 64
    forward = (
        layers * (2 * tokens * (4 * hidden**2 + 2 * hidden * mlp) + 4 * tokens**2 * hidden)
        + 2 * patches * (3 * 4 * 4) * hidden
        + 2 * hidden * 10
    )
    assert per_image == pytest.approx(3 * forward, rel=1e-3)


def test_counting_leaves_the_random_state_alone() -> None:
    task = build_task("language_modeling", {})
    shape = {"vocab_size": 512, "seq_len": 16}
    batch = (torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16)))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    count_train_flops_per_sample(
        lambda: build_model("gpt_tiny", {}, shape), task.forward, task.loss_sum, batch
    )
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "fp16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
        ("NVIDIA B200", "fp32", None),
        ("NVIDIA GeForce RTX 3090", "bf16", None),
        ("cpu", "fp32", None),
    ],
)
def test_device_peaks(name: str, precision: str, expected: float | None) -> None:
    assert peak_flops(name, precision) == expected


def test_throughput_text_never_invents_a_peak() -> None:
    assert mfu(494.5e12, 989e12) == pytest.approx(0.5)
    assert mfu(1e12, None) is None
    assert format_throughput(494.5, 0.5, on_cpu=False) == "494.50 TFLOP/s MFU 50.0%"
    assert format_throughput(0.18, None, on_cpu=True) == "0.18 TFLOP/s"
    assert format_throughput(12.0, None, on_cpu=False) == "12.00 TFLOP/s (unknown peak)"
    assert format_throughput(None, None, on_cpu=True) == ""


def test_a_small_models_rate_reads_as_a_number() -> None:
    from convoy.commands.summary_lines import throughput_line
    from convoy.engine.flops import format_flops

    # digits_mlp on CPU: 0.0014 TFLOP/s used to print as "0.00 TFLOP/s".
    assert format_throughput(0.0013620315495432498, None, on_cpu=True) == "1.36 GFLOP/s"
    assert format_flops(138752.0, "FLOP/sample") == "0.14 MFLOP/sample"
    assert format_flops(5.76e9, "FLOP/sample") == "5.76 GFLOP/sample"
    assert format_flops(12.0) == "12.00 FLOP/s"
    line = throughput_line(
        {"flops_per_sample": 138752.0, "tflops_per_second": 0.00136, "device_name": "cpu"}
    )
    assert line == "compute: 0.14 MFLOP/sample | 1.36 GFLOP/s (cpu)"


def test_the_summary_names_the_steady_rate_and_the_whole_runs() -> None:
    from convoy.commands.summary_lines import rates_line, throughput_line

    summary = {
        "samples_per_second": 216.0,
        "tokens_per_second": 221_000.0,
        "steady_samples_per_second": 269.0,
        "steady_tokens_per_second": 275_600.0,
        "flops_per_sample": 0.875e12,
        "tflops_per_second": 189.0,
        "mfu": 0.191,
        "steady_tflops_per_second": 235.4,
        "steady_mfu": 0.238,
        "peak_flops_per_device": 989e12,
        "device_name": "NVIDIA H100 80GB HBM3",
    }
    assert rates_line(summary) == [
        "steady 275,600 tokens/s (median step) | whole run 221,000 tokens/s"
    ]
    assert throughput_line(summary) == (
        "compute: 0.88 TFLOP/sample | steady 235.40 TFLOP/s MFU 23.8% | whole run 189.00 "
        "TFLOP/s MFU 19.1% of 989 TFLOP/s per device (NVIDIA H100 80GB HBM3)"
    )
    # A run without steady figures (Lightning's) shows the whole run's rate alone.
    assert rates_line({"samples_per_second": 100.0}) == ["whole run 100 samples/s"]
