"""The hang diagnosis: which rank is stuck, judged from heartbeat records."""

from __future__ import annotations

from convoy.engine.heartbeat import diagnose


def beat(started: int, finished: int, time: float) -> dict[str, float]:
    return {"started": started, "finished": finished, "time": time}


def test_no_report_while_everyone_progresses() -> None:
    beats = {0: beat(7, 6, 99.0), 1: beat(7, 6, 98.0)}
    assert diagnose(beats, timeout_s=5, now=100.0) is None


def test_names_the_rank_that_never_started_the_step_its_peers_wait_in() -> None:
    # Rank 1 finished step 30 and stopped; rank 0 started step 31 and waits in its allreduce.
    beats = {0: beat(31, 30, 90.0), 1: beat(30, 30, 89.0)}
    report = diagnose(beats, timeout_s=5, now=100.0)
    assert report is not None
    assert report.startswith("convoy: hang detected: rank(s) 1 made no progress for 11.0 s")
    assert "rank 1 last finished step 30" in report
    assert "waiting for it in a collective: rank 0 (in step 31)" in report


def test_all_ranks_at_the_same_step_names_the_stale_ones() -> None:
    beats = {0: beat(12, 11, 99.0), 1: beat(12, 11, 80.0), 2: beat(12, 11, 99.5)}
    report = diagnose(beats, timeout_s=5, now=100.0)
    assert report is not None and "rank(s) 1 made no progress for 20.0 s" in report
