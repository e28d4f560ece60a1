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

import convoy
from convoy.checkpoint import checkpoint_root, committed_checkpoints
from convoy.cli import main
from convoy.config import load_job
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


RECIPE = REPO / "recipes" / "digits_mlp.yaml"


def overrides(storage: Path, name: str, layout: list[str], *extra: str) -> list[str]:
    """digits_mlp, every step logged; its checkpoints every 4 epochs come after the last
    step: what the stop saves is all there is to resume from."""
    return [
        *layout,
        f"run.max_steps={STEPS}",
        "run.stop_poll_s=0",  # agree at every boundary: a notice at step 6 of 24 lands
        "run.log_every_steps=1",
        "run.progress=plain",
        f"run.storage_dir={storage}",
        f"run.name={name}",
        *extra,
    ]


def train_args(storage: Path, name: str, layout: list[str], *extra: str) -> list[str]:
    """``convoy train``'s arguments on ``overrides(...)``."""
    parts = [part for o in overrides(storage, name, layout, *extra) for part in ("-o", o)]
    return ["train", str(RECIPE), *parts]


def command(storage: Path, name: str, layout: list[str], *extra: str) -> list[str]:
    """``convoy train`` on ``overrides(...)`` as a process of its own: what a test sends a
    signal to, and the same command that resumes it."""
    return [sys.executable, "-m", "convoy", *train_args(storage, name, layout, *extra)]


