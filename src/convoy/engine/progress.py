"""Rank-0 progress: a live line on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
from typing import TextIO


class Progress:
    def __init__(self, total_steps: int, mode: str, enabled: bool, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.total = total_steps
        self.enabled = enabled and mode != "off"
        self.live = mode == "bar" or (mode == "auto" and self.stream.isatty())
        self._open_line = False

    def step(self, step: int, epoch: int, loss: float, lr: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        text = (
            f"[{bar}] step {step}/{self.total} epoch {epoch + 1} "
            f"loss {loss:.4f} lr {lr:.2e} {samples_per_s:,.0f} samples/s"
        )
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


def format_epoch(epoch: int, epochs: int, values: dict[str, float], seconds: float) -> str:
    """``epoch 3/20  train loss 0.12 acc 96.1%  val loss 0.10 acc 97.0% f1 0.969  (4.2s)``."""
    parts = [f"epoch {epoch + 1}/{epochs}"]
    for split in ("train", "val"):
        if f"{split}/loss" in values:
            parts.append(
                f"{split} loss {values[f'{split}/loss']:.4f} acc {100 * values[f'{split}/acc']:.1f}%"
                f" f1 {values[f'{split}/f1']:.3f}"
            )
    parts.append(f"({seconds:.1f}s)")
    return "  ".join(parts)
