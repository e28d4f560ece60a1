"""Ctrl-C in a terminal, on every launcher: the terminal sends SIGINT to its whole foreground
process group, so each test starts ``convoy train`` in a session of its own and sends SIGINT
to that group (``os.killpg``), not to one PID. Expected as under ``local``: the run saves the
step it finished, says so once, prints the resume line and exits "stopped" (75), without a
traceback; and nothing of the run is left running (no Ray daemon, agent or worker)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from convoy.checkpoint import committed_checkpoints
from convoy.engine.stop import STOPPED_EXIT_CODE
from processes import command_line, pids_with_environ, survivors

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300  # guards against a hang, not measurements
GONE_TIMEOUT_S = 60
MARK = "CONVOY_CTRL_C_TEST"  # in the environment of every process the run starts

LAYOUTS = {
    # The engine in the convoy process itself.
    "local": ["scaling.launcher=local", "scaling.num_workers=1", "strategy={name: single}"],
    # convoy drives torchrun's agent, which starts the workers in sessions of their own.
    "torchrun": ["scaling.launcher=torchrun", "scaling.num_workers=2", "strategy={name: ddp}"],
    # A private Ray: its daemons, Ray Train's controller and the workers (sessions of their own).
    "ray": ["scaling.launcher=ray", "scaling.num_workers=2", "strategy={name: ddp}"],
}


def command(storage: Path, layout: list[str]) -> list[str]:
    """digits_mlp, every step logged and slowed a little (outside the math) so that the
    signal lands mid-run; its periodic checkpoints come after the last step, so what the stop
    saves is the run's only checkpoint."""
    overrides = [
        *layout,
        "run.max_steps=200",
        "run.stop_poll_s=0",
        "run.log_every_steps=1",
        "run.progress=plain",
        "fault.kind=slow",
        "fault.at_step=1",
        "fault.slow_seconds=0.1",
        f"run.storage_dir={storage}",
        "run.name=interrupted",
    ]
    args = [sys.executable, "-m", "convoy", "train", str(REPO / "recipes" / "digits_mlp.yaml")]
    return args + [part for override in overrides for part in ("-o", override)]


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen[str]) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and step in logged_steps(run_dir):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or hung before step {step}")


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip().endswith("}")]
    return [r["step"] for r in records if r["kind"] == "step"]


@pytest.mark.parametrize("launcher", sorted(LAYOUTS))
def test_ctrl_c_saves_the_step_says_how_to_resume_and_leaves_nothing_running(
    launcher: str, short_tmp_path: Path
) -> None:
    mark = f"{MARK}={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.pop("RAY_API_SERVER_ADDRESS", None)
    env.pop("OMP_NUM_THREADS", None)  # as in a fresh terminal: torchrun's banner would ask for it
    key, _, value = mark.partition("=")
    # A Ray folder of this test's own: its private Ray finds no other Ray to join.
    env.update({key: value, "RAY_TMPDIR": str(short_tmp_path), "PYTHONUNBUFFERED": "1"})
    run_dir = short_tmp_path / "interrupted"
    process = subprocess.Popen(
        command(short_tmp_path, LAYOUTS[launcher]),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job; not ours
    )
    try:
        wait_for_step(run_dir, 3, process)
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        left = survivors(lambda: pids_with_environ(mark), GONE_TIMEOUT_S)
    finally:
        for pid in pids_with_environ(mark):  # a failed run's processes, ours by the mark
            os.kill(pid, signal.SIGKILL)
    tail = output[-4000:]
    assert process.returncode == STOPPED_EXIT_CODE, tail
    assert "Traceback" not in output, tail
    assert "OMP_NUM_THREADS" not in output, tail  # torchrun's banner: Convoy sets it
    stopped = [line for line in output.splitlines() if line.startswith("convoy: stopped on")]
    assert len(stopped) == 1, tail  # said once
    stop_step = logged_steps(run_dir)[-1]
    assert stopped[0].startswith("convoy: stopped on SIGINT"), tail
    assert f"after step {stop_step}: checkpoint step_{stop_step:08d} committed" in stopped[0]
    assert committed_checkpoints(run_dir) == [f"step_{stop_step:08d}"]
    assert "convoy: to resume: convoy train" in output, tail
    assert not left, [command_line(pid) for pid in left]
