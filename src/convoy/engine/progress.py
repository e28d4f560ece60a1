"""Rank-0 progress: a live line on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

PERCENT_METRICS = ("acc", "top5")


class Progress:
    def __init__(self, total_steps: int, mode: str, enabled: bool, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.enabled = enabled and mode != "off"
        self.live = mode == "bar" or (mode == "auto" and self.stream.isatty())
        self._open_line = False

    def step(
        self,
        step: int,
        epoch: int,
        loss: float,
        lr: float,
        rate: tuple[float, str],
        extra: str = "",
    ) -> None:
        """One step's line; ``rate`` is (units per second, unit name); ``extra`` is appended
        (achieved TFLOP/s and MFU)."""
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        per_second, unit = rate
        text = (
            f"[{bar}] step {step}/{self.total} epoch {epoch + 1} "
            f"loss {loss:.4f} lr {lr:.2e} {per_second:,.0f} {unit}/s"
        )
        if extra:
            text += f" {extra}"
        if self.live:
            self.stream.write("\r" + text)
            self._open_line = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()


def format_metric(name: str, value: float) -> str:
    """``acc 96.1%``, ``loss 0.1234``, ``ppl 12.3``."""
    if name in PERCENT_METRICS:
        return f"{name} {100 * value:.1f}%"
    if abs(value) >= 100:
        return f"{name} {value:,.1f}"
    return f"{name} {value:.4f}"


def format_epoch(
    epoch: int, epochs: int, values: dict[str, float], seconds: float, shown: Sequence[str]
) -> str:
    """``epoch 3/20  train loss 0.1200 acc 96.1%  val loss 0.1000 acc 97.0%  (4.2s)``; metrics
    not named ``split/name`` follow as they are named."""
    parts = [f"epoch {epoch + 1}/{epochs}"]
    for split in ("train", "val"):
        if f"{split}/loss" not in values:
            continue
        shown = [
            format_metric(name, values[f"{split}/{name}"])
            for name in ("loss", *shown)
            if f"{split}/{name}" in values
        ]
        parts.append(f"{split} " + " ".join(shown))
    # Metrics named by the user rather than split/name (a LightningModule's self.log names).
    own = [format_metric(name, value) for name, value in sorted(values.items()) if "/" not in name]
    if own:
        parts.append(" ".join(own))
    parts.append(f"({seconds:.1f}s)")
    return "  ".join(parts)
