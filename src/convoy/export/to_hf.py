"""``convoy export --format hf``: a folder ``transformers`` loads, for ``model.name: hf`` runs.

What ``save_pretrained`` writes, without the model: the job's model is built on the meta
device (names, shapes, ties; no memory), and its ``config.json`` (with the data's vocabulary
or labels, as trained) and, for a head that generates, ``generation_config.json`` are
written from it. The weights stream from the checkpoint a shard at a time (``shards``),
under the Hub's keys (Convoy's less the ``model.`` of ``HuggingFaceModel``), a tied weight
once, as ``save_pretrained`` keeps it (``from_pretrained`` ties it again): one
``model.safetensors``, or shards of at most ``--max-shard-size`` with
``model.safetensors.index.json``. The task's auto class then loads the folder:
``AutoModelForCausalLM``, ``AutoModelForSequenceClassification`` or
``AutoModelForImageClassification``. A model whose weights ``transformers`` converts on
saving (a mixture of experts whose experts it fuses when loading) is the exception: its
weights are converted all at once, so it is consolidated whole and ``save_pretrained``
writes it, in shards of the same size.

A LoRA run (``model.lora``) checkpoints its adapters only, so its folder is the merged model
(``merge``, ``--merge``): the base from ``model.kwargs.path`` (or the seeded init of a
config), the adapters folded in (``W + B A * alpha / r``, ``adapters.merged_model``), written
by ``save_pretrained``. That takes the whole model in one process, unlike the streamed
export; ``--format peft`` writes the adapters alone.

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

import torch
from torch import nn

from convoy.checkpoint import local_copy
from convoy.config import Job
from convoy.data.tokenizer import byte_level_chars
from convoy.errors import ConvoyError
from convoy.export.adapters import merged_model
from convoy.export.consolidate import (
    SavedCheckpoint,
    consolidated_model,
    description,
    read_checkpoint,
    skeleton_model,
    write_description,
)
from convoy.export.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    TensorEntry,
    checkpoint_tensors,
    parse_size,
    write_shards,
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


HUB_PREFIX = "model."
"""Convoy's key of a Hub weight: ``HuggingFaceModel`` holds the ``transformers`` model as
``model``."""


def export_hf(
    run: str | Path,
    out_dir: Path,
    checkpoint: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    merge: bool = False,
) -> Path:
    """Write a ``transformers`` folder (plus ``model.json``) for a checkpoint of an ``hf``
    run, its weights in shards of at most ``max_shard_size`` bytes; returns ``out_dir``.
    ``merge``: a LoRA run's, its adapters merged into the base (the whole model in memory)."""
    shard_bytes = parse_size(max_shard_size)
    saved = read_checkpoint(run, checkpoint)
    check_hf_job(saved.job)
    check_merge(saved, merge)
    out_dir.mkdir(parents=True, exist_ok=True)
    if merge:
        save_pretrained(merged_model(saved), out_dir, shard_bytes)
    else:
        write_hub_weights(saved, out_dir, shard_bytes)
    tokenizer = write_tokenizer(saved, out_dir)
    write_description(out_dir, description(saved, HF_FORMAT) | {"tokenizer": tokenizer})
    log_export(run, out_dir, f"{saved.name}-{HF_FORMAT}")  # beside a safetensors export
    return out_dir


def write_hub_weights(saved: SavedCheckpoint, out_dir: Path, shard_bytes: int) -> None:
    """The config and weights, streamed from the checkpoint a shard at a time where the
    model's weights are saved as they are held."""
    inner: Any = skeleton_model(saved).model  # a transformers PreTrainedModel, on meta
    weights = hub_weights(inner)
    if weights is None:
        save_pretrained(consolidated_model(saved), out_dir, shard_bytes)
        return
    write_hf_config(inner, out_dir)
    with local_copy(saved.run, saved.name) as path:
        write_shards(path, hub_entries(path, weights), out_dir, shard_bytes)


def hub_weights(inner: Any) -> dict[str, torch.Tensor] | None:
    """The weights ``save_pretrained`` writes for this (meta) model, in its order, by name:
    its state dict less the keys it ignores on saving and the tied copies. None where
    ``transformers`` converts weights on saving, which takes them all at once."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = inner.state_dict()
    for ignored in inner._keys_to_ignore_on_save or ():
        state.pop(ignored, None)
    kept: dict[str, torch.Tensor] = remove_tied_weights_from_state_dict(state, inner)
    converted = revert_weight_conversion(inner, dict(kept))
    return kept if set(converted) == set(kept) else None


def hub_entries(path: Path, weights: dict[str, torch.Tensor]) -> list[TensorEntry]:
    """The checkpoint's tensors (at ``path``) of these Hub weights of the model, named as the
    Hub names them, in the model's dtype; one line where the checkpoint lacks one or holds
    it in another shape."""
    held = checkpoint_tensors(path)
    entries = []
    for name, weight in weights.items():
        found = held.get(HUB_PREFIX + name)
        if found is None or found.shape != tuple(weight.shape):
            has = "no tensor" if found is None else f"a tensor of shape {list(found.shape)}"
            raise ConvoyError(
                f"checkpoint {path.name} has {has} for the job's model's {HUB_PREFIX}{name} "
                f"(shape {list(weight.shape)}): it was written by another model"
            )
        entries.append(TensorEntry(name, found.key, found.shape, weight.dtype))
    return entries


def write_hf_config(inner: Any, out_dir: Path) -> None:
    """``config.json`` (and ``generation_config.json`` for a head that generates), as
    ``save_pretrained`` writes them for this model."""
    inner.config.dtype = str(inner.dtype).split(".")[1]
    inner.config.architectures = [type(inner).__name__]
    inner.config.save_pretrained(str(out_dir))
    if inner.can_generate():
        inner.generation_config.save_pretrained(str(out_dir))


def save_pretrained(model: nn.Module, out_dir: Path, shard_bytes: int) -> None:
    """The whole model (on one CPU device) written by ``save_pretrained``: for a model whose
    weights ``transformers`` converts on saving, and a LoRA run's merged model."""
    assert isinstance(model, HuggingFaceModel)
    transformers_module().utils.logging.disable_progress_bar()  # one small bar per file
    inner: Any = model.model
    inner.save_pretrained(str(out_dir), max_shard_size=shard_bytes)


def check_hf_job(job: Job) -> None:
    """Only a ``transformers`` model has a ``transformers`` folder to write."""
    if job.model.name != "hf":
        raise ConvoyError(
            f"--format: got 'hf'; this run's model is {job.model.name!r} (model.name), not a "
            "transformers model (model.name: hf): use --format safetensors"
        )


def check_merge(saved: SavedCheckpoint, merge: bool) -> None:
    """A LoRA run's checkpoint holds its adapters only: its folder is the merged model
    (``--merge``); a run without adapters has nothing to merge."""
    if merge and saved.job.model.lora is None:
        raise ConvoyError(
            f"--merge: run {saved.run} has no model.lora adapters to merge; drop --merge"
        )
    if not merge and saved.job.model.lora is not None:
        raise ConvoyError(
            f"--format: got 'hf'; run {saved.run} trained model.lora adapters, which its "
            "checkpoints hold without the base: add --merge for the merged model, or use "
            "--format peft for the adapters"
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
