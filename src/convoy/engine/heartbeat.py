"""Hang detection: per-rank heartbeats and a watchdog on rank 0.

Each rank records, in ``<run>/heartbeats/rank<R>.json``, the step it last started and
finished. Rank 0's watchdog thread, which still runs while its main thread is blocked in a
collective, checks every rank's file. When one has not changed for ``run.hang_timeout_s`` it
names the stuck rank(s): those that have not started the step their peers are waiting in.
Then it ends the attempt, so the failure policy (Ray's ``max_failures``, torchrun's
``--max-restarts``) restarts it from the last checkpoint. This needs a file system every rank
sees: the run directory (one node, or shared storage); for ``s3://`` runs, a directory under
the node's temp dir, which limits hang detection to one node there.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from convoy.config import Job
from convoy.distributed import barrier, exit_without_teardown
from convoy.storage import atomic_write, is_remote

HEARTBEAT_DIR = "heartbeats"


def heartbeat_dir(job: Job) -> Path:
    """Where heartbeats go: the run directory, or the node's temp dir when that is remote."""
    if is_remote(job.run_uri):
        return Path(tempfile.gettempdir()) / "convoy" / (job.run.name or "unnamed")
    return job.run_dir


class Heartbeat:
    """This rank's heartbeat file."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / HEARTBEAT_DIR / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def beat(self, started: int, finished: int) -> None:
        record = {"started": started, "finished": finished, "time": time.time()}
        atomic_write(self.path, json.dumps(record))


def read_heartbeats(run_dir: Path, world_size: int) -> dict[int, dict[str, float]]:
    beats = {}
    for rank in range(world_size):
        path = run_dir / HEARTBEAT_DIR / f"rank{rank}.json"
        try:
            beats[rank] = json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet, or mid-replace
            continue
    return beats


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
    run_dir: Path, rank: int, world_size: int, step: int, timeout_s: float | None
) -> Iterator[Heartbeat | None]:
    """Heartbeat for this rank (None when hang detection is off) and rank 0's watchdog."""
    if timeout_s is None:
        yield None
        return
    heartbeat = Heartbeat(run_dir, rank)
    heartbeat.beat(step, step)
    barrier()  # every rank's first beat is on disk before anyone judges staleness
    stop = start_watchdog(run_dir, world_size, timeout_s) if rank == 0 else None
    try:
        yield heartbeat
    finally:
        if stop is not None:
            stop.set()


def start_watchdog(run_dir: Path, world_size: int, timeout_s: float) -> threading.Event:
    """Run the watchdog in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(min(1.0, timeout_s / 4)):
            report = diagnose(read_heartbeats(run_dir, world_size), timeout_s, time.time())
            if report is not None:
                print(report, flush=True)
                exit_without_teardown(1)

    threading.Thread(target=watch, name="convoy-watchdog", daemon=True).start()
    return stop
