"""Samplers that make distributed data exact.

Training: ``GlobalBatchSampler`` shuffles the whole dataset once per epoch (seeded by
``seed + epoch``, like ``DistributedSampler``) and cuts it into *global* batches; each rank
takes its contiguous share of every global batch. Step k therefore sees the same samples
whatever the world size, which is what makes ``single`` on batch B and ``ddp`` on B/2 per rank
agree. The remainder rule is drop_last: the last ``len % global_batch`` samples of each
shuffled epoch are skipped (different ones every epoch).

Evaluation: ``ShardedEvalSampler`` gives rank r the indices r, r+W, r+2W, ... and pads every
rank to the same length so sharded models run the same number of collectives; the engine
masks the padding out, so every sample is counted exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler, Sampler


class GlobalBatchSampler(DistributedSampler):
    """A ``DistributedSampler`` whose ranks split each global batch (call ``set_epoch``)."""

    def __init__(
        self,
        dataset: Sized,
        global_batch: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch % num_replicas:
            raise ValueError(f"global batch {global_batch} not divisible by {num_replicas} ranks")
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.global_batch = global_batch
        self.steps_per_epoch = len(dataset) // global_batch
        self.share = global_batch // num_replicas
        self.num_samples = self.steps_per_epoch * self.share
        self.total_size = self.steps_per_epoch * global_batch
        self.skip_steps = 0

    def skip(self, steps: int) -> None:
        """Start the current epoch after ``steps`` global batches (resuming mid-epoch)."""
        self.skip_steps = steps

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            order = torch.randperm(
                n, generator=torch.Generator().manual_seed(self.seed + self.epoch)
            )
        else:
            order = torch.arange(n)
        batches = order[: self.total_size].view(self.steps_per_epoch, self.global_batch)
        mine = batches[self.skip_steps :, self.rank * self.share : (self.rank + 1) * self.share]
        return iter(mine.reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples - self.skip_steps * self.share


class ShardedEvalSampler(Sampler[int]):
    """Strided shard of an eval split, padded to equal length; ``num_real`` are genuine."""

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        self.size = len(dataset)
        self.indices = list(range(rank, self.size, num_replicas))
        self.num_real = len(self.indices)
        padded = math.ceil(self.size / num_replicas)
        # Repeat a real index as padding; the engine drops everything past num_real.
        self.indices += [self.indices[0] if self.indices else 0] * (padded - self.num_real)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def eval_rows_per_rank(size: int, world_size: int) -> list[int]:
    """Contiguous chunks of ceil(size / W) rows; the last ranks may get fewer (or none)."""
    chunk = math.ceil(size / world_size)
    return [max(0, min(chunk, size - r * chunk)) for r in range(world_size)]
