"""A stop request (``kill -TERM`` of ``convoy train``, as a spot notice or a scheduler sends
it) costs no step: the run saves the step it finished, exits with the "stopped, resume"
code and says how to resume; the same command resumes with no step repeated, and the final
weights equal an uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from convoy.checkpoint import checkpoint_root, committed_checkpoints
from convoy.engine.stop import STOPPED_EXIT_CODE

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
STEPS = 24
RUN_TIMEOUT_S = 300  # a guard against a hang, not a measurement


LAYOUTS = {
    # The engine in the convoy process itself.
    "local": ["scaling.launcher=local", "scaling.num_workers=1", "strategy={name: single}"],
    # convoy drives torchrun: it passes the signal to torchrun's agent, which passes it to
    # both workers; they agree on the step, save it and exit "stopped".
    "torchrun": ["scaling.launcher=torchrun", "scaling.num_workers=2", "strategy={name: ddp}"],
}


def command(storage: Path, name: str, layout: list[str], *extra: str) -> list[str]:
    """digits_mlp, every step logged; its checkpoints every 4 epochs come after the last
    step: what the stop saves is all there is to resume from."""
    overrides = [
        *layout,
        f"run.max_steps={STEPS}",
        "run.log_every_steps=1",
        "run.progress=plain",
        f"run.storage_dir={storage}",
        f"run.name={name}",
        *extra,
    ]
    args = [sys.executable, "-m", "convoy", "train", str(REPO / "recipes" / "digits_mlp.yaml")]
    return args + [part for override in overrides for part in ("-o", override)]


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["step"] for r in records if r["kind"] == "step"]


def final_weights(run_dir: Path, target: Path) -> dict[str, torch.Tensor]:
    latest = committed_checkpoints(run_dir)[-1]
    dcp_to_torch_save(checkpoint_root(run_dir) / latest, target)
    return torch.load(target, weights_only=True)["model"]


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(s >= step for s in logged_steps(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or hung before step {step}")


@pytest.mark.parametrize("launcher", sorted(LAYOUTS))
def test_sigterm_saves_the_finished_step_and_the_same_command_resumes(
    launcher: str, tmp_path: Path
) -> None:
    # Each step made slower (outside the math) so the signal lands mid-run.
    slow = ("fault.kind=slow", "fault.at_step=1", "fault.slow_seconds=0.15")
    straight = command(tmp_path, "straight", LAYOUTS[launcher])
    subprocess.run(straight, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)

    stopped = command(tmp_path, "stopped", LAYOUTS[launcher], *slow)
    run_dir = tmp_path / "stopped"
    process = subprocess.Popen(stopped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 5, process)
    os.kill(process.pid, signal.SIGTERM)
    _out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == STOPPED_EXIT_CODE, err
    steps_before = logged_steps(run_dir)
    stop_step = steps_before[-1]
    assert 5 <= stop_step < STEPS
    assert "stopped on SIGTERM" in err and f"after step {stop_step}: checkpoint" in err
    assert "convoy: to resume: convoy train" in err
    assert committed_checkpoints(run_dir) == [f"step_{stop_step:08d}"], err

    resumed = subprocess.run(stopped, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step_{stop_step:08d}" in resumed.stdout
    steps = logged_steps(run_dir)
    assert steps == list(range(1, STEPS + 1))  # none lost, none repeated
    expected = final_weights(tmp_path / "straight", tmp_path / "straight.pt")
    got = final_weights(run_dir, tmp_path / "stopped.pt")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
