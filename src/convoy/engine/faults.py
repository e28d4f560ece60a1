"""Fault injection (``fault`` config section): fail a chosen rank after a chosen step."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from convoy.config import FaultConfig
from convoy.distributed import all_gather_objects


class InjectedFault(RuntimeError):
    """Raised by ``fault.kind: raise``."""


def maybe_inject(cfg: FaultConfig, step: int, rank: int, attempt: int) -> None:
    """Fire the configured fault if this rank, step and attempt (1-based) match."""
    if cfg.kind == "none" or rank != cfg.rank or step != cfg.at_step:
        return
    if cfg.attempts and attempt > cfg.attempts:
        return
    if cfg.kind == "raise":
        raise InjectedFault(f"fault injection: rank {rank} raised after step {step}")
    if cfg.kind == "hang":
        while True:  # what a deadlocked rank looks like from outside
            time.sleep(3600)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def next_attempt(run_dir: Path, is_main: bool) -> int:
    """Count this start of the run (1 for the first); every rank gets rank 0's count."""
    counter = run_dir / ".attempts"
    attempt = 0
    if is_main:
        attempt = (int(counter.read_text()) if counter.exists() else 0) + 1
        run_dir.mkdir(parents=True, exist_ok=True)
        counter.write_text(str(attempt))
    return int(all_gather_objects(attempt)[0])
