"""Export a checkpoint to one consolidated safetensors file, and evaluate an export.

``export_checkpoint`` reads only the model entries of a sharded DCP checkpoint into a model
built on one CPU device (DCP reshards from any world size and strategy) and writes
``model.safetensors`` plus ``model.json`` (the model's name and arguments, the job config and
the test metrics recorded for that checkpoint). Loading an export needs plain PyTorch and
safetensors, no process group, and unpickles nothing.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn

from convoy.checkpoint import checkpoint_path, committed_checkpoints, local_copy, read_meta
from convoy.config import Job, job_from_saved
from convoy.data.loaders import eval_loader
from convoy.data.registry import check_dataset, load_splits
from convoy.engine.amp import Precision
from convoy.engine.evaluate import evaluate
from convoy.errors import ConvoyError
from convoy.integrations.mlflow import log_export
from convoy.metrics import MetricsManager
from convoy.models.registry import build_model
from convoy.outputs import TOKENIZER_FILE
from convoy.storage import RunStorage
from convoy.strategies.single import SingleStrategy
from convoy.tasks import build_task

WEIGHTS_FILE = "model.safetensors"
MODEL_FILE = "model.json"


def find_checkpoint(run: str | Path, checkpoint: str | None) -> str:
    """The name of the given committed checkpoint of a run (local or ``s3://``), or its latest."""
    found = committed_checkpoints(run)
    if not found:
        raise ConvoyError(f"RUN: {str(run)!r} has no committed checkpoints")
    if checkpoint is None:
        return found[-1]
    if checkpoint in found:
        return checkpoint
    raise ConvoyError(f"--checkpoint: got {checkpoint!r}; this run has: {', '.join(found)}")


def _build(job: Job, data_shape: dict[str, int]) -> nn.Module:
    return build_model(job.model.name, job.model.kwargs, data_shape)


def export_checkpoint(run: str | Path, out_dir: Path, checkpoint: str | None = None) -> Path:
    """Write ``model.safetensors`` + ``model.json`` for a checkpoint; returns ``out_dir``."""
    name = find_checkpoint(run, checkpoint)
    meta = read_meta(run, name)
    job = job_from_saved(meta["job"])  # the job that wrote this checkpoint
    model = _build(job, meta["data_shape"])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # no_dist=True is the point here: DCP's warning that there is no process group is noise.
    with local_copy(run, name) as path, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / WEIGHTS_FILE))
    description = {
        "checkpoint": f"{str(run).rstrip('/')}/{checkpoint_path(name)}",
        "step": meta["step"],
        "data_shape": meta["data_shape"],
        "data_fingerprint": meta.get("data_fingerprint"),
        "metrics": meta.get("metrics", {}),
        "job": job.model_dump(mode="json"),
    }
    (out_dir / MODEL_FILE).write_text(json.dumps(description, indent=2))
    storage = RunStorage.at(run)
    if storage.exists(TOKENIZER_FILE):  # a text model travels with its tokenizer
        (out_dir / TOKENIZER_FILE).write_text(storage.read_text(TOKENIZER_FILE))
    log_export(run, out_dir, name)  # into the run's MLflow run, when it had one
    return out_dir


def load_exported(export_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The exported model (on CPU, eval mode) and its description."""
    description = json.loads((export_dir / MODEL_FILE).read_text())
    job = job_from_saved(description["job"])
    model = _build(job, description["data_shape"])
    model.load_state_dict(load_file(str(export_dir / WEIGHTS_FILE)))
    return model.eval(), description


def evaluate_exported(export_dir: Path, overrides: list[str] | None = None) -> dict[str, float]:
    """Test metrics of an exported model, in one process, on its job's dataset, plus the
    data's reference figures for the test split (e.g. ``test/gzip_bpb``)."""
    model, description = load_exported(export_dir)
    # Overrides fix what moved since training, e.g. -o data.path=...; the recorded job is
    # checked only after they apply.
    job = job_from_saved(description["job"], overrides)
    check_dataset(job.data)
    splits = load_splits(job.data)
    trained_on, found = description.get("data_fingerprint"), splits.meta.get("fingerprint")
    if trained_on and found and trained_on != found:
        raise ConvoyError(
            f"data: the data {job.data.name!r} now gives different splits than the model was "
            f"trained on (fingerprint {found}, trained on {trained_on}); its tokenizer is "
            "built from them, so the metrics would not be comparable. Point -o data.path= at "
            "the original text"
        )
    task = build_task(job.task.name, job.task.kwargs)
    device = torch.device("cpu")
    loader = eval_loader(splits.test, job.data.eval_batch_size, 1, 0)
    precision = Precision(torch.float32, device, SingleStrategy(None, device, torch.float32))
    metrics = MetricsManager(task, splits.shape, device, splits.meta)
    measured = evaluate(model, task, loader, "test", metrics, precision, device)
    references = splits.meta.get("reference_metrics", {})
    return measured | {k: v for k, v in references.items() if k.startswith("test/")}
