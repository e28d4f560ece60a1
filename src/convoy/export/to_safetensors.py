"""``convoy export --format safetensors``: Convoy's own format, for any model.

``model.safetensors`` holds the model's state dict under Convoy's keys, one tensor per key
(tied weights are written under each of their names), and ``model.json`` the job that
rebuilds the model. Loading it needs plain PyTorch and safetensors, no process group, and
unpickles nothing. A text run's tokenizer (``tokenizers`` JSON) is copied beside it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from convoy.export.consolidate import (
    WEIGHTS_FILE,
    consolidated_model,
    description,
    read_checkpoint,
    write_description,
)
from convoy.integrations.mlflow import log_export
from convoy.outputs import TOKENIZER_FILE
from convoy.storage import RunStorage

SAFETENSORS_FORMAT = "safetensors"


def export_checkpoint(run: str | Path, out_dir: Path, checkpoint: str | None = None) -> Path:
    """Write ``model.safetensors`` + ``model.json`` for a checkpoint; returns ``out_dir``."""
    saved = read_checkpoint(run, checkpoint)
    model = consolidated_model(saved)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(unshared(model.state_dict()), str(out_dir / WEIGHTS_FILE))
    write_description(out_dir, description(saved, SAFETENSORS_FORMAT))
    storage = RunStorage.at(run)
    if storage.exists(TOKENIZER_FILE):  # a text model travels with its tokenizer
        (out_dir / TOKENIZER_FILE).write_text(storage.read_text(TOKENIZER_FILE))
    log_export(run, out_dir, saved.name)  # into the run's MLflow run, when it had one
    return out_dir


def unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with no two tensors sharing memory (safetensors refuses that): a tied weight
    is copied under its second name, so each key loads on its own."""
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone().contiguous() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    return tensors
