"""A Hugging Face folder's weights, read by slice into a model laid out on meta.

A folder as the Hub ships it holds ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json`` (the name of each
tensor's file). ``FolderWeights`` reads the headers only (names, shapes, dtypes), checks them
against the model, and then reads each parameter's values straight into the memory a rank
holds: the rows or columns of its shard where the parameter is split (safetensors reads a
slice from the mapped file without the rest), in the parameter's dtype (the job's master
dtype, whatever the file's: bf16 or fp32). Parameters the folder lacks (a new head) keep the
model's own seeded init, as ``from_pretrained`` initializes its missing keys.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")
FIELD = "model.kwargs.path"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``: those its index lists, or ``model.safetensors``,
    or any ``*.safetensors``; none for a folder with a config only. A ``ConfigError`` for an
    index that lists a file the folder lacks, and for weights in another format."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(FIELD, str(folder), f"{INDEX_FILE} is unreadable: {exc}") from None
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            raise ConfigError(
                FIELD,
                str(folder),
                f"{INDEX_FILE} lists {', '.join(missing)}, which the folder does not have",
            )
        return [folder / name for name in files]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    others = sorted(p.name for pattern in OTHER_WEIGHTS for p in folder.glob(pattern))
    if others:
        raise ConfigError(
            FIELD,
            str(folder),
            f"its weights ({', '.join(others[:3])}) are not safetensors and no "
            f"{INDEX_FILE} lists any: save them with save_pretrained(safe_serialization=True)",
        )
    return []


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the folder, known from its file's header."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


class FolderWeights:
    """The tensors of a folder's safetensors files by name (headers only), and reading them
    into a model's parameters. ``prefix``: what the model's parameter names add to the
    file's (``model.`` for ``HuggingFaceModel``, which holds the ``transformers`` model as
    ``model``)."""

    def __init__(self, folder: Path, files: list[Path], prefix: str = "model.") -> None:
        from safetensors import safe_open

        self.folder = folder
        self.prefix = prefix
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as stored:
                for name in stored.keys():  # noqa: SIM118 (not a dict)
                    part = stored.get_slice(name)
                    self.tensors[name] = StoredTensor(
                        file, tuple(part.get_shape()), part.get_dtype()
                    )
        self.bytes_read = 0
        """Bytes this process has read from the files (what its slices hold)."""

    def stored_name(self, name: str) -> str | None:
        """The file's name for the model's parameter ``name``; None where it has none. A
        layer wrapped by LoRA (``<name>.base_layer``) reads ``<name>``'s weights."""
        stored = name.removeprefix(self.prefix).replace(".base_layer.", ".")
        return stored if name.startswith(self.prefix) and stored in self.tensors else None

    def check(self, model: nn.Module) -> list[str]:
        """Every stored tensor the model has must have its shape (``ConfigError`` naming the
        first that does not); returns the model's parameters the folder lacks."""
        missing = []
        for name, param in model.named_parameters():
            stored = self.stored_name(name)
            if stored is None:
                missing.append(name.removeprefix(self.prefix))
                continue
            shape = self.tensors[stored].shape
            if shape != tuple(param.shape):
                raise ConfigError(
                    FIELD,
                    str(self.folder),
                    f"{self.tensors[stored].file.name} holds {stored} with shape {list(shape)}, "
                    f"where the config's model has {list(param.shape)}",
                )
        return missing

    @torch.no_grad()
    def load_into(self, name: str, target: torch.Tensor) -> None:
        """Read the stored tensor of parameter ``name`` into ``target``: the part a DTensor
        holds on this rank (only those rows or columns are read), or all of it."""
        stored = self.stored_name(name)
        assert stored is not None
        # The file is mapped for this tensor only: pages read through a mapping count in the
        # process's resident set while it stays open (a rank would hold a quarter of every
        # file at the end, beside its shards).
        from safetensors import safe_open

        with safe_open(str(self.tensors[stored].file), framework="pt") as opened:
            self._read(opened.get_slice(stored), target)

    def _read(self, part: Any, target: torch.Tensor) -> None:
        if is_dtensor(target):
            from torch.distributed.tensor import DTensor

            assert isinstance(target, DTensor)
            local = target.to_local()
            region = local_region(target)
            values = part[region] if region is not None else part[:]
            if region is None:  # a layout without one region per rank: read whole, split
                from torch.distributed.tensor import distribute_tensor

                values = distribute_tensor(
                    values.to(local.dtype),
                    target.device_mesh,
                    target.placements,
                    src_data_rank=None,
                ).to_local()
            local.copy_(values)
        else:
            values = part[:]
            target.copy_(values)
        self.bytes_read += values.numel() * values.element_size()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing DTensor's modules where nothing has
    (they import sympy: 1 CPU-s a process that never lays out a model)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_region(target: Any) -> tuple[slice, ...] | None:
    """The rows/columns of the whole tensor a DTensor holds on this rank, where its placements
    are plain shards and replicas (one block per rank); None for others (strided shards
    of FSDP over tensor parallelism on the same dimension)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(p) not in (Shard, Replicate) for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        target.shape, target.device_mesh, target.placements
    )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
