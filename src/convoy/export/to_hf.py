"""``convoy export --format hf``: a folder ``transformers`` loads, for ``model.name: hf`` runs.

The consolidated checkpoint's inner ``transformers`` model writes itself with
``save_pretrained``: ``config.json`` (with the data's vocabulary or labels, as trained),
``generation_config.json`` for a head that generates, and ``model.safetensors`` under the
Hub's keys, a tied weight once (``from_pretrained`` ties it again). The task's auto class
then loads the folder: ``AutoModelForCausalLM``, ``AutoModelForSequenceClassification`` or
``AutoModelForImageClassification``.

The tokenizer is the one that made the training ids, so ``AutoTokenizer`` gives the ids the
model learned: the run's BPE (its ``tokenizer.json``) or the 256 UTF-8 bytes, each wrapped
as a ``PreTrainedTokenizerFast``; else the tokenizer files of ``model.kwargs.path`` (a run
that used the model's own tokenizer, or data that came tokenized); else none, and
``model.json`` says so. ``model.json`` is Convoy's description, as in every export, so
``convoy evaluate`` takes this folder too (``load_hf_export``).

``transformers`` is the ``hf`` extra: it is imported through ``convoy.models.huggingface``
only when an export is written or read.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn

from convoy.config import Job
from convoy.data.tokenizer import byte_level_chars
from convoy.errors import ConvoyError
from convoy.export.consolidate import (
    SavedCheckpoint,
    consolidated_model,
    description,
    read_checkpoint,
    write_description,
)
from convoy.integrations.mlflow import log_export
from convoy.models.huggingface import HuggingFaceModel, transformers_module
from convoy.models.registry import build_model
from convoy.outputs import TOKENIZER_FILE
from convoy.storage import RunStorage

HF_FORMAT = "hf"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files ``save_pretrained`` writes for the tokenizers of ``transformers`` (one model
has a few of them); ``tokenizer_config.json`` is always among them."""

TOKENIZER_NOTES = {
    "bpe": "tokenizer: the run's BPE, for AutoTokenizer",
    "bytes": "tokenizer: UTF-8 bytes as ids 0-255, for AutoTokenizer",
    "model": "tokenizer: the files of model.kwargs.path",
    None: "no tokenizer: the run had none of its own and model.kwargs.path holds none",
}
"""What ``model.json``'s ``tokenizer`` means, as the command says it."""


def export_hf(run: str | Path, out_dir: Path, checkpoint: str | None = None) -> Path:
    """Write a ``transformers`` folder (plus ``model.json``) for a checkpoint of an ``hf``
    run; returns ``out_dir``."""
    saved = read_checkpoint(run, checkpoint)
    check_hf_job(saved.job)
    model = consolidated_model(saved)
    assert isinstance(model, HuggingFaceModel)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformers = transformers_module()
    transformers.utils.logging.disable_progress_bar()  # one small bar per file written
    inner: Any = model.model  # a transformers PreTrainedModel
    inner.save_pretrained(str(out_dir))
    tokenizer = write_tokenizer(saved, out_dir)
    write_description(out_dir, description(saved, HF_FORMAT) | {"tokenizer": tokenizer})
    log_export(run, out_dir, f"{saved.name}-{HF_FORMAT}")  # beside a safetensors export
    return out_dir


def check_hf_job(job: Job) -> None:
    """Only a ``transformers`` model has a ``transformers`` folder to write."""
    if job.model.name != "hf":
        raise ConvoyError(
            f"--format: got 'hf'; this run's model is {job.model.name!r} (model.name), not a "
            "transformers model (model.name: hf): use --format safetensors"
        )


def write_tokenizer(saved: SavedCheckpoint, out_dir: Path) -> str | None:
    """Write the tokenizer that made the run's token ids; returns which (``TOKENIZER_NOTES``)."""
    data, storage = saved.job.data, RunStorage.at(saved.run)
    if data.tokenizer == "bpe" and storage.exists(TOKENIZER_FILE):
        save_fast_tokenizer(storage.read_text(TOKENIZER_FILE), out_dir)
        return "bpe"
    if data.tokenizer == "bytes" and saved.meta["data_shape"].get("vocab_size") == 256:
        save_fast_tokenizer(byte_tokenizer_json(), out_dir)
        return "bytes"
    # The tokenizer the data read (data.tokenizer: model), else the model folder's own.
    folder = data.tokenizer_path or saved.job.model.kwargs.get("path")
    if folder and copy_tokenizer_files(Path(folder), out_dir):
        return "model"
    return None


def save_fast_tokenizer(tokenizer_json: str, out_dir: Path) -> None:
    """A ``tokenizers`` JSON as ``transformers``' fast tokenizer (``tokenizer.json`` and
    ``tokenizer_config.json``), which ``AutoTokenizer`` loads."""
    import tokenizers  # the text extra, which the hf extra brings

    transformers = transformers_module()
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(out_dir))


def byte_tokenizer_json() -> str:
    """``data.tokenizer: bytes`` as a ``tokenizers`` JSON: a byte-level BPE with no merges
    whose 256 tokens are GPT-2's characters for the bytes, each token id its byte's value."""
    import tokenizers  # the text extra, which the hf extra brings

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=byte_level_chars(), merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    return str(tokenizer.to_str())


def copy_tokenizer_files(folder: Path, out_dir: Path) -> bool:
    """Copy the tokenizer files of a ``save_pretrained`` folder; False where it has none."""
    if not (folder / "tokenizer_config.json").is_file():
        return False
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out_dir / name)
    return True


def load_hf_export(export_dir: Path, job: Job, data_shape: dict[str, int]) -> nn.Module:
    """An ``hf`` export as the job's model (on CPU): ``model.name: hf`` built from the
    folder, which holds the config and weights as trained."""
    kwargs: dict[str, Any] = {**job.model.kwargs, "path": str(export_dir)}
    kwargs.pop("config", None)
    return build_model("hf", kwargs, data_shape).eval()
