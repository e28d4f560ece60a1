"""``convoy train`` refuses a job whose planned peak per rank is over a rank's memory, in one
line, before any worker starts: ``gpt_1b`` (3.78 GiB in fp32) under ``ddp`` x 4 on a machine
of 24 GiB, naming the layouts of 4 workers that fit. The planner runs in the driver on fake
tensors (about 20 CPU-s for a 1B model); nothing trains."""

from __future__ import annotations

from pathlib import Path

import pytest

import convoy.preflight
from convoy.cli import main
from convoy.launchers.torchrun import TorchrunLauncher

pytestmark = pytest.mark.e2e
GIB = 2**30


def test_gpt_1b_ddp_x4_is_refused_in_one_line_naming_the_layouts_that_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # This machine as the issue measured it: 24 GiB, 6 GiB for each of 4 workers.
    monkeypatch.setattr(convoy.preflight, "host_memory", lambda root: (24 * GIB, "MemAvailable"))

    def no_worker(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(TorchrunLauncher, "start", no_worker)
    overrides = [
        "model.name=gpt_1b",
        "data.seq_len=64",
        "data.batch_size=8",
        "strategy.name=ddp",
        "scaling.num_workers=4",
        "scaling.launcher=torchrun",
        f"run.storage_dir={tmp_path}",
    ]
    code = main(["train", "recipes/lm_tiny.yaml", *(a for o in overrides for a in ("-o", o))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    line = err[0]
    # weights, gradients, two AdamW moments and DDP's buckets: 5 x 3.78 GiB
    assert line.startswith(
        "convoy: error: ddp x 4 needs 19.1 GiB a rank (convoy plan's peak, at optimizer step)"
    )
    assert "a rank has 6 GiB here (MemAvailable 24 GiB / 4 workers on this node)" in line
    fitting = line.split("at 4 workers, these fit: ")[1].split(";")[0]
    # a quarter of the weights and the AdamW state, one block unsharded at a time
    assert "fsdp2 (3.85 GiB)" in fitting and "ddp" not in fitting
    assert line.endswith("set run.skip_memory_check=true to start it anyway")
    assert not list(tmp_path.iterdir())  # no run directory either
