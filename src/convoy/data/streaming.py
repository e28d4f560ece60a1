"""The ``torch`` loader over streamed splits (``ShardedSplit``): row groups in, batches out,
with a bounded window in memory and the exactness rules of the in-memory loader.

Training. The split's row groups are dealt to the ranks once, in a seeded order, each to the
rank with the fewest rows so far: every rank reads only its own groups, so the data is read
once per epoch however many ranks there are. Each epoch a rank permutes its groups (seeded by
``seed``, epoch and rank), reads them ``window`` groups at a time (the next ``readers``
windows in as many background threads while the current one trains) and permutes the rows
inside each window, in the reading thread. An epoch's first window is read from
``start_epoch`` on, so an engine that starts the next epoch before evaluating the last finds
its first batches ready.
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
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import numpy as np
import torch

from convoy.data.base import Batch
from convoy.data.samplers import eval_rows_per_rank
from convoy.data.shards import ShardedSplit
from convoy.errors import DataError

Rows = tuple[torch.Tensor, ...]
"""Tensors of the same rows: (inputs, targets), with the rows' indices where recorded."""

T = TypeVar("T")
_END = object()


class FirstAhead(Generic[T]):
    """An iterator whose first item is fetched at once, in a background thread; the rest
    are fetched as they are asked for, in the asking thread."""

    def __init__(self, items: Iterator[T]) -> None:
        self.items = items
        fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convoy-first-window")
        self.first: Future[object] = fetcher.submit(next, items, _END)
        fetcher.shutdown(wait=False)  # the fetch runs on; nothing else is submitted

    def __iter__(self) -> Iterator[T]:
        first = self.first.result()
        if first is _END:
            return
        yield first  # type: ignore[misc]
        yield from self.items


def deal_groups(rows: list[int], world_size: int, seed: int) -> list[list[int]]:
    """Group positions per rank: a seeded order, each group (of ``rows[p]`` rows) to the rank
    with fewest rows so far."""
    order = np.random.default_rng([seed, 7]).permutation(len(rows))
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    dealt = [0] * world_size
    for position in order.tolist():
        rank = dealt.index(min(dealt))
        ranks[rank].append(position)
        dealt[rank] += rows[position]
    return ranks


class PlannedTrainBatches:
    """This rank's micro-batches of each epoch over groups of known row counts: the plan of
    the module docstring (deal, per-epoch windows, permutation, exact skip). Subclasses read
    the windows (``_read_windows``)."""

    def __init__(
        self,
        rows: list[int],
        global_batch: int,
        micro_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        window: int,
    ) -> None:
        self.rows = rows
        self.micro_batch = micro_batch
        self.share = global_batch // world_size
        self.rank = rank
        self.seed = seed
        self.window = window
        dealt = deal_groups(rows, world_size, seed)
        per_rank = [sum(rows[p] for p in mine) for mine in dealt]
        self.steps_per_epoch = min(per_rank) // self.share
        if not self.steps_per_epoch:
            raise DataError(self.too_few(len(rows), world_size, min(per_rank)))
        self.mine = dealt[rank]
        self.epoch = 0
        self.skip_rows = 0
        self.started: FirstAhead[Rows] | None = None
        """The started epoch's windows, until they are iterated."""

    def too_few(self, units: int, world_size: int, rows: int) -> str:
        """The one-line error when a rank gets less than one step's rows."""
        return (
            f"data.path: the train split's {units} row group(s) leave a rank of {world_size} "
            f"with {rows} rows, fewer than one step's {self.share}; write smaller row groups "
            "or more rows, or use fewer workers"
        )

    def __len__(self) -> int:
        return self.steps_per_epoch * self.share // self.micro_batch

    def start_epoch(self, epoch: int, skip_steps: int = 0) -> None:
        """Begin ``epoch`` after ``skip_steps`` steps, and start reading its first window in
        the background (again for the same epoch: the reading already started goes on)."""
        if self.started is not None and (self.epoch, self.skip_rows) == (
            epoch,
            skip_steps * self.share,
        ):
            return
        self.epoch = epoch
        self.skip_rows = skip_steps * self.share
        self.started = FirstAhead(self._window_rows(epoch, self.skip_rows))

    def windows(self, epoch: int) -> list[list[int]]:
        """``epoch``'s windows of group positions, in reading order."""
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        order = [self.mine[i] for i in rng.permutation(len(self.mine)).tolist()]
        return [order[i : i + self.window] for i in range(0, len(order), self.window)]

    def __iter__(self) -> Iterator[Batch]:
        return ((rows[0], rows[1]) for rows in self._rows())

    def _rows(self) -> Iterator[Rows]:
        batches = (self.steps_per_epoch * self.share - self.skip_rows) // self.micro_batch
        windows = self.started or self._window_rows(self.epoch, self.skip_rows)
        self.started = None
        return itertools.islice(rebatch(iter(windows), self.micro_batch), batches)

    def _window_rows(self, epoch: int, skip: int) -> Iterator[Rows]:
        """Each window's rows of ``epoch``, permuted, from row ``skip`` on; windows wholly
        inside the rows skipped are not read."""
        left: list[tuple[int, list[int], int]] = []  # (window number, positions, rows to skip)
        for number, window in enumerate(self.windows(epoch)):
            rows = sum(self.rows[p] for p in window)
            if skip >= rows:
                skip -= rows
                continue
            left.append((number, window, skip))
            skip = 0
        # Orders are drawn as windows are read: a long epoch's would not fit in memory.
        orders = (self._order(epoch, number, window, skipped) for number, window, skipped in left)
        return self._read_windows([window for _, window, _ in left], orders, epoch)

    def _order(self, epoch: int, number: int, window: list[int], skipped: int) -> torch.Tensor:
        """The rows of window ``number`` of ``epoch`` in training order (indices into its
        groups' rows one after the other), less the first ``skipped``."""
        rng = np.random.default_rng([self.seed, epoch, self.rank, number])
        return torch.from_numpy(rng.permutation(sum(self.rows[p] for p in window))[skipped:])

    def _read_windows(
        self, windows: list[list[int]], orders: Iterator[torch.Tensor], epoch: int
    ) -> Iterator[Rows]:
        """The rows of each window of ``epoch``, in its order (``orders``: one per window, in
        turn; see ``_order``)."""
        raise NotImplementedError


