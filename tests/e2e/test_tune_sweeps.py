"""convoy tune on a real local Ray: an ASHA sweep, and a sweep interrupted and resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from convoy.cli import main
from convoy.config import load_job

pytestmark = [pytest.mark.e2e, pytest.mark.ray_dashboard]
TINY = [
    "-o", "model.name=mlp",
    "-o", "model.kwargs={hidden: 32}",
    "-o", "scaling.cpus_per_worker=0.5",
    "-o", "optim.warmup_steps=0",
    "-o", "run.progress=off",
]  # fmt: skip


def write_space(folder: Path, text: str) -> str:
    path = folder / "space.yaml"
    path.write_text(text)
    return str(path)


def results(sweep: Path) -> dict[str, Any]:
    return json.loads((sweep / "results.json").read_text())


def test_asha_stops_the_weak_trial_and_leaks_nothing(ray_session: Any, tmp_path: Path) -> None:
    space = write_space(tmp_path, "optim.lr: {grid: [3.0e-3, 1.0e-5]}\n")
    args = ["tune", "--space", space, "--samples", "1", "--max-concurrent", "1", "--name", "a"]
    code = main([*args, *TINY, "-o", "run.epochs=2", "-o", f"run.storage_dir={tmp_path}"])
    assert code == 0
    sweep = tmp_path / "a"
    record = results(sweep)
    assert record["placement_groups_left"] == 0
    by_lr = {t["values"]["optim.lr"]: t for t in record["trials"]}
    weak, strong = by_lr[1e-5], by_lr[3e-3]
    # Sequential trials: the weak one meets the strong one's epoch-1 loss at ASHA's rung.
    # (Its workers may still finish the short run before the stop reaches them.)
    assert (weak["status"], weak["epochs"]) == ("stopped", 1)
    assert (strong["status"], strong["epochs"]) == ("finished", 2)
    assert "test/acc" in strong["test"]
    for trial in record["trials"]:
        run = sweep / trial["trial_id"]
        assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert (sweep / strong["trial_id"] / "summary.json").is_file()
    best = load_job(sweep / "best.yaml")
    assert best.optim.lr == 3e-3 and best.run.name is None


def test_bad_metric_fails_before_ray(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    space = write_space(tmp_path, "optim.lr: {grid: [3.0e-3, 1.0e-3]}\n")
    code = main(["tune", "--space", space, "--metric", "val/bleu", *TINY])
    assert code == 2
    err = capsys.readouterr().err
    assert "--metric: got 'val/bleu'" in err and "'val/acc'" in err
    assert main(["tune", "--space", space, "--samples", "0", *TINY]) == 2
    assert "--samples: got 0" in capsys.readouterr().err


def tune_args(tmp_path: Path, space: str, *extra: str) -> list[str]:
    command = ["tune", "--space", space, "--name", "r"]
    options = ["--scheduler", "none", "--samples", "1", "--max-concurrent", "1"]
    # One worker a trial: what is checked is the sweep's record across an interruption (the
    # ASHA test above frees two-worker trials).
    storage = [
        "-o",
        "run.epochs=1",
        "-o",
        "scaling.num_workers=1",
        "-o",
        f"run.storage_dir={tmp_path}",
    ]
    return [*command, *options, *TINY, *storage, *extra]


def tune_process(tmp_path: Path, space: str) -> subprocess.Popen[str]:
    """``convoy tune`` as a process of its own (what is interrupted), on the session's Ray."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    return subprocess.Popen(
        [sys.executable, "-m", "convoy", *tune_args(tmp_path, space)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_interrupted_sweep_resumes_without_repeating(
    ray_session: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``convoy tune`` process interrupted by SIGTERM, then resumed with ``--resume`` (the
    resume in this process, on the same Ray: what is checked is the sweep's record)."""
    # Two trials: the first finishes before the interruption, the second is interrupted or
    # never started, and the resume runs it alone.
    space = write_space(tmp_path, "optim.lr: {grid: [3.0e-3, 1.0e-3]}\n")
    sweep = tmp_path / "r"
    first = tune_process(tmp_path, space)
    assert first.stdout is not None
    seen = []
    # Interrupt once Tune has recorded a trial as complete (its progress line), not merely
    # once the run wrote its summary: a trial Tune has not seen end is resumed, by design.
    for line in first.stdout:
        seen.append(line)
        if "trained every epoch" in line:
            break
    first.send_signal(signal.SIGTERM)  # as `kill` or `timeout` sends: taken as Ctrl+C
    output, _ = first.communicate(timeout=120)
    output = "".join(seen) + output
    assert first.returncode != 0, output  # interrupted: the resume command is printed
    assert "--resume" in output
    # The trials the interruption ended or kept from starting are said so, not ASHA stops.
    statuses = {t["status"] for t in results(sweep)["trials"]}
    assert statuses <= {"finished", "interrupted", "not started"}, output
    assert "not started" in output or "interrupted" in output, output
    assert "stopped early" not in output, output
    done = {line.split()[2] for line in seen if "trained every epoch" in line}
    finished = {t: (sweep / t / "metrics.jsonl").read_text() for t in done}
    assert len(finished) == 1
    code = main(tune_args(tmp_path, space, "--resume"))
    assert code == 0, capsys.readouterr().out[-3000:]
    record = results(sweep)
    assert len(record["trials"]) == 2
    assert {t["status"] for t in record["trials"]} == {"finished"}
    for trial_id, text in finished.items():  # not run again: nothing appended
        assert (sweep / trial_id / "metrics.jsonl").read_text() == text
