"""What every export format starts from: one committed checkpoint and the job that wrote it.

``read_checkpoint`` names the checkpoint (the one asked for, else the run's best where it
ranks its checkpoints, else its latest: ``choice``) and reads its ``meta.json``: the job that
wrote it, the data's shape, the step and the metrics recorded for it. ``skeleton_model``
builds that job's model on the meta device: its names, shapes and tied weights, with no
memory behind them, which is all an export needs of the model (the weights stream from the
checkpoint, ``shards``). ``consolidated_model`` builds it whole on one CPU device and reads
only the model entries of the sharded DCP checkpoint into it: DCP reshards from any world
size and strategy, with no process group. ``description`` is the ``model.json`` every export
keeps beside its weights, so that ``convoy evaluate`` can rebuild the job's data and task.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from convoy.checkpoint import checkpoint_path, ignore_dcp_group_warning, local_copy, read_meta
from convoy.config import Job, job_from_saved
from convoy.export.choice import choose_checkpoint
from convoy.models.registry import build_model

MODEL_FILE = "model.json"


@dataclass(frozen=True)
class SavedCheckpoint:
    """A committed checkpoint of a run: its name, its ``meta.json`` and the job that wrote it."""

    run: str | Path
    name: str
    meta: dict[str, Any]
    job: Job


def find_checkpoint(run: str | Path, checkpoint: str | None) -> str:
    """The name of the given committed checkpoint of a run (local or ``s3://``), or of the
    one ``choose_checkpoint`` takes: its best where the run ranks them, else its latest."""
    return choose_checkpoint(run, checkpoint).name


def read_checkpoint(run: str | Path, checkpoint: str | None = None) -> SavedCheckpoint:
    """The given (default: ``choose_checkpoint``'s) committed checkpoint's facts; no weights
    are read."""
    name = find_checkpoint(run, checkpoint)
    meta = read_meta(run, name)
    return SavedCheckpoint(run, name, meta, job_from_saved(meta["job"]))


def build_job_model(job: Job, data_shape: dict[str, int]) -> nn.Module:
    """The job's model, untrained, for data of this shape."""
    return build_model(job.model.name, job.model.kwargs, data_shape)


def skeleton_model(saved: SavedCheckpoint) -> nn.Module:
    """The checkpoint's model on the meta device: its state dict's names, shapes, dtypes and
    ties, with no memory behind them and nothing read."""
    with torch.device("meta"):
        return build_job_model(saved.job, saved.meta["data_shape"])


def consolidated_model(saved: SavedCheckpoint) -> nn.Module:
    """The checkpoint's model on one CPU device, in eval mode, its weights read from the
    shards of whatever strategy and world size saved them."""
    model = build_job_model(saved.job, saved.meta["data_shape"])
    state = model.state_dict()
    ignore_dcp_group_warning()
    with local_copy(saved.run, saved.name) as path:
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    # The state's tensors are mostly the parameters themselves (loaded in place, no copy);
    # loading them back covers a model whose state_dict hooks hand out other tensors.
    model.load_state_dict(state)
    return model.eval()


def description(saved: SavedCheckpoint, export_format: str) -> dict[str, Any]:
    """What ``model.json`` says of an export: where it came from, the data's shape and
    fingerprint, the recorded metrics and the whole job."""
    return {
        "format": export_format,
        "checkpoint": f"{str(saved.run).rstrip('/')}/{checkpoint_path(saved.name)}",
        "step": saved.meta["step"],
        "data_shape": saved.meta["data_shape"],
        "data_fingerprint": saved.meta.get("data_fingerprint"),
        "metrics": saved.meta.get("metrics", {}),
        "job": saved.job.model_dump(mode="json"),
    }


def write_description(out_dir: Path, described: dict[str, Any]) -> None:
    """Write ``model.json``."""
    (out_dir / MODEL_FILE).write_text(json.dumps(described, indent=2))


def read_description(export_dir: Path) -> dict[str, Any]:
    """An export's ``model.json``; ``format`` is ``safetensors`` for exports written before
    there were others."""
    described: dict[str, Any] = json.loads((export_dir / MODEL_FILE).read_text())
    return {"format": "safetensors", **described}
