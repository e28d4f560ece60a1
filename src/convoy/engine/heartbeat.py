"""Hang detection: per-rank heartbeats and a watchdog on rank 0.

Each rank records the step it last started and finished in the process group's key-value
store (the TCPStore every rank already reaches, on any node; a rank without peers keeps it in
memory). Rank 0's watchdog thread, which still runs while its main thread is blocked in a
collective, reads every rank's record. When one has not changed for ``run.hang_timeout_s`` it
names the stuck rank(s): those that have not started the step their peers are waiting in.
Then it ends the attempt, so the failure policy (Ray's ``max_failures``, torchrun's
``--max-restarts``) restarts it from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from convoy.distributed import barrier, exit_without_teardown, is_distributed

KEY_PREFIX = "convoy/heartbeat/rank"


class HeartbeatBoard:
    """Where heartbeat records go: the process group's store, or memory without peers."""

    def __init__(self) -> None:
        # The default store is private API, but the one every rank already shares: no extra
        # port, no shared file system, and a fresh one (or key prefix) per restarted attempt.
        self.store: Any = dist.distributed_c10d._get_default_store() if is_distributed() else None
        self.local: dict[int, str] = {}

    def write(self, rank: int, record: dict[str, float]) -> None:
        if self.store is None:
            self.local[rank] = json.dumps(record)
        else:
            self.store.set(f"{KEY_PREFIX}{rank}", json.dumps(record))

    def read(self, world_size: int) -> dict[int, dict[str, float]]:
        beats = {}
        for rank in range(world_size):
            key = f"{KEY_PREFIX}{rank}"
            if self.store is None:
                text = self.local.get(rank)
            else:
                text = self.store.get(key).decode() if self.store.check([key]) else None
            if text is not None:
                beats[rank] = json.loads(text)
        return beats


class Heartbeat:
    """This rank's heartbeat."""

    def __init__(self, board: HeartbeatBoard, rank: int) -> None:
        self.board = board
        self.rank = rank

    def beat(self, started: int, finished: int) -> None:
        record = {"started": started, "finished": finished, "time": time.time()}
        self.board.write(self.rank, record)


def diagnose(beats: dict[int, dict[str, float]], timeout_s: float, now: float) -> str | None:
    """A one-paragraph report if any rank is stale, else None."""
    stale = {r: b for r, b in beats.items() if now - b["time"] > timeout_s}
    if not stale:
        return None
    lowest = min(b["started"] for b in beats.values())
    stuck = sorted(r for r, b in beats.items() if b["started"] == lowest)
    if len(stuck) == len(beats):  # every rank at the same step: name the stale ones
        stuck = sorted(stale)
    age = max(now - beats[r]["time"] for r in stuck)
    details = ", ".join(f"rank {r} last finished step {int(beats[r]['finished'])}" for r in stuck)
    waiting = [r for r in beats if r not in stuck]
    others = (
        "; waiting for it in a collective: "
        + ", ".join(f"rank {r} (in step {int(beats[r]['started'])})" for r in waiting)
        if waiting
        else ""
    )
    return (
        f"convoy: hang detected: rank(s) {', '.join(map(str, stuck))} made no progress for "
        f"{age:.1f} s (run.hang_timeout_s={timeout_s:g}): {details}{others}. "
        "Ending this attempt so the failure policy can restart it."
    )


@contextlib.contextmanager
def hang_watch(
    rank: int, world_size: int, step: int, timeout_s: float | None
) -> Iterator[Heartbeat | None]:
    """Heartbeat for this rank (None when hang detection is off) and rank 0's watchdog."""
    if timeout_s is None:
        yield None
        return
    board = HeartbeatBoard()
    heartbeat = Heartbeat(board, rank)
    heartbeat.beat(step, step)
    barrier()  # every rank's first beat is recorded before anyone judges staleness
    stop = start_watchdog(board, world_size, timeout_s) if rank == 0 else None
    try:
        yield heartbeat
    finally:
        if stop is not None:
            stop.set()


def start_watchdog(board: HeartbeatBoard, world_size: int, timeout_s: float) -> threading.Event:
    """Run the watchdog in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(min(1.0, timeout_s / 4)):
            report = diagnose(board.read(world_size), timeout_s, time.time())
            if report is not None:
                print(report, flush=True)
                exit_without_teardown(1)

    threading.Thread(target=watch, name="convoy-watchdog", daemon=True).start()
    return stop
