"""Samplers: every world size sees the same global batches; eval shards count each sample once."""

from __future__ import annotations

import itertools
import math

import pytest

from convoy.data.samplers import GlobalBatchSampler, ShardedEvalSampler


def global_batches(
    n: int, global_batch: int, world: int, seed: int = 0, epoch: int = 0
) -> list[list[int]]:
    """Step k's samples over all ranks, rank order kept: ``[step][sample]``."""
    shares = []
    for rank in range(world):
        sampler = GlobalBatchSampler(range(n), global_batch, world, rank, seed=seed)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        share = global_batch // world
        shares.append([indices[i : i + share] for i in range(0, len(indices), share)])
    return [list(itertools.chain(*step)) for step in zip(*shares, strict=True)]


def flat(batches: list[list[int]]) -> list[int]:
    return list(itertools.chain(*batches))


@pytest.mark.parametrize("n", [96, 100, 37])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("epoch", [0, 3])
def test_ranks_split_the_single_process_batches(n: int, world: int, epoch: int) -> None:
    single = global_batches(n, 8, 1, seed=5, epoch=epoch)
    sharded = global_batches(n, 8, world, seed=5, epoch=epoch)
    assert len(sharded) == len(single) == n // 8
    assert [set(b) for b in sharded] == [set(b) for b in single]
    assert all(len(b) == 8 for b in sharded)


@pytest.mark.parametrize(("n", "global_batch"), [(100, 8), (64, 16), (7, 8), (12, 4)])
def test_epoch_is_drop_last_without_repeats(n: int, global_batch: int) -> None:
    for world in (1, 2, 4):
        for epoch in range(3):
            seen = flat(global_batches(n, global_batch, world, epoch=epoch))
            assert len(seen) == n // global_batch * global_batch
            assert len(set(seen)) == len(seen)
            assert set(seen) <= set(range(n))


def test_set_epoch_reshuffles_deterministically() -> None:
    epoch0, epoch1 = global_batches(100, 10, 2, epoch=0), global_batches(100, 10, 2, epoch=1)
    assert epoch0 != epoch1
    assert epoch0 == global_batches(100, 10, 2, epoch=0)
    assert global_batches(100, 10, 2, seed=1) != epoch0
    # 103 samples, batches of 10: a different 3 are dropped each epoch
    dropped = [set(range(103)) - set(flat(global_batches(103, 10, 2, epoch=e))) for e in (0, 1)]
    assert len(dropped[0]) == len(dropped[1]) == 3
    assert dropped[0] != dropped[1]


def test_no_shuffle_keeps_dataset_order() -> None:
    sampler = GlobalBatchSampler(range(10), 4, 2, rank=1, shuffle=False)
    assert list(sampler) == [2, 3, 6, 7]


def test_global_batch_must_divide_over_ranks() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        GlobalBatchSampler(range(10), 6, 4, rank=0)


@pytest.mark.parametrize("size", [359, 7, 1, 4, 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_shards_count_each_sample_once(size: int, world: int) -> None:
    samplers = [ShardedEvalSampler(range(size), world, rank) for rank in range(world)]
    real = [i for s in samplers for i in list(s)[: s.num_real]]
    assert sorted(real) == list(range(size))
    assert {len(s) for s in samplers} == {math.ceil(size / world)}
    assert sum(s.num_real for s in samplers) == size
    for rank, s in enumerate(samplers):
        assert s.num_real == len(range(rank, size, world))
        assert all(0 <= i < size for i in s)
