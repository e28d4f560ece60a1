"""``convoy export --format safetensors``: Convoy's own format, for any model.

``model.safetensors`` holds the model's state dict under Convoy's keys, one tensor per key
(tied weights are written under each of their names, as the checkpoint holds them), and
``model.json`` the job that rebuilds the model. A model over ``--max-shard-size`` is split
into ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. The tensors
stream from the checkpoint a shard at a time (``shards``): the model is never built, and
never held whole. Loading it needs plain PyTorch and safetensors, no process group, and
unpickles nothing. A text run's tokenizer (``tokenizers`` JSON) is copied beside it.
"""

from __future__ import annotations

from pathlib import Path

from convoy.checkpoint import local_copy
from convoy.export.consolidate import description, read_checkpoint, write_description
from convoy.export.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    checkpoint_tensors,
    parse_size,
    write_shards,
)
from convoy.integrations.mlflow import log_export
from convoy.outputs import TOKENIZER_FILE
from convoy.storage import RunStorage

SAFETENSORS_FORMAT = "safetensors"


def export_checkpoint(
    run: str | Path,
    out_dir: Path,
    checkpoint: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``model.safetensors`` (or shards of at most ``max_shard_size`` bytes with their
    index) + ``model.json`` for a checkpoint; returns ``out_dir``."""
    shard_bytes = parse_size(max_shard_size)
    saved = read_checkpoint(run, checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    with local_copy(saved.run, saved.name) as path:
        write_shards(path, list(checkpoint_tensors(path).values()), out_dir, shard_bytes)
    write_description(out_dir, description(saved, SAFETENSORS_FORMAT))
    storage = RunStorage.at(run)
    if storage.exists(TOKENIZER_FILE):  # a text model travels with its tokenizer
        (out_dir / TOKENIZER_FILE).write_text(storage.read_text(TOKENIZER_FILE))
    log_export(run, out_dir, saved.name)  # into the run's MLflow run, when it had one
    return out_dir
