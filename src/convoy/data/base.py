"""What every data source returns: three splits and the shape of one sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, default_collate

from convoy.errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
"""What a loader yields: a micro-batch's inputs and targets."""


class Collated(tuple):
    """A batch a dataset's ``__getitems__`` built whole: ``collate`` passes it on as it is.

    The DataLoader fetches a batch through ``__getitems__`` where a dataset has one; an
    in-memory dataset then slices its tensors once per batch instead of building and stacking
    a sample at a time (the step's host work on a small model)."""


def collate(data: Any) -> Any:
    """``default_collate``, except for a batch already built whole (``Collated``)."""
    if isinstance(data, Collated):
        return tuple(data)
    return default_collate(data)


class TensorImageDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images held in memory (uint8 or float) with per-channel normalization on access."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: tuple[float, ...] | None = None,
        std: tuple[float, ...] | None = None,
        scale: float = 1.0,
        crop_padding: int = 0,
        flip: bool = False,
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()
        self.scale = scale
        self.crop_padding = crop_padding
        self.flip = flip
        channels = images.shape[1]
        self.mean = torch.tensor(mean or (0.0,) * channels).view(-1, 1, 1)
        self.std = torch.tensor(std or (1.0,) * channels).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index].float() * self.scale
        # Before normalizing, so the padding is black, not the mean.
        image = augment(image, self.crop_padding, self.flip)
        return (image - self.mean) / self.std, self.labels[index]

    def __getitems__(self, indices: list[int]) -> Collated:
        """The samples at ``indices`` as one batch: the same values as ``__getitem__`` one by
        one (the same elementwise math, the augmentation's draws in the same order)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        images = self.images[index].float() * self.scale
        if self.crop_padding or self.flip:
            images = torch.stack([augment(x, self.crop_padding, self.flip) for x in images])
        return Collated(((images - self.mean) / self.std, self.labels[index]))


def augment(
    image: torch.Tensor,
    crop_padding: int,
    flip: bool,
    fill: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Training augmentation of one (C, H, W) image: a random shift, a horizontal flip."""
    if crop_padding:
        image = random_crop(image, crop_padding, fill, generator)
    if flip and torch.rand((), generator=generator).item() < 0.5:
        image = image.flip(-1)
    return image


def random_crop(
    image: torch.Tensor, padding: int, fill: float = 0.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Pad by ``padding`` with ``fill`` and crop back at a random offset (a random shift)."""
    size_h, size_w = image.shape[-2:]
    padded = torch.nn.functional.pad(image, (padding,) * 4, value=fill)
    top, left = torch.randint(0, 2 * padding + 1, (2,), generator=generator).tolist()
    return padded[..., top : top + size_h, left : left + size_w]


class SizedDataset(Protocol):
    """A map-style dataset with a length (what every Convoy source returns)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class Splits:
    """Train / val / test datasets plus what a model and a task need to know about them."""

    train: SizedDataset
    val: SizedDataset
    test: SizedDataset
    shape: dict[str, int]
    """Data-shaped model arguments (``num_classes``, ``in_channels``, ``image_size``,
    ``vocab_size``, ``seq_len``, ``num_features``...): passed to factories that accept them."""
    skipped: tuple[str, ...] = ()
    """Records left out under ``data.on_bad_record: skip``, with the reason."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Facts for the task and the summary that are not model arguments (a tokenizer's bytes
    per token, reference metrics such as gzip's bits per byte)."""


def image_shape(num_classes: int, in_channels: int, image_size: int) -> dict[str, int]:
    """The shape of an image-classification dataset."""
    return {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}


def given_path(path: str | None, expected: str) -> Path:
    """``data.path`` as a Path, or a ``ConfigError`` saying what the source expects there."""
    if not path:
        raise ConfigError("data.path", path, expected)
    return Path(path).expanduser()


def seeded_split(n: int, fractions: tuple[float, ...], seed: int) -> list[torch.Tensor]:
    """Shuffle ``range(n)`` with ``seed`` and cut off one index set per fraction; the rest last."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for fraction in fractions:
        size = round(n * fraction)
        parts.append(order[start : start + size])
        start += size
    parts.append(order[start:])
    return parts


def hold_out(n: int, fractions: tuple[float, ...], seed: int) -> list[torch.Tensor]:
    """``seeded_split`` where every held-out part gets at least one index and the rest (last)
    keeps at least one; a ``ValueError`` when ``n`` is too small for that."""
    sizes = [max(1, round(n * fraction)) for fraction in fractions]
    if sum(sizes) >= n:
        raise ValueError(
            f"{n} sample(s) cannot give {len(fractions)} held-out split(s) of at least one "
            "sample each and keep one for training"
        )
    return seeded_split(n, tuple(size / n for size in sizes), seed)