class StreamedTrainBatches(PlannedTrainBatches):
    """The plan over a ``ShardedSplit``, read in this process: the next ``readers`` windows
    in background threads while the current one trains."""

    def __init__(
        self,
        split: ShardedSplit,
        global_batch: int,
        micro_batch: int,
        world_size: int,
        rank: int,
        seed: int,
        window: int,
        readers: int = 2,
    ) -> None:
        self.split = split
        self.readers = readers
        """Threads that read the next windows at once (each window whole, in order)."""
        # Units are the row groups that hold rows (as Ray Data's), so both deal alike.
        self.positions = [p for p, group in enumerate(split.groups) if group.rows]
        rows = [split.groups[p].rows for p in self.positions]
        super().__init__(rows, global_batch, micro_batch, world_size, rank, seed, window)

    def _read_windows(
        self, windows: list[list[int]], orders: Iterator[torch.Tensor], epoch: int
    ) -> Iterator[Rows]:
        readers = ThreadPoolExecutor(self.readers, thread_name_prefix="convoy-reader")
        ahead: deque[Future[Rows]] = deque()
        following = zip(windows, orders, strict=True)
        try:
            for _ in windows:
                # This window and the next ``readers``: they are read while this one trains.
                for window, order in itertools.islice(following, self.readers + 1 - len(ahead)):
                    ahead.append(readers.submit(self._read, window, order))
                yield ahead.popleft().result()
        finally:  # the epoch may stop early (max_steps): do not wait for the reads ahead
            readers.shutdown(wait=False, cancel_futures=True)

    def _read(self, window: list[int], order: torch.Tensor) -> Rows:
        """A window's rows in training order, decoded and permuted here in the reading
        thread: the training thread only slices batches."""
        parts = [self.split.read(self.positions[unit]) for unit in window]
        return tuple(torch.cat([p[i] for p in parts])[order] for i in (0, 1))


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
        batches = rebatch(self._chunks(), self.batch_size, keep_last=True)
        return ((rows[0], rows[1]) for rows in batches)

    def _chunks(self) -> Iterator[Batch]:
        """This rank's rows of each row group that holds some, in order."""
        end = self.start + self.num_real
        for position, group in enumerate(self.split.groups):
            if group.start + group.rows <= self.start or group.start >= end:
                continue
            x, y = self.split.read(position)
            lo, hi = max(self.start - group.start, 0), min(end - group.start, group.rows)
            yield x[lo:hi], y[lo:hi]


def rebatch(chunks: Iterator[Rows], size: int, keep_last: bool = False) -> Iterator[Rows]:
    """Batches of ``size`` rows cut from a stream of chunks of any length (tuples of tensors
    of the same rows). A batch inside a chunk is a view of it; only a batch that spans chunks
    is copied together, so no chunk is copied whole (this runs in the training thread);
    ``keep_last`` yields a final short batch."""
    pending: list[Rows] = []  # the pieces of a batch that spans chunks
    have = 0
    for parts in chunks:
        rows, start = len(parts[0]), 0
        if pending:
            start = min(size - have, rows)
            pending.append(tuple(part[:start] for part in parts))
            have += start
            if have < size:
                continue
            yield tuple(torch.cat(pieces) for pieces in zip(*pending, strict=True))
            pending, have = [], 0
        whole = start + (rows - start) // size * size
        for first in range(start, whole, size):
            yield tuple(part[first : first + size] for part in parts)
        if whole < rows:
            pending, have = [tuple(part[whole:] for part in parts)], rows - whole
    if keep_last and pending:
        yield tuple(torch.cat(pieces) for pieces in zip(*pending, strict=True))
