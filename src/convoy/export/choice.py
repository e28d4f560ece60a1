"""Which committed checkpoint of a run an export or an evaluation takes, and why.

A run that ranks its checkpoints (``checkpoint.keep_best`` > 0) keeps its best ones by
``checkpoint.best_metric`` beside the latest; the latest is then not what the run thinks
best (an overfitting run's latest is its worst on val). So the best, ranked as the run
ranked it (``BestPolicy`` over the metrics each ``meta.json`` recorded at its save, the
direction of ``best_mode``, ``auto`` resolved by the task), is the default there; a run that
does not rank gives its latest. ``--checkpoint NAME`` picks one. Each choice carries its
reason in words, which the commands print in one line. The ranking is read from the latest
checkpoint's job: that is the run's recipe as it stands after any resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from convoy.checkpoint import BestPolicy, committed_checkpoints, read_meta
from convoy.config import Job, job_from_saved
from convoy.errors import ConvoyError
from convoy.tasks import build_task


@dataclass(frozen=True)
class CheckpointChoice:
    """A committed checkpoint of a run, and why it was the one taken."""

    name: str
    why: str
    """E.g. ``the best of 3 by val/bpb (2.083, lowest); latest is step_00000420``."""


def choose_checkpoint(run: str | Path, asked: str | None = None) -> CheckpointChoice:
    """The checkpoint ``asked`` for by name, else the run's best where it ranks its
    checkpoints, else its latest; each with its reason."""
    found = committed_checkpoints(run)
    if not found:
        raise ConvoyError(f"RUN: {str(run)!r} has no committed checkpoints")
    latest = found[-1]
    if asked is not None:
        if asked not in found:
            raise ConvoyError(f"--checkpoint: got {asked!r}; this run has: {', '.join(found)}")
        return CheckpointChoice(asked, f"as --checkpoint asked; latest is {latest}")
    job = job_from_saved(read_meta(run, latest)["job"])
    if not job.checkpoint.keep_best:
        unranked = "the run does not rank its checkpoints (checkpoint.keep_best: 0)"
        return CheckpointChoice(latest, f"{latest_of(found)}; {unranked}")
    return best_checkpoint(run, found, job)


def best_checkpoint(run: str | Path, found: list[str], job: Job) -> CheckpointChoice:
    """The best of the committed checkpoints ``found`` by the ranking of ``job`` (the run's),
    or the latest where none of them recorded the metric."""
    metric, mode = job.checkpoint.best_metric, ranking_mode(job)
    metas = {name: read_meta(run, name) for name in found}
    ranked = BestPolicy(1, metric, mode).select(metas)
    if not ranked:
        return CheckpointChoice(
            found[-1], f"{latest_of(found)}; none records {metric}, by which the run ranks them"
        )
    best = ranked[0]
    score = f"{metric} ({metas[best]['metrics'][metric]:.4g}, {RANK_WORDS[mode]})"
    if len(found) == 1:
        return CheckpointChoice(best, f"the only one kept, best by {score} and latest")
    latest = "also the latest" if best == found[-1] else f"latest is {found[-1]}"
    return CheckpointChoice(best, f"the best of {len(found)} by {score}; {latest}")


RANK_WORDS = {"min": "lowest", "max": "highest"}
"""How the choice's line says which way ``best_mode`` ranks."""


def latest_of(found: list[str]) -> str:
    """The latest checkpoint's reason, as many as there are."""
    return "the only one" if len(found) == 1 else f"the latest of {len(found)}"


def ranking_mode(job: Job) -> str:
    """``min`` or ``max``: the job's ``best_mode``, ``auto`` being the task's direction."""
    cfg = job.checkpoint
    if cfg.best_mode != "auto":
        return cfg.best_mode
    return build_task(job.task.name, job.task.kwargs).best_mode(cfg.best_metric)
