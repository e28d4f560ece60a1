"""Sharded checkpoints with an atomic commit, and exact resume.

Layout under ``<run_dir>/checkpoints/``::

    step_00000120/            committed: visible only once every shard and meta.json exist
        __0_0.distcp ...      model + optimizer via torch.distributed.checkpoint (DCP)
        .metadata
        meta.json             step, epoch, position in the epoch, LR schedule, grad scaler
        rng_rank0.json ...    every rank's RNG states
    .partial-step_00000150/   being written (or left by a crash): never loaded

A checkpoint is written under a ``.partial-`` name and renamed into place by rank 0 after a
barrier, so a crash mid-save leaves the previous committed checkpoint as the latest. Model and
optimizer go through ``get_state_dict`` / ``set_state_dict``, which give the same keys for
every strategy, so DCP can reshard (2-rank fsdp2 -> 1-rank single, ddp -> fsdp2). Nothing in a
checkpoint is unpickled: DCP tensors load as tensors, the rest is JSON.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from convoy.distributed import WorkerContext, barrier, is_distributed
from convoy.errors import ConvoyError

CHECKPOINT_DIR = "checkpoints"
PARTIAL_PREFIX = ".partial-"
META_FILE = "meta.json"
_COMMITTED = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class Position:
    """Where training stands: optimizer steps done, and the place in the current epoch."""

    step: int
    epoch: int
    steps_into_epoch: int


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _COMMITTED.match(p.name)]
    return sorted(found, key=lambda p: p.name)


def partial_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PARTIAL_PREFIX))


def _rng_state() -> dict[str, Any]:
    numpy_state: tuple[Any, ...] = np.random.get_state()  # type: ignore[assignment]
    return {
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


@dataclass(frozen=True)
class BestPolicy:
    """Keep the ``count`` checkpoints with the best ``metric`` recorded in their meta."""

    count: int
    metric: str
    mode: str

    def select(self, checkpoints: list[Path]) -> list[Path]:
        scored = []
        for path in checkpoints:
            value = json.loads((path / META_FILE).read_text()).get("metrics", {}).get(self.metric)
            if value is not None:
                scored.append((value, path))
        scored.sort(key=lambda item: item[0], reverse=self.mode == "max")
        return [path for _, path in scored[: self.count]]


class CheckpointStorageError(ConvoyError):
    """Writing a checkpoint failed (no space, permissions, unreachable storage)."""


class CheckpointManager:
    """Saves and restores one run's checkpoints; every rank calls every method."""

    def __init__(
        self, run_dir: Path, ctx: WorkerContext, keep_latest: int, best: BestPolicy | None = None
    ) -> None:
        self.run_dir = run_dir
        self.ctx = ctx
        self.keep_latest = keep_latest
        self.best = best
        self._pending: tuple[Any, dict[str, Any], Path, Path] | None = None
        self._group: Any = None

    def save(
        self,
        position: Position,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        asynchronous: bool = False,
    ) -> Path:
        """Write every rank's shards, then commit atomically; returns the checkpoint's path.

        With ``asynchronous`` the state is staged to CPU memory now and written by a
        background thread while training goes on; the commit happens in ``wait()``, which the
        next save (and the end of training) calls first.
        """
        self.wait()
        name = f"step_{position.step:08d}"
        root = checkpoint_root(self.run_dir)
        partial, final = root / f"{PARTIAL_PREFIX}{name}", root / name
        if self.ctx.is_main:
            with self._storage_errors(partial):
                shutil.rmtree(partial, ignore_errors=True)  # a leftover from a crashed attempt
                partial.mkdir(parents=True)
        barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        _write_json(partial / f"rng_rank{self.ctx.rank}.json", _rng_state())
        meta = {
            "step": position.step,
            "epoch": position.epoch,
            "steps_into_epoch": position.steps_into_epoch,
            "world_size": self.ctx.world_size,
            **extra,
        }
        if asynchronous:
            future = dcp.async_save(
                state,
                checkpoint_id=partial,
                process_group=self._background_group(),
                no_dist=not is_distributed(),
            )
            self._pending = (future, meta, partial, final)
            return final
        with self._storage_errors(partial):
            dcp.save(state, checkpoint_id=partial, no_dist=not is_distributed())
        self._commit(meta, partial, final)
        return final

    @contextlib.contextmanager
    def _storage_errors(self, partial: Path) -> Iterator[None]:
        """Turn a storage failure into one clear error; committed checkpoints are untouched."""
        try:
            yield
        except (OSError, CheckpointException) as exc:
            latest = committed_checkpoints(self.run_dir)
            kept = latest[-1].name if latest else "none yet"
            raise CheckpointStorageError(
                f"checkpoint: cannot write {partial} ({type(exc).__name__}: {exc}); "
                f"committed checkpoints are intact (latest: {kept}); "
                "check free space and permissions of run.storage_dir"
            ) from None

    def wait(self) -> None:
        """Finish and commit a pending asynchronous save (every rank calls this)."""
        if self._pending is None:
            return
        future, meta, partial, final = self._pending
        self._pending = None
        future.result()
        self._commit(meta, partial, final)

    def _background_group(self) -> Any:
        # Background writes run collectives of their own; on the training group they could
        # interleave with the training's collectives, so they get a group of their own.
        if self._group is None and is_distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _commit(self, meta: dict[str, Any], partial: Path, final: Path) -> None:
        barrier()  # every rank's shards and RNG file are on disk
        if self.ctx.is_main:
            _write_json(partial / META_FILE, meta)
            if final.exists():  # same step saved twice (e.g. end of epoch == every_steps)
                shutil.rmtree(final)
            partial.rename(final)  # the commit
            self._prune()
        barrier()

    def _prune(self) -> None:
        """Delete what neither the latest-K nor the best-K rule keeps (after a commit only)."""
        found = committed_checkpoints(self.run_dir)
        keep = set(found[-self.keep_latest :])
        if self.best is not None:
            keep |= set(self.best.select(found))
        for old in found:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    def load_latest(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[Path, dict[str, Any]] | None:
        """Restore model, optimizer and (same world size) RNG from the latest committed checkpoint.

        Returns its path and meta, or None when there is none. The caller restores the LR
        schedule, grad scaler and data position from the meta.
        """
        checkpoints = committed_checkpoints(self.run_dir)
        if not checkpoints:
            return None
        path = checkpoints[-1]
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=path,
            no_dist=not is_distributed(),
        )
        # dcp.load fills the given state dicts in place.
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        meta = json.loads((path / META_FILE).read_text())
        rng_file = path / f"rng_rank{self.ctx.rank}.json"
        if meta["world_size"] == self.ctx.world_size and rng_file.exists():
            _set_rng_state(json.loads(rng_file.read_text()))
        return path, meta


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))
