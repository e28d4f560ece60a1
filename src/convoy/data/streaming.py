"""The ``torch`` loader over streamed splits (``ShardedSplit``): row groups in, batches out,
with a bounded window in memory and the exactness rules of the in-memory loader.

Training. The split's row groups are dealt to the ranks once, in a seeded order, each to the
rank with the fewest rows so far: every rank reads only its own groups, so the data is read
once per epoch however many ranks there are. Each epoch a rank permutes its groups (seeded by
``seed``, epoch and rank), reads them ``window`` groups at a time (the next window in a
background thread while the current one trains) and permutes the rows inside each window.
All ranks train ``floor(min_rank_rows / share)`` steps (``share`` = global batch / ranks), so
every row is trained at most once per epoch and the few left over at the end of a rank's
stream are skipped (different ones every epoch). The order depends only on the row counts
in the footers, so resuming ``k`` steps into an epoch skips exactly the rows already trained
without reading them: the same samples in the same order, bitwise.

Unlike the in-memory sampler, which rows share a global batch depends on the world size, as
with Ray Data: reading every group on every rank to keep them world-size independent would
multiply the reads by the rank count.

Evaluation. Rank r reads its own contiguous chunk of ceil(N / W) rows, in order, and pads with
masked batches to the common batch count, so every row is counted exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from convoy.data.loaders import Batch
from convoy.data.samplers import eval_rows_per_rank
from convoy.data.shards import ShardedSplit
from convoy.errors import DataError


def deal_groups(split: ShardedSplit, world_size: int, seed: int) -> list[list[int]]:
    """Row-group positions per rank: a seeded order, each group to the rank with fewest rows."""
    order = np.random.default_rng([seed, 7]).permutation(len(split.groups))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    rows = [0] * world_size
    for position in order.tolist():
        rank = rows.index(min(rows))
        ranks[rank].append(position)
        rows[rank] += split.groups[position].rows
    return ranks


class StreamedTrainBatches:
    """This rank's micro-batches of each epoch, read from its own row groups."""

    def __init__(
        self,
        split: ShardedSplit,
        global_batch: int,
        micro_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        window: int,
    ) -> None:
        self.split = split
        self.micro_batch = micro_batch
        self.share = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.window = window
        dealt = deal_groups(split, world_size, seed)
        rows = [sum(split.groups[p].rows for p in mine) for mine in dealt]
        self.steps_per_epoch = min(rows) // self.share
        if not self.steps_per_epoch:
            raise DataError(
                f"data.path: the train split's {len(split.groups)} row group(s) give some of "
                f"the {world_size} ranks {min(rows)} rows, fewer than one step's {self.share}; "
                "write smaller row groups or more rows, or use fewer workers"
            )
        self.mine = dealt[rank]
        self.epoch = 0
        self.skip_rows = 0

    def __len__(self) -> int:
        return self.steps_per_epoch * self.share // self.micro_batch

    def start_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        self.epoch = epoch
        self.skip_rows = skip_steps * self.share

    def windows(self) -> list[list[int]]:
        """This epoch's windows of row-group positions, in reading order."""
        rng = np.random.default_rng([self.seed, self.epoch, self.rank])
        order = [self.mine[i] for i in rng.permutation(len(self.mine)).tolist()]
        return [order[i : i + self.window] for i in range(0, len(order), self.window)]

    def __iter__(self) -> Iterator[Batch]:
        batches = (self.steps_per_epoch * self.share - self.skip_rows) // self.micro_batch
        return itertools.islice(rebatch(self._window_rows(), self.micro_batch), batches)

    def _window_rows(self) -> Iterator[Batch]:
        """Each window's rows, permuted, from the first row not yet trained; windows wholly
        inside the rows already trained are not read. The next window is read in a thread
        while this one trains."""
        windows = self.windows()
        skip = self.skip_rows
        reader = ThreadPoolExecutor(max_workers=1)
        ahead: Future[Batch] | None = None
        try:
            for number, window in enumerate(windows):
                rows = sum(self.split.groups[p].rows for p in window)
                if skip >= rows:
                    skip -= rows
                    continue
                x, y = ahead.result() if ahead is not None else self._read(window)
                following = windows[number + 1] if number + 1 < len(windows) else None
                ahead = reader.submit(self._read, following) if following else None
                rng = np.random.default_rng([self.seed, self.epoch, self.rank, number])
                order = torch.from_numpy(rng.permutation(rows)[skip:])
                skip = 0
                yield x[order], y[order]
        finally:  # the epoch may stop early (max_steps): do not wait for a read ahead
            reader.shutdown(wait=False, cancel_futures=True)

    def _read(self, window: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.split.read(position) for position in window]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class StreamedEvalBatches:
    """This rank's contiguous chunk of an eval split, read in order, padded with masked
    batches to the batch count of the largest chunk."""

    def __init__(self, split: ShardedSplit, batch_size: int, world_size: int, rank: int) -> None:
        self.split = split
        self.batch_size = batch_size
        chunks = eval_rows_per_rank(len(split), world_size)
        self.start = sum(chunks[:rank])
        self.num_real = chunks[rank]
        self.batches = -(-max(chunks) // batch_size)

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        last: Batch | None = None
        for batch in self._real_batches():
            last = batch
            produced += 1
            yield batch
        while produced < self.batches:  # masked padding: the same forwards on every rank
            if last is None:
                x, y = self.split[0]
                last = x.unsqueeze(0), y.unsqueeze(0)
            yield last
            produced += 1

    def _real_batches(self) -> Iterator[Batch]:
        return rebatch(self._chunks(), self.batch_size, keep_last=True)

    def _chunks(self) -> Iterator[Batch]:
        """This rank's rows of each row group that holds some, in order."""
        end = self.start + self.num_real
        for position, group in enumerate(self.split.groups):
            if group.start + group.rows <= self.start or group.start >= end:
                continue
            x, y = self.split.read(position)
            lo, hi = max(self.start - group.start, 0), min(end - group.start, group.rows)
            yield x[lo:hi], y[lo:hi]


def rebatch(chunks: Iterator[Batch], size: int, keep_last: bool = False) -> Iterator[Batch]:
    """Batches of ``size`` rows cut from a stream of chunks of any length. Each chunk is
    joined to the previous one's leftover once (batches are views of that), so a large chunk
    is not copied again per batch; ``keep_last`` yields a final short batch."""
    left: Batch | None = None
    for x, y in chunks:
        if left is not None and len(left[0]):
            x, y = torch.cat([left[0], x]), torch.cat([left[1], y])
        whole = len(x) // size * size
        for start in range(0, whole, size):
            yield x[start : start + size], y[start : start + size]
        left = x[whole:], y[whole:]
    if keep_last and left is not None and len(left[0]):
        yield left
