"""Read an export back (either format), or a run's checkpoint, and measure it on its job's
test split.

``load_exported`` rebuilds the job's model from ``model.json`` and the export's weights: a
``safetensors`` export under Convoy's keys (one file, or shards with their index), an ``hf``
export through ``transformers`` from the folder itself. ``evaluate_exported`` runs the job's
task on the job's data in one process, as training measured it, so the metrics can be put
beside the recorded ones. ``evaluate_checkpoint`` does the same for a committed checkpoint of
a run, consolidated in memory (a LoRA run's adapters on their rebuilt base): the one named,
else the one ``convoy export`` would take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.config import job_from_saved
from convoy.data.loaders import eval_loader
from convoy.data.registry import check_dataset, load_splits
from convoy.engine.amp import Precision
from convoy.engine.evaluate import evaluate
from convoy.errors import ConvoyError
from convoy.export.adapters import adapted_model
from convoy.export.consolidate import (
    SavedCheckpoint,
    build_job_model,
    consolidated_model,
    description,
    read_checkpoint,
    read_description,
)
from convoy.export.shards import read_weights
from convoy.export.to_hf import HF_FORMAT, load_hf_export
from convoy.metrics import MetricsManager
from convoy.strategies.single import SingleStrategy
from convoy.tasks import build_task


def load_exported(export_dir: Path) -> tuple[nn.Module, dict[str, Any]]:
    """The exported model (on CPU, eval mode) and its description."""
    described = read_description(export_dir)
    job = job_from_saved(described["job"])
    if described["format"] == HF_FORMAT:
        return load_hf_export(export_dir, job, described["data_shape"]), described
    model = build_job_model(job, described["data_shape"])
    model.load_state_dict(read_weights(export_dir))
    return model.eval(), described


def evaluate_exported(export_dir: Path, overrides: list[str] | None = None) -> dict[str, float]:
    """Test metrics of an exported model, in one process, on its job's dataset, plus the
    data's reference figures for the test split (e.g. ``test/gzip_bpb``)."""
    model, described = load_exported(export_dir)
    return evaluate_model(model, described, overrides)


def evaluate_checkpoint(
    run: str | Path, checkpoint: str, overrides: list[str] | None = None
) -> tuple[dict[str, float], dict[str, Any]]:
    """Test metrics of a run's committed ``checkpoint``, as ``evaluate_exported`` measures an
    export of it, and its description (``model.json``'s fields: the metrics it recorded)."""
    saved = read_checkpoint(run, checkpoint)
    described = description(saved, "checkpoint")
    return evaluate_model(checkpoint_model(saved), described, overrides), described


def checkpoint_model(saved: SavedCheckpoint) -> nn.Module:
    """The checkpoint's model whole on one CPU device, in eval mode: a LoRA run's with its
    base rebuilt and its adapters read in (its checkpoints hold the adapters only)."""
    return consolidated_model(saved) if saved.job.model.lora is None else adapted_model(saved)


def evaluate_model(
    model: nn.Module, described: dict[str, Any], overrides: list[str] | None = None
) -> dict[str, float]:
    """Test metrics of ``model`` (on CPU, eval mode), in one process, on the dataset of the
    job ``described``, plus the data's reference figures for the test split."""
    # Overrides fix what moved since training, e.g. -o data.path=...; the recorded job is
    # checked only after they apply.
    job = job_from_saved(described["job"], overrides)
    check_dataset(job.data)
    splits = load_splits(job.data)
    trained_on, found = described.get("data_fingerprint"), splits.meta.get("fingerprint")
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
