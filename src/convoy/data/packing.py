"""Samples of token ids laid out in rows of ``seq_len`` tokens: packed, or one a row.

An item is ``(inputs, targets)``: ``inputs = {"input_ids": LongTensor(T), "position_ids":
LongTensor(T)}`` and ``targets = LongTensor(T)``, the next token of each input or -100 where
it is not trained (``IGNORE_INDEX``). A sample's own targets end with -100 on its last token,
so no sample predicts the first token of the one after it.

Packed (``data.packing: true``): samples are placed into rows best-fit decreasing (each, the
longest first, into the row with the least room that holds it; deterministic, so every rank
builds the same rows); ``position_ids`` restart at 0 at each sample's first token, which is
how a model finds the boundaries (a sample starts where ``position_ids == 0``). A row's tail is
padding: the pad id, targets -100, positions counting 0, 1, 2... as a last dummy sample.
Padded (``false``): one sample a row, its positions 0..T-1 through the padding.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from convoy.data.base import Collated

IGNORE_INDEX = -100

Item = tuple[Any, torch.Tensor]
"""(inputs, targets); the inputs are a dict of tensors (``SizedDataset`` types inputs as
tensors, which ``Any`` satisfies)."""


@dataclass(frozen=True)
class Samples:
    """Samples one after the other: their ids and targets as flat arrays, and where each
    starts (``starts[i]:starts[i + 1]`` is sample ``i``)."""

    ids: np.ndarray
    targets: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)


def sample_targets(ids: list[int], trained: list[bool]) -> list[int]:
    """Each token's target: the next token where that one is trained, else -100; the last
    token's is -100."""
    targets = [ids[j + 1] if trained[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
    return [*targets, IGNORE_INDEX] if ids else []


def join_samples(ids: list[list[int]], targets: list[list[int]]) -> Samples:
    """Samples (each its ids and its targets) as one ``Samples``."""
    lengths = [len(sample) for sample in ids]
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    flat = [token for sample in ids for token in sample]
    flat_targets = [target for sample in targets for target in sample]
    return Samples(
        np.asarray(flat, dtype=np.int64), np.asarray(flat_targets, dtype=np.int64), starts
    )


def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Sample indices per row: best-fit decreasing into rows of ``capacity`` tokens (every
    length at most ``capacity``); ties in length keep the samples' order."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row), sorted; full rows leave it
    for index in order:
        size = int(lengths[index])
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            rows.append([index])
            left, row = capacity - size, len(rows) - 1
        else:
            left, row = room.pop(at)
            rows[row].append(index)
            left -= size
        if left > 0:
            bisect.insort(room, (left, row))
    return rows


class TokenRows(Dataset[Item]):
    """Rows of ``seq_len`` tokens built from ``samples``: ``rows[r]`` lists the samples of
    row ``r`` in order (one each when not ``packed``)."""

    def __init__(
        self,
        samples: Samples,
        rows: list[list[int]],
        seq_len: int,
        pad_id: int,
        packed: bool,
    ) -> None:
        self.samples = samples
        self.rows = rows
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packed = packed

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Item:
        ids, positions, targets = self._row(self.rows[index])
        return {"input_ids": ids, "position_ids": positions}, targets

    def __getitems__(self, indices: list[int]) -> Collated:
        """The rows at ``indices`` as one batch."""
        built = [self._row(self.rows[i]) for i in indices]
        ids, positions, targets = (torch.stack(parts) for parts in zip(*built, strict=True))
        return Collated(({"input_ids": ids, "position_ids": positions}, targets))

    def _row(self, members: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        samples, size = self.samples, self.seq_len
        ids = np.full(size, self.pad_id, dtype=np.int64)
        targets = np.full(size, IGNORE_INDEX, dtype=np.int64)
        positions = np.empty(size, dtype=np.int64)
        at = 0
        for sample in members:
            start, end = int(samples.starts[sample]), int(samples.starts[sample + 1])
            length = end - start
            ids[at : at + length] = samples.ids[start:end]
            targets[at : at + length] = samples.targets[start:end]
            positions[at : at + length] = np.arange(length)
            at += length
        # The tail: a dummy sample from position 0 when packed; the sample's own positions on.
        first = 0 if self.packed else at
        positions[at:] = np.arange(first, first + size - at)
        return torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(targets)


def token_rows(samples: Samples, seq_len: int, pad_id: int, packed: bool) -> TokenRows:
    """The samples (each at most ``seq_len`` tokens) as rows: packed or one a row."""
    rows = best_fit(samples.lengths(), seq_len) if packed else [[i] for i in range(len(samples))]
    return TokenRows(samples, rows, seq_len, pad_id, packed)
