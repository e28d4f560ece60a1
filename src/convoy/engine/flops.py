"""Throughput accounting: training FLOPs per sample, counted once, and MFU on a known GPU.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward, loss and
backward of a copy of the model built on the meta device, fed meta tensors shaped like the
first micro-batch, under ``FakeTensorMode``: nothing is computed or allocated, so any model
size costs milliseconds. A small model is counted on real CPU tensors instead (two rows of
the batch, the random state put back after): fake tensors import torch._dynamo and sympy,
1-2 CPU-s in every worker, for a count that takes a millisecond on real tensors.
The count covers matrix products and convolutions (what FlopCounterMode knows), not the
optimizer step or element-wise work, which is the convention MFU is quoted in (PaLM,
nanoGPT, TorchTitan).

MFU is achieved FLOP/s per device over the device's dense peak for the run's precision. The
peaks come from the vendors' datasheets (dense, not "with sparsity"; TorchTitan uses the same
bf16 figures). An unknown device, and every CPU, has no peak: MFU is then ``None`` and the
output says "unknown peak", never a guessed number.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from convoy.batches import batch_rows, first_rows, move_to, tensors_in
from convoy.dynamo_guard import defer_guard, defer_meta_guards


@dataclass(frozen=True)
class DevicePeak:
    """Dense peak FLOP/s of one accelerator, per precision."""

    bf16: float
    """bf16 and fp16 tensor-core dense peak."""
    tf32: float | None
    """fp32 matmuls run as TF32 (``torch.backends.cuda.matmul.allow_tf32``)."""
    fp32: float | None
    """Plain fp32 (CUDA cores), torch's default for fp32 matmuls; None where not published."""
    source: str


# Most specific name first: "H100 PCIe" must match before "H100".
DEVICE_PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    ("H100 PCIE", DevicePeak(756e12, 378e12, 51e12, "NVIDIA H100 PCIe datasheet")),
    ("H100 NVL", DevicePeak(835e12, 417.5e12, 60e12, "NVIDIA H100 NVL datasheet")),
    ("H100", DevicePeak(989e12, 494.5e12, 67e12, "NVIDIA H100 SXM datasheet")),
    ("H200", DevicePeak(989e12, 494.5e12, 67e12, "NVIDIA H200 SXM datasheet")),
    ("GH200", DevicePeak(989e12, 494.5e12, 67e12, "NVIDIA GH200 datasheet")),
    ("A100", DevicePeak(312e12, 156e12, 19.5e12, "NVIDIA A100 datasheet")),
    ("L40S", DevicePeak(362.05e12, 183e12, 91.6e12, "NVIDIA L40S datasheet")),
    ("B200", DevicePeak(2250e12, 1100e12, None, "NVIDIA HGX B200 datasheet, per GPU")),
)


def device_name(device: torch.device) -> str:
    """The accelerator's name, or ``cpu``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops(name: str, precision: str) -> float | None:
    """The device's dense peak FLOP/s for ``precision`` (fp32 / bf16 / fp16); None if unknown."""
    upper = name.upper()
    for pattern, peak in DEVICE_PEAKS:
        if pattern in upper:
            if precision in ("bf16", "fp16"):
                return peak.bf16
            return peak.tf32 if torch.backends.cuda.matmul.allow_tf32 else peak.fp32
    return None


def _on_meta(batch: Any) -> Any:
    return move_to(batch, torch.device("meta"))


# A model this small runs on real CPU tensors (the FLOP count here, the driver's check in
# ``convoy.preflight``): on the meta device PyTorch's Python decompositions and fake tensors
# import torch._dynamo and sympy, seconds of CPU for what takes milliseconds for real.
REAL_RUN_MAX_BYTES = 64 * 2**20  # parameters and buffers
REAL_RUN_MAX_INPUT_ELEMENTS = 2**16  # the inputs of the rows run
REAL_COUNT_ROWS = 2


def count_train_flops_per_sample(
    build: Callable[[], nn.Module],
    forward: Callable[[nn.Module, Any], Any],
    loss_sum: Callable[[Any, Any], torch.Tensor],
    batch: tuple[Any, Any],
) -> float:
    """FLOPs of one training step (forward, loss, backward) per sample of ``batch``.

    ``build`` makes the model; it is called under the meta device, and again on the CPU for
    a small model (the random state is restored). Raises whatever the model raises when it
    cannot run on meta tensors (one that reads values, e.g. ``.item()``).
    """
    inputs, targets = batch
    # FlopCounterMode's dispatch and the meta device's kernels are guarded against Dynamo,
    # guards that import Dynamo.
    defer_meta_guards()
    defer_guard(_FlopCounterMode.__dict__["__torch_dispatch__"])
    with torch.device("meta"):
        model = build()
    few = first_rows(inputs, REAL_COUNT_ROWS)
    if small_enough_to_run(model, few):
        cpu = torch.device("cpu")
        # The math attention: the CPU's fused kernel has no FLOP formula in FlopCounterMode;
        # the math one is matrix products, counted as the fused kernels are on meta.
        with torch.random.fork_rng(devices=[]), sdpa_kernel(SDPBackend.MATH):
            counted = _count(
                build(),
                forward,
                loss_sum,
                move_to(few, cpu),
                move_to(first_rows(targets, REAL_COUNT_ROWS), cpu),
            )
        return counted / max(1, batch_rows(few))
    # Fake tensors over the meta model: a model that branches on a value only where it is not
    # being traced (transformers' mask helpers) takes its traced path and runs.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        counted = _count(model, forward, loss_sum, _on_meta(inputs), _on_meta(targets))
    return counted / max(1, batch_rows(inputs))


def _count(
    model: nn.Module,
    forward: Callable[[nn.Module, Any], Any],
    loss_sum: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        loss_sum(forward(model, inputs), targets).backward()
    return float(counter.get_total_flops())


def small_enough_to_run(model: nn.Module, inputs: Any) -> bool:
    """Whether ``model`` (built on any device) on ``inputs`` is cheap to run on the CPU."""
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    input_elements = sum(t.numel() for t in tensors_in(inputs))
    return model_bytes <= REAL_RUN_MAX_BYTES and input_elements <= REAL_RUN_MAX_INPUT_ELEMENTS


def mfu(flops_per_second_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None without a known peak."""
    return None if peak is None else flops_per_second_per_device / peak


SI_PREFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def format_flops(flops: float, unit: str = "FLOP/s") -> str:
    """``1.36e9`` -> ``1.36 GFLOP/s``: the largest prefix up to T that keeps the value >= 0.1, so a
    small model's rate reads as a number, not ``0.00 TFLOP/s``."""
    for prefix, scale in SI_PREFIXES:
        if abs(flops) >= 0.1 * scale:
            return f"{flops / scale:,.2f} {prefix}{unit}"
    return f"{flops:,.2f} {unit}"


def format_throughput(tflops: float | None, utilisation: float | None, on_cpu: bool) -> str:
    """``12.3 TFLOP/s MFU 41.2%``, ``1.36 GFLOP/s`` on CPU, ``... (unknown peak)`` elsewhere
    (``tflops`` is in TFLOP/s; the text takes the prefix that shows it)."""
    if tflops is None:
        return ""
    text = format_flops(tflops * 1e12)
    if utilisation is not None:
        return f"{text} MFU {100 * utilisation:.1f}%"
    return text if on_cpu else f"{text} (unknown peak)"
