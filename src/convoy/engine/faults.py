"""Fault injection (``fault`` config section): fail or slow a chosen rank from a chosen step."""

from __future__ import annotations

import os
import signal
import sys
import time

from convoy.config import FaultConfig
from convoy.distributed import all_gather_objects
from convoy.engine.stop import StopNotice, StopWatch
from convoy.storage import RunStorage

ATTEMPTS_FILE = ".attempts"


class InjectedFault(RuntimeError):
    """Raised by ``fault.kind: raise``."""


def maybe_inject(
    cfg: FaultConfig, step: int, rank: int, attempt: int, stop: StopWatch | None = None
) -> None:
    """Fire the configured fault if this rank, step and attempt (1-based) match."""
    if cfg.kind in ("none", "slow") or rank != cfg.rank or step != cfg.at_step:
        return
    if cfg.attempts and attempt > cfg.attempts:
        return
    if cfg.kind == "preempt":
        if stop is not None:
            now = time.time()
            source = f"an injected preemption notice ({cfg.deadline_s:g} s deadline)"
            stop.request(StopNotice(source, now, now + cfg.deadline_s))
        return
    if cfg.kind == "raise":
        raise InjectedFault(f"fault injection: rank {rank} raised after step {step}")
    if cfg.kind == "hang":
        while True:  # what a deadlocked rank looks like from outside
            time.sleep(3600)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow_down(cfg: FaultConfig, step: int, rank: int) -> None:
    """``kind: slow``: this rank takes ``slow_seconds`` longer on each step from ``at_step``
    on, inside the local work (before the forward), as a slower device or busier host would."""
    if cfg.kind == "slow" and rank == cfg.rank and step >= cfg.at_step:
        time.sleep(cfg.slow_seconds)


def next_attempt(storage: RunStorage, is_main: bool) -> int:
    """Count this start of the run (1 for the first); every rank gets rank 0's count."""
    attempt = 0
    if is_main:
        attempt = (
            int(storage.read_text(ATTEMPTS_FILE)) if storage.exists(ATTEMPTS_FILE) else 0
        ) + 1
        storage.write_text(ATTEMPTS_FILE, str(attempt))
    return int(all_gather_objects(attempt)[0])
