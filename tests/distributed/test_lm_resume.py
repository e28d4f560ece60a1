"""Exact resume of language modeling: N steps straight == stop mid-epoch, resume (bitwise).

The ragged LM data (``task_data_helpers.ragged_lm``: 6 steps per epoch at global batch 16)
trains for 2 epochs, 10 steps, on 2 ranks. The stopped run saves at step 4 (mid-epoch 1),
rank 1 raises after step 5, and the same run resumes from step 4 through the epoch boundary
to the end: its step losses from step 5 on, its final weights and its eval metrics are
identical to the straight run's (``==``, not approx). Dropout is on, so the RNG stream of
every step must continue exactly where the checkpoint left it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.multiprocessing.spawn import ProcessException

from convoy.checkpoint import checkpoint_root, committed_checkpoints
from convoy.config import Job, load_job
from convoy.outputs import read_metrics
from convoy.testing import run_on_gloo, train_on_rank
from task_data_helpers import GPT_TINY_OVERRIDES

pytestmark = pytest.mark.distributed
TOTAL_STEPS = 10
SAVED_AT, FAILED_AFTER = 4, 5


def resume_job(root: Path, strategy: str, *extra: str) -> Job:
    return load_job(
        None,
        [
            *GPT_TINY_OVERRIDES,
            # Dropout draws from the global RNG every step: resume must restore it exactly.
            "model.kwargs.dropout=0.1",
            "task.name=language_modeling",
            "data.name=task_data_helpers:ragged_lm",
            "data.batch_size=16",
            f"strategy.name={strategy}",
            "scaling.num_workers=2",
            "scaling.launcher=torchrun",
            "optim.lr=1e-2",
            "optim.warmup_steps=2",
            "optim.grad_clip_norm=1.0",
            "run.epochs=2",
            f"run.max_steps={TOTAL_STEPS}",
            "run.log_every_steps=1",
            "run.progress=off",
            f"run.storage_dir={root}",
            f"checkpoint.every_steps={SAVED_AT}",
            "checkpoint.keep_latest=3",
            "run.collective_timeout_s=60",  # a peer of a failed rank must not wait 10 minutes
            *extra,
        ],
    )


def step_losses_per_attempt(job: Job) -> list[dict[int, float]]:
    """``{step: train/loss}`` of each start of the run (a restart begins a new dict)."""
    attempts: list[dict[int, float]] = []
    for record in read_metrics(job.run_dir):
        if record["kind"] != "step":
            continue
        if not attempts or record["step"] <= max(attempts[-1]):
            attempts.append({})
        attempts[-1][record["step"]] = record["train/loss"]
    return attempts


def saved_model(job: Job, name: str, tmp: Path) -> dict[str, torch.Tensor]:
    """A committed checkpoint's model, consolidated, loaded without unpickling code."""
    target = tmp / f"{job.run.name}-{name}.pt"
    dcp_to_torch_save(checkpoint_root(job.run_dir) / name, target)
    return torch.load(target, weights_only=True)["model"]


def step_name(step: int) -> str:
    return f"step_{step:08d}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lm_resume_mid_epoch_is_bitwise_exact(strategy: str, tmp_path: Path) -> None:
    straight = resume_job(tmp_path, strategy, "run.name=straight")
    straight_summary: dict[str, Any] = run_on_gloo(train_on_rank, 2, straight)[0]
    (expected,) = step_losses_per_attempt(straight)
    assert sorted(expected) == list(range(1, TOTAL_STEPS + 1))

    stopped = resume_job(
        tmp_path,
        strategy,
        "run.name=stopped",
        "fault.kind=raise",
        f"fault.at_step={FAILED_AFTER}",
        "fault.rank=1",
    )
    with pytest.raises(ProcessException):
        run_on_gloo(train_on_rank, 2, stopped)
    assert committed_checkpoints(stopped.run_dir) == [step_name(SAVED_AT)]

    summary = run_on_gloo(train_on_rank, 2, stopped)[0]  # the same run again: resumes
    assert summary["resumed_from"].endswith(step_name(SAVED_AT))
    first, resumed = step_losses_per_attempt(stopped)
    assert sorted(first) == list(range(1, FAILED_AFTER + 1))
    assert sorted(resumed) == list(range(SAVED_AT + 1, TOTAL_STEPS + 1))
    assert all(first[step] == expected[step] for step in first)
    assert all(resumed[step] == expected[step] for step in resumed), (resumed, expected)

    final = saved_model(straight, step_name(TOTAL_STEPS), tmp_path)
    resumed_final = saved_model(stopped, step_name(TOTAL_STEPS), tmp_path)
    assert final.keys() == resumed_final.keys()
    for name, tensor in final.items():
        assert torch.equal(tensor, resumed_final[name]), name
    # Not equal by standing still: the 6 steps after the resume moved every weight matrix.
    at_save = saved_model(stopped, step_name(SAVED_AT), tmp_path)
    assert not any(torch.equal(final[n], at_save[n]) for n in final if final[n].dim() == 2)

    for key in ("val/loss", "val/tokens", "test/loss", "test/tokens", "test/bpb"):
        assert summary["metrics"][key] == straight_summary["metrics"][key], key
