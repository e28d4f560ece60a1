"""Fault injection (``fault`` config section): fail a chosen rank after a chosen step."""

from __future__ import annotations

import os
import signal
import sys

from convoy.config import FaultConfig


class InjectedFault(RuntimeError):
    """Raised by ``fault.kind: raise``."""


def maybe_inject(cfg: FaultConfig, step: int, rank: int, resumed: bool) -> None:
    """Fire the configured fault if this rank and step match (first attempt unless every)."""
    if cfg.kind == "none" or rank != cfg.rank or step != cfg.at_step:
        return
    if resumed and not cfg.every_attempt:
        return
    if cfg.kind == "raise":
        raise InjectedFault(f"fault injection: rank {rank} raised after step {step}")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