def in_process(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``convoy train`` through ``cli.main`` in this process, for a run stopped by an injected
    notice (no signal): the CLI's exit code and its output, with what torchrun's workers
    printed. Saves a process's imports where the stop, not the command's start, is tested."""
    capfd.readouterr()
    code = main(args)
    out, err = capfd.readouterr()
    sys.stdout.write(out[-3000:])  # shown with a failure
    return code, out + err


def logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r["step"] for r in records if r["kind"] == "step"]


def final_weights(run_dir: Path, target: Path) -> dict[str, torch.Tensor]:
    latest = committed_checkpoints(run_dir)[-1]
    dcp_to_torch_save(checkpoint_root(run_dir) / latest, target)
    return torch.load(target, weights_only=True)["model"]


@pytest.fixture(scope="module")
def straight_weights(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The final weights of an uninterrupted run, once per layout for the module (how often
    the run checkpoints or may restart does not change them). The same job as the stopped
    runs' command, without a fault, trained through ``convoy.train`` from this process: the
    reference is not what a test stops, so it needs no ``convoy train`` process of its own
    (under ``torchrun`` its workers are still torchrun's; under ``local`` the engine runs
    here, with the threads the job sets, as it would in ``convoy train``)."""
    found: dict[str, dict[str, torch.Tensor]] = {}

    def weights(launcher: str) -> dict[str, torch.Tensor]:
        if launcher not in found:
            storage = tmp_path_factory.mktemp(f"straight-{launcher}")
            job = load_job(RECIPE, overrides(storage, "straight", LAYOUTS[launcher]))
            convoy.train(job)
            found[launcher] = final_weights(storage / "straight", storage / "straight.pt")
        return found[launcher]

    return weights


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
    launcher: str,
    straight_weights,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    # Each step made slower (outside the math) so the signal lands mid-run.
    slow = ("fault.kind=slow", "fault.at_step=1", "fault.slow_seconds=0.15")

    stopped = command(tmp_path, "stopped", LAYOUTS[launcher], *slow)
    run_dir = tmp_path / "stopped"
    process = subprocess.Popen(stopped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(run_dir, 5, process)
    os.kill(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == STOPPED_EXIT_CODE, err
    err = out + err  # the loop's line (stdout), then the resume command (stderr)
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
    expected = straight_weights(launcher)
    got = final_weights(run_dir, tmp_path / "stopped.pt")
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def stop_run(args: list[str], capfd: pytest.CaptureFixture[str]) -> str:
    """Run ``args`` in this process: it stops with the "stopped" code; its output."""
    code, output = in_process(args, capfd)
    assert code == STOPPED_EXIT_CODE, output[-3000:]
    return output


def assert_resumes_exactly(
    args: list[str],
    run_dir: Path,
    expected: dict[str, torch.Tensor],
    tmp: Path,
    capfd: pytest.CaptureFixture[str],
) -> str:
    """Run ``args`` again: it finishes, and its final weights equal ``expected``."""
    code, output = in_process(args, capfd)
    assert code == 0, output[-3000:]
    got = final_weights(run_dir, tmp / "resumed.pt")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    return output


def test_a_notice_to_one_rank_with_a_deadline_saves_on_every_rank(
    straight_weights,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    """``fault.kind: preempt`` on rank 1 of 2: rank 0 learns of it at the next boundary,
    both save the same step well before the deadline, and the resume repeats no step."""
    layout = LAYOUTS["torchrun"]
    notice = ("fault.kind=preempt", "fault.rank=1", "fault.at_step=6", "fault.deadline_s=60")
    args = train_args(tmp_path, "noticed", layout, *notice)
    err = stop_run(args, capfd)
    run_dir = tmp_path / "noticed"
    stop_step = logged_steps(run_dir)[-1]
    line = next(line for line in err.splitlines() if "convoy: stopped on" in line)
    print(f"\n{line}")
    assert "an injected preemption notice (60 s deadline)" in line  # the sender's words
    assert f"after step {stop_step}: checkpoint step_{stop_step:08d} committed in" in line
    assert "before the deadline" in line
    assert stop_step in (6, 7)  # read at the boundary after the one it came before
    assert_resumes_exactly(args, run_dir, straight_weights("torchrun"), tmp_path, capfd)
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))


def test_with_restarts_torchrun_resumes_from_the_save_by_itself(
    straight_weights,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    """``scaling.max_failures: 1`` (torchrun's ``--max-restarts``): the workers save and
    exit "stopped", the agent starts them again, and they resume from that save in the same
    ``convoy train``, which then succeeds."""
    layout = [*LAYOUTS["torchrun"], "scaling.max_failures=1"]
    notice = ("fault.kind=preempt", "fault.rank=1", "fault.at_step=6", "fault.deadline_s=60")
    code, output = in_process(train_args(tmp_path, "restarted", layout, *notice), capfd)
    assert code == 0, output[-3000:]
    run_dir = tmp_path / "restarted"
    stopped = next(line for line in output.splitlines() if "convoy: stopped on" in line)
    saved = stopped.split("checkpoint ")[1].split()[0]
    assert f"convoy: resumed from {saved}" in output
    assert not (run_dir / "stopped.txt").exists()  # the restart ran on: nothing stopped
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    expected = straight_weights("torchrun")
    got = final_weights(run_dir, tmp_path / "restarted.pt")
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name


def test_a_notice_shorter_than_a_save_resumes_from_the_last_checkpoint(
    straight_weights,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    """A deadline already past: no save is started (so none is left half-written), the run
    says so, and the same command resumes from the last periodic checkpoint."""
    layout = [*LAYOUTS["local"], "checkpoint.every_steps=4"]
    notice = ("fault.kind=preempt", "fault.at_step=6", "fault.deadline_s=0")
    args = train_args(tmp_path, "late", layout, *notice)
    err = stop_run(args, capfd)
    run_dir = tmp_path / "late"
    line = next(line for line in err.splitlines() if "convoy: stopped on" in line)
    print(f"\n{line}")
    assert "after step 6: not saved: 0.000 s were left and the last save took" in line
    assert "resumes from step_00000004, the last checkpoint" in line
    assert "convoy: to resume: convoy train" in err
    assert sorted(p.name for p in checkpoint_root(run_dir).iterdir()) == ["step_00000004"]
    out = assert_resumes_exactly(args, run_dir, straight_weights("local"), tmp_path, capfd)
    assert "resumed from step_00000004" in out
    # Steps 5 and 6 are trained again: what a notice too short to save costs.
    assert logged_steps(run_dir) == [*range(1, 7), *range(5, STEPS + 1)]


def test_without_checkpoints_a_stop_says_to_start_again(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    args = train_args(
        tmp_path,
        "unsaved",
        LAYOUTS["local"],
        "checkpoint.every_epochs=null",
        "fault.kind=preempt",
        "fault.at_step=3",
    )
    err = stop_run(args, capfd)
    assert "after step 3: checkpointing is off" in err and "so nothing was saved" in err
    assert "convoy: to start again: convoy train" in err
    assert err.count("convoy: stopped on") == 1  # said once, by the loop


SLOW_DATA = '''
"""Screening data whose first access to one item waits (a slow read), marking the wait."""
import os
import time
from pathlib import Path

from torch.utils.data import Dataset, TensorDataset

from examples.tumor_screening import screening_data

MARKS = Path(os.environ["SLOW_DATA_MARKS"])


class WaitOnce(Dataset):
    def __init__(self, inner, mark, index, seconds):
        self.inner, self.mark, self.index, self.seconds = inner, mark, index, seconds

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        marked = MARKS / self.mark
        if i == self.index and not marked.exists():
            marked.write_text("waiting")
            time.sleep(self.seconds)
        return self.inner[i]


def slow_data(slow_split: str, seconds: float = 3.0):
    data = screening_data()
    features, labels = data["train"].tensors
    splits = {
        "train": TensorDataset(features[:320], labels[:320]),
        "val": TensorDataset(features[320:], labels[320:]),
        "test": data["test"],
    }
    splits[slow_split] = WaitOnce(splits[slow_split], slow_split, 3, seconds)
    return {**splits, "shape": data["shape"]}
'''


@pytest.mark.parametrize("slow_split", ["val", "train"])
def test_a_signal_during_validation_or_a_data_wait_is_acted_on(
    slow_split: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM while validation, or a step's data, waits on a slow read: the wait ends, the
    run saves the step it finished and stops; the resume (in this process: it is sent no
    signal) repeats no step."""
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SLOW_DATA_MARKS": str(marks)}
    train = [
        "train", str(REPO / "recipes" / "user_module.yaml"),
        *(part for override in [
            *LAYOUTS["local"],
            "data.name=slow_data:slow_data",
            f"data.kwargs={{slow_split: {slow_split}}}",
            "run.epochs=3",
            "run.log_every_steps=1",
            "run.progress=plain",
            f"run.storage_dir={tmp_path}",
            "run.name=slow",
            "checkpoint.every_epochs=null",
            "checkpoint.every_steps=100",  # checkpointing on; none due before the stop
        ] for part in ("-o", override)),
    ]  # fmt: skip
    args = [sys.executable, "-m", "convoy", *train]
    process = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    mark = marks / slow_split
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not mark.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mark.exists(), process.communicate()[1][-3000:]
    os.kill(process.pid, signal.SIGTERM)  # during the 3 s wait
    out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == STOPPED_EXIT_CODE, err[-3000:]
    err = out + err
    run_dir = tmp_path / "slow"
    stop_step = logged_steps(run_dir)[-1]
    line = next(line for line in err.splitlines() if "convoy: stopped on" in line)
    print(f"\n{line}")
    assert f"after step {stop_step}: checkpoint step_{stop_step:08d} committed" in line
    if slow_split == "val":  # acted on when validation ends: the epoch's last step
        assert stop_step == 10  # 320 rows, batch 32
    # As the command ran: from the repository, the user's data module on the path (imported
    # afresh, for this test's marks), its one slow read already marked done.
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SLOW_DATA_MARKS", str(marks))
    monkeypatch.delitem(sys.modules, "slow_data", raising=False)
    code, output = in_process(train, capfd)
    sys.modules.pop("slow_data", None)
    assert code == 0, output[-3000:]
    assert f"resumed from step_{stop_step:08d}" in output
    assert logged_steps(run_dir) == list(range(1, 31))  # none lost, none repeated
