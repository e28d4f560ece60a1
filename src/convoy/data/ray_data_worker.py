"""The ``ray_data`` loader on a Ray Train worker: the engine's batches from the plan the
driver made (``convoy.data.ray_data``).

Train: ``RayTrainBatches`` runs the torch loader's streamed plan (``PlannedTrainBatches``) over
the train units, reading each epoch through a Ray Dataset of this worker's own (its units in
the plan's order, the map stage, ``preserve_order``), bounded by its share of the object store.
Eval: ``RayEvalBatches`` reads this rank's chunk of each eval split (``get_dataset_shard``) and
pads it with masked batches to the common batch count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from convoy.config import Job
from convoy.data.base import Batch
from convoy.data.loaders import WorkerData
from convoy.data.ray_data import EVAL_SPLITS, keep_ray_data_notes_off_the_terminal, preprocessed
from convoy.data.ray_data_stages import ReadRowGroups, TrainUnits, from_columns
from convoy.data.streaming import PlannedTrainBatches, Rows

OBJECT_STORE_SHARE = 0.5
"""The share of the object store Ray Data's streaming executor takes by default."""


def _as_batch(batch: dict[str, torch.Tensor], seen: list[int] | None) -> Batch:
    if seen is not None:
        seen += batch["index"].tolist()
    return from_columns(batch), batch["y"]


class RayTrainBatches(PlannedTrainBatches):
    """This worker's micro-batches of each epoch: the plan of ``PlannedTrainBatches`` over the
    train units, which a Ray Dataset of this worker's reads and preprocesses in Ray tasks, in
    the plan's order (``preserve_order``)."""

    def __init__(
        self, units: TrainUnits, job: Job, micro_batch: int, world_size: int, rank: int
    ) -> None:
        self.units = units  # before the plan, whose refusal names what the units are
        super().__init__(
            units.rows,
            job.data.batch_size,
            micro_batch,
            world_size,
            rank,
            job.run.seed,
            units.window,
        )
        self.job = job
        self.world_size = world_size
        self.seen: list[int] | None = None
        """Set to a list to record the row indices handed out (for audits and tests)."""

    def too_few(self, units: int, world_size: int, rows: int) -> str:
        if isinstance(self.units.read, ReadRowGroups):
            return super().too_few(units, world_size, rows)
        return (
            f"data.batch_size: the train split's {sum(self.units.rows)} rows, dealt to "
            f"{world_size} ranks in chunks, leave a rank {rows} rows, fewer than one step's "
            f"{self.share}; lower data.batch_size or use fewer workers"
        )

    def __iter__(self) -> Iterator[Batch]:
        names = self.units.inputs
        for *inputs, y, index in self._rows():
            if self.seen is not None:
                self.seen += index.tolist()
            yield from_columns(dict(zip(names, inputs, strict=True))), y

    def _read_windows(
        self, windows: list[list[int]], orders: Iterator[torch.Tensor], epoch: int
    ) -> Iterator[Rows]:
        import ray.data  # the ray extra

        if not windows:
            return
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        # Augmentation draws differ every epoch, and are the same again on a resume.
        seed = hash((self.job.run.seed, epoch)) % 2**31
        positions = [p for window in windows for p in window]
        dataset = units_dataset(self.units, positions, self.job, seed, self.world_size)
        blocks = dataset.iter_batches(
            batch_size=None,
            batch_format="numpy",
            prefetch_batches=self.job.data.ray_data.prefetch_batches,
        )
        sizes = [sum(self.rows[p] for p in window) for window in windows]
        columns = (*self.units.inputs, "y", "index")
        windows_rows = cut_windows(iter(blocks), sizes, columns)
        for parts, order in zip(windows_rows, orders, strict=True):
            yield tuple(part[order] for part in parts)


def units_dataset(
    units: TrainUnits, positions: list[int], job: Job, seed: int, pipelines: int = 1
) -> Any:
    """A Ray Dataset of the given train units, read and preprocessed in that order; one of
    ``pipelines`` that run at once (one per train worker)."""
    import ray.data  # the ray extra

    items = [units.items[p] for p in positions]
    raw = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    return preprocessed(raw, units.read.with_seed(seed), job, True, pipelines)


def cut_windows(
    blocks: Iterator[dict[str, np.ndarray]],
    sizes: list[int],
    columns: tuple[str, ...] = ("x", "y", "index"),
) -> Iterator[Rows]:
    """The ``columns`` (the inputs', the targets, the row indices) of windows of ``sizes``
    rows, cut in order from blocks of any length."""
    pending: list[dict[str, np.ndarray]] = []
    have = 0
    for size in sizes:
        while have < size:
            block = next(blocks)
            pending.append(block)
            have += len(block["index"])
        joined = {k: np.concatenate([b[k] for b in pending]) for k in columns}
        yield tuple(torch.from_numpy(joined[k][:size]) for k in columns)
        pending = [{k: v[size:] for k, v in joined.items()}]
        have -= size


class RayEvalBatches:
    """This rank's contiguous chunk of an eval split, padded to the common batch count."""

    def __init__(
        self, shard: Any, batch_size: int, rows: list[int], rank: int, sample: list[Any]
    ) -> None:
        self.shard = shard
        self.batch_size = batch_size
        self.num_real = rows[rank]
        self.batches = math.ceil(max(rows) / batch_size)
        self.sample = sample
        """[(shape, dtype) of one input, of one target]: what a padding batch looks like."""
        self.seen: list[int] | None = None
        """Set to a list to record the row indices read (for audits and tests)."""

    def __iter__(self) -> Iterator[Batch]:
        produced = 0
        last: Batch | None = None
        if self.num_real:
            for batch in self.shard.iter_torch_batches(batch_size=self.batch_size, device="cpu"):
                last = _as_batch(batch, self.seen)
                produced += 1
                yield last
        while produced < self.batches:  # masked padding: the same forwards on every rank
            yield last if last is not None else self._empty()
            produced += 1

    def _empty(self) -> Batch:
        inputs, targets = self.sample
        return _zeros(inputs), _zeros(targets)


def _zeros(spec: Any) -> Any:
    """One row of zeros shaped by a sample spec: (shape, dtype name), or a dict of them."""
    if isinstance(spec, dict):
        return {key: _zeros(item) for key, item in spec.items()}
    shape, dtype = spec
    return torch.zeros(1, *shape, dtype=getattr(torch, dtype))


def ray_worker_data(job: Job, info: dict[str, Any], rank: int, world_size: int) -> WorkerData:
    """This Ray Train worker's data: its train plan, and its eval chunks
    (``get_dataset_shard``)."""
    import ray.data  # the ray extra
    import ray.train

    keep_ray_data_notes_off_the_terminal()
    accum = job.optim.grad_accum_steps
    micro = job.data.batch_size // (world_size * accum)
    # Every rank runs its own pipeline: together they keep to one pipeline's share of the
    # object store (Ray Data's default), which bounds what runs ahead of training.
    context = ray.data.DataContext.get_current()
    context.override_object_store_memory_limit_fraction = OBJECT_STORE_SHARE / world_size
    train = RayTrainBatches(info["train"], job, micro, world_size, rank)
    evals = {
        split: RayEvalBatches(
            ray.train.get_dataset_shard(f"{split}_{rank}"),
            job.data.eval_batch_size,
            info["eval_rows"][split],
            rank,
            info["sample"],
        )
        for split in EVAL_SPLITS
    }
    return WorkerData(
        train,
        evals["val"],
        evals["test"],
        info["shape"],
        info["sizes"],
        tuple(info["skipped"]),
        info["meta"],
    )
