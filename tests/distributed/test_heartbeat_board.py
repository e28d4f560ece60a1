"""Heartbeats travel through the process group's store: every rank sees every rank's record."""

from __future__ import annotations

from typing import Any

import pytest

from convoy.distributed import WorkerContext, barrier, join_process_group
from convoy.engine.heartbeat import HeartbeatBoard
from convoy.testing import run_on_gloo

pytestmark = pytest.mark.distributed


def exchange_beats(ctx: WorkerContext) -> dict[int, dict[str, Any]]:
    join_process_group(ctx, timeout_s=60)
    board = HeartbeatBoard()
    assert board.store is not None  # not the in-memory fallback
    board.write(ctx.rank, {"started": 10 + ctx.rank, "finished": 9 + ctx.rank, "time": 1.0})
    barrier()
    beats = board.read(ctx.world_size)
    barrier()  # rank 0 hosts the store: nobody leaves while a peer still reads it
    return beats


def test_every_rank_reads_every_rank_heartbeat() -> None:
    expected = {r: {"started": 10 + r, "finished": 9 + r, "time": 1.0} for r in range(2)}
    assert run_on_gloo(exchange_beats, 2) == [expected, expected]


def test_without_peers_the_board_is_in_memory() -> None:
    board = HeartbeatBoard()
    assert board.store is None
    assert board.read(1) == {}
    board.write(0, {"started": 3, "finished": 2, "time": 5.0})
    assert board.read(1) == {0: {"started": 3, "finished": 2, "time": 5.0}}
