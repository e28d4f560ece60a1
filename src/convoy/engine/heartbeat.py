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
    """This rank's heartbeat: ``beat`` notes the step in memory (the loop calls it twice a
    step, so it must cost nothing), and a thread publishes the latest note to the board every
    ``publish_every_s`` when it changed. A record carries the time of its beat, not of its
    publication, so the watchdog judges staleness the same; a store round trip per beat
    (two a step, each waiting for rank 0's store thread on a busy machine) is gone."""

    def __init__(self, board: HeartbeatBoard, rank: int, publish_every_s: float = 0.5) -> None:
        self.board = board
        self.rank = rank
        self.publish_every_s = publish_every_s
        self.latest: tuple[int, int, float] | None = None
        self._published: tuple[int, int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, started: int, finished: int) -> None:
        self.latest = (started, finished, time.time())  # one assignment: atomic for the thread

    def publish(self) -> None:
        """Write the latest beat to the board if it is new."""
        latest = self.latest
        if latest is not None and latest is not self._published:
            started, finished, at = latest
            self.board.write(self.rank, {"started": started, "finished": finished, "time": at})
            self._published = latest

    def start(self) -> None:
        """Publish now, then every ``publish_every_s`` in a daemon thread until ``stop``."""
        self.publish()

        def run() -> None:
            while not self._stop.wait(self.publish_every_s):
                self.publish()

        self._thread = threading.Thread(target=run, name="convoy-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:  # bounded: a store whose host is gone may not answer
            self._thread.join(timeout=5.0)


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
    # Published well within the timeout, so a record is never stale for its publication lag.
    heartbeat = Heartbeat(board, rank, publish_every_s=min(0.5, timeout_s / 8))
    heartbeat.beat(step, step)
    heartbeat.start()
    barrier()  # every rank's first beat is recorded before anyone judges staleness
    stop = start_watchdog(board, world_size, timeout_s) if rank == 0 else None
    try:
        yield heartbeat
    finally:
        if stop is not None:
            stop.set()
        heartbeat.stop()


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
