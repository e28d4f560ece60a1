"""``convoy export --format peft``: a LoRA run's adapters as PEFT saves them.

A run with ``model.lora`` checkpoints its adapters only (and their optimizer state): the
frozen base is the model's folder (``model.kwargs.path``) or its seeded init, rebuilt at
every start. So the adapter export is small and needs no base: ``adapter_config.json`` (the
``LoraConfig`` of ``model.lora``, ``base_model_name_or_path`` the run's model folder) and
``adapter_model.safetensors``, the checkpoint's adapter tensors read straight from the DCP
shards under the names PEFT's ``get_peft_model_state_dict`` gives them
(``base_model.model.<transformers' name>.lora_A.weight``, no adapter name). Then
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(FOLDER), EXPORT)`` loads
it. The tokenizer that made the training ids is written beside it, as for ``--format hf``.
Another model (Convoy's ``gpt``) gets the same files under its own names, with no
``task_type`` and no folder: ``from_pretrained`` over Convoy's model of the run (its seeded
init, ``build_initial``) loads them, as PEFT loads adapters over any torch module.

``--format hf --merge`` writes the merged model instead (``adapters``, ``to_hf``).

``peft`` is the ``lora`` extra, imported only here and only for a LoRA run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from convoy.checkpoint import local_copy
from convoy.errors import ConvoyError
from convoy.export.consolidate import SavedCheckpoint, read_checkpoint
from convoy.export.shards import TensorEntry, checkpoint_tensors, read_tensors
from convoy.export.to_hf import write_tokenizer
from convoy.models.lora import ADAPTER, peft_module

PEFT_FORMAT = "peft"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"

PEFT_PREFIX = "base_model.model."
"""Where ``PeftModel`` keeps the model it adapts: its keys start so."""

HUB_PREFIX = "model."
"""Convoy's key of a Hub weight: ``HuggingFaceModel`` holds the ``transformers`` model as
``model`` (as ``to_hf`` says)."""

TASK_TYPES = {"causal_lm": "CAUSAL_LM"}
"""PEFT's ``task_type`` for the ``hf`` heads it has a class for (``PeftModelForCausalLM``);
another head is adapted as a plain ``PeftModel``."""


def export_peft(run: str | Path, out_dir: Path, checkpoint: str | None = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (and the tokenizer) of
    a LoRA run's checkpoint into ``out_dir``, as ``PeftModel.save_pretrained`` writes them;
    returns ``out_dir``. Only the adapters are read."""
    saved = read_checkpoint(run, checkpoint)
    check_lora_run(saved, PEFT_FORMAT)
    out_dir.mkdir(parents=True, exist_ok=True)
    with local_copy(saved.run, saved.name) as path:
        entries = adapter_entries(path, saved.job.model.name == "hf")
        save_file(
            read_tensors(path, entries),
            str(out_dir / ADAPTER_WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
    config = adapter_config(saved)
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(saved, out_dir)
    return out_dir


def check_lora_run(saved: SavedCheckpoint, export_format: str) -> None:
    """Adapters to export need a run that trained them (``model.lora``)."""
    if saved.job.model.lora is None:
        raise ConvoyError(
            f"--format: got {export_format!r}; run {saved.run} has no model.lora adapters: "
            "use --format safetensors, or --format hf for a transformers model"
        )


def peft_name(key: str, hub: bool) -> str:
    """PEFT's name of a checkpoint's adapter tensor: ``base_model.model.`` + the model's name
    (``transformers``' for an ``hf`` model), less the adapter's name."""
    name = key.removeprefix(HUB_PREFIX) if hub else key
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_entries(path: Path, hub: bool) -> list[TensorEntry]:
    """The checkpoint's adapter tensors (at ``path``), named as PEFT saves them; one line where
    it holds none."""
    held = checkpoint_tensors(path)
    entries = [
        TensorEntry(peft_name(key, hub), key, entry.shape, entry.dtype)
        for key, entry in held.items()
        if ".lora_A." in key or ".lora_B." in key
    ]
    if not entries:
        raise ConvoyError(f"checkpoint {path.name} holds no LoRA adapters (lora_A / lora_B)")
    return entries


def adapter_config(saved: SavedCheckpoint) -> dict[str, Any]:
    """``adapter_config.json``: ``model.lora`` as PEFT's ``LoraConfig``, in inference mode (as
    ``save_pretrained`` sets it), over the run's model folder."""
    model, lora = saved.job.model, saved.job.model.lora
    assert lora is not None  # check_lora_run
    head = model.kwargs.get("head", "auto")
    task = TASK_TYPES.get("causal_lm" if head == "auto" else head) if model.name == "hf" else None
    config = peft_module().LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        init_lora_weights=True,
        inference_mode=True,
        task_type=task,
        base_model_name_or_path=model.kwargs.get("path"),
    )
    described: dict[str, Any] = config.to_dict()
    described["target_modules"] = sorted(described["target_modules"])  # a set in LoraConfig
    return described
