"""The stop flag: the first stop signal is recorded, a second Ctrl-C interrupts at once, and
the handlers that were there come back."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from convoy.engine.stop import StopWatch


def test_a_signal_is_recorded_and_agreed_on_one_rank() -> None:
    before = signal.getsignal(signal.SIGTERM)
    watch = StopWatch()
    with watch.installed():
        assert not watch.agreed(torch.device("cpu"))
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.agreed(torch.device("cpu"))
        assert watch.describe().startswith("SIGTERM")
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
