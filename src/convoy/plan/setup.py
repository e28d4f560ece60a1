"""The set-up phase of a layout: what a rank holds while its model is built, laid out by the
strategy and filled, before the first step (whose own peaks are the planner's other moments).

A model that says how each module is initialized (``init_module``, ``convoy.models.init``)
is built on the meta device; the strategy lays it out, materializes only the rank's part, and
each module's full values are then made alone (fp32) for the rank to copy its slice from:

- ``fsdp2`` and ``hsdp`` (with tensor parallelism or without), ``single``, ``ddp``: the
  rank's parameters, plus the largest module's full values;
- ``fsdp`` (FSDP1, ``param_init_fn``): unit by unit, its modules materialized whole, then
  flattened into one more copy and sharded: the shards made so far, twice the unit, its shard.

An ``hf`` model read from a folder is built on meta too, each rank reading only its part
of each tensor (within the same bound). A model without ``init_module`` (a user's factory
that initializes in ``__init__``) is built whole on every rank first. Unsharded strategies
keep it as their parameters; a sharded one splits it unit by unit (blocks, then the root),
each unit's shards made before its whole parameters are freed (FSDP1 flattens the unit into
one more copy first); tensor parallelism first replaces each module by the rank's share.

Bytes are fp32 (the master weights) and rank 0's (the rounded-up chunks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from convoy.plan.model import shard_numel
from convoy.strategies import Strategy

Units = Sequence[Sequence[nn.Parameter]]


@dataclass(frozen=True)
class SetUp:
    """A layout's set-up phase on one rank."""

    peak: int
    """Bytes at its peak, the rank's own parameters included."""
    whole: int = 0
    """Bytes of the whole model the rank builds before its strategy shards it (0: none)."""


@dataclass(frozen=True)
class ModelSizes:
    """What the set-up depends on, in parameters: the model whole, the rank's
    tensor-parallel share of it in wrap units (blocks, then the root), and the largest
    module."""

    whole: int
    units: Units
    largest_module: int
    on_meta: bool
    """Built on the meta device and filled module by module (see the module docstring)."""


def set_up(cls: type[Strategy], shards: int, params: int, model: ModelSizes) -> SetUp:
    """The set-up of ``cls`` whose model state is split over ``shards`` ranks, where the
    rank holds ``params`` bytes of parameters once it is done."""
    sharded = cls.sharding.parameters
    flat = cls.sharding.layout == "flat_per_unit"
    if model.on_meta:
        if sharded and flat:
            return SetUp(_fill_flat_units(model.units, shards))
        return SetUp(params + 4 * model.largest_module)
    if not sharded:
        return SetUp(params)  # built as it is held
    share = 4 * sum(p.numel() for unit in model.units for p in unit)
    peak = _split_whole(model.units, shards, share, flat)
    whole = 4 * model.whole
    if share < whole:  # tensor parallelism: each module replaced by the rank's share
        peak = max(peak, whole + 4 * model.largest_module)
    return SetUp(peak, whole=whole)


def _split_whole(units: Units, shards: int, held: int, flat: bool) -> int:
    """The most bytes while a whole model (``held`` bytes) is sharded unit by unit: each
    unit's shard is made before the unit is freed, FSDP1's after one more (flat) copy."""
    peak = held
    for unit in units:
        whole, shard = _unit_bytes(unit, shards, flat)
        peak = max(peak, held + shard + (whole if flat else 0))
        held += shard - whole
    return peak


def _fill_flat_units(units: Units, shards: int) -> int:
    """The most bytes while FSDP1 fills a meta-built model unit by unit: the shards made so
    far, the unit materialized and its flat copy, then its shard."""
    peak = held = 0
    for unit in units:
        whole, shard = _unit_bytes(unit, shards, flat=True)
        peak = max(peak, held + 2 * whole + shard)
        held += shard
    return peak


def _unit_bytes(unit: Sequence[nn.Parameter], shards: int, flat: bool) -> tuple[int, int]:
    """A unit's fp32 bytes, whole and rank 0's shard (FSDP1: an even split of its flat
    parameter; FSDP2: each parameter's dim 0)."""
    numel = sum(p.numel() for p in unit)
    if flat:
        return 4 * numel, 4 * math.ceil(numel / shards)
    return 4 * numel, 4 * sum(shard_numel(p, shards) for p in unit)
