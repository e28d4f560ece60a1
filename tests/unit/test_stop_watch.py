"""The stop flag: the first stop request is recorded (a signal, a launcher's notice, an
injected one), a signal carries the pod's grace period as its deadline, a second Ctrl-C
interrupts at once, and the handlers that were there come back."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from convoy.engine.stop import GRACE_ENV, StopNotice, StopWatch, describe, grace_period_s

CPU = torch.device("cpu")


def test_a_signal_is_recorded_and_agreed_on_one_rank() -> None:
    before = signal.getsignal(signal.SIGTERM)
    watch = StopWatch()
    with watch.installed():
        assert watch.agreed(CPU) is None
        os.kill(os.getpid(), signal.SIGTERM)
        notice = watch.agreed(CPU)
        assert notice is not None and notice.deadline is None
        assert describe(notice).startswith("SIGTERM")
        os.kill(os.getpid(), signal.SIGUSR1)  # a later request keeps the first one
        assert watch.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_interrupts_at_once() -> None:
    watch = StopWatch()
    with watch.installed():
        os.kill(os.getpid(), signal.SIGINT)
        assert watch.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_carries_the_grace_period_as_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(GRACE_ENV, "30")
    watch = StopWatch(grace_s=grace_period_s())
    with watch.installed():
        os.kill(os.getpid(), signal.SIGTERM)
        notice = watch.agreed(CPU)
    assert notice is not None
    left = notice.seconds_left()
    assert left is not None and 29.0 < left <= 30.0
    monkeypatch.setenv(GRACE_ENV, "soon")
    assert grace_period_s() is None  # a value that is not a number gives no deadline


class Marks:
    """A launcher's notices as Ray's would come: a mark set from outside, then confirmed."""

    def __init__(self) -> None:
        self.marks: list[StopNotice] = []

    def poll(self) -> StopNotice | None:
        return self.marks[0] if self.marks else None

    def confirm(self, notice: StopNotice) -> StopNotice:
        return dataclasses.replace(notice, preempted_ranks=(1,))


def test_a_launchers_notice_is_read_at_the_boundary_and_confirmed() -> None:
    source = Marks()
    watch = StopWatch(notices=source)
    assert watch.agreed(CPU) is None
    source.marks.append(StopNotice("preemption of node 10.0.0.2", time.time(), time.time() + 30))
    notice = watch.agreed(CPU)
    assert notice is source.marks[0]
    assert watch.confirm(notice).preempted_ranks == (1,)
    assert StopWatch().confirm(notice) is notice  # signals only: nothing to confirm


def test_off_means_no_request_is_ever_agreed() -> None:
    watch = StopWatch(enabled=False)
    watch.request(StopNotice("an injected preemption notice", time.time(), None))
    assert watch.agreed(CPU) is None
