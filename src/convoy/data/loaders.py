"""DataLoaders for the torch path: exact global batches for training, padded shards for eval."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from convoy.data.base import SizedDataset
from convoy.data.samplers import GlobalBatchSampler, ShardedEvalSampler


def train_loader(
    dataset: SizedDataset,
    global_batch: int,
    micro_batch: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int = 0,
    device: torch.device | None = None,
) -> DataLoader:
    """Micro-batches of this rank's share of every global batch; call ``sampler.set_epoch``."""
    sampler = GlobalBatchSampler(dataset, global_batch, world_size, rank, seed=seed)
    return DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=micro_batch,
        sampler=sampler,
        num_workers=num_workers,
        pin_memory=device is not None and device.type == "cuda",
        persistent_workers=num_workers > 0,
    )


def eval_loader(
    dataset: SizedDataset, batch_size: int, world_size: int, rank: int, num_workers: int = 0
) -> DataLoader:
    """Every sample once across ranks (plus masked padding); ``loader.sampler.num_real``."""
    sampler = ShardedEvalSampler(dataset, world_size, rank)
    return DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
    )
