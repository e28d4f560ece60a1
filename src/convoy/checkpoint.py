"""Sharded checkpoints with an atomic commit, and exact resume, on local disk or S3.

Layout under ``<run>/checkpoints/`` (``<run>`` is a local directory or an ``s3://`` prefix)::

    step_00000120/            one checkpoint per saved step
        __0_0.distcp ...      model + optimizer via torch.distributed.checkpoint (DCP)
        .metadata
        rng_rank0.json ...    every rank's RNG states
        meta.json             written last, by rank 0, after every rank's files are in place:
                              the commit. step, epoch, position in the epoch, LR schedule...

A directory without ``meta.json`` is a save that never finished (a crash, a kill, a full disk):
it is never loaded, and the run says it skipped it. On local disk DCP writes in place; on S3
each rank writes to a local staging directory and uploads its own files before the commit.
Model and optimizer go through ``get_state_dict`` / ``set_state_dict``, which give the same
keys for every strategy, so DCP can reshard (2-rank fsdp2 -> 1-rank single, ddp -> fsdp2).
Nothing in a checkpoint is unpickled: DCP tensors load as tensors, the rest is JSON.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

# The listing is torch-free (convoy.checkpoint_listing); its names are re-exported here,
# beside saving and loading, where users and the tests look for them.
from convoy.checkpoint_listing import CHECKPOINT_DIR as CHECKPOINT_DIR
from convoy.checkpoint_listing import META_FILE as META_FILE
from convoy.checkpoint_listing import RunLocation as RunLocation
from convoy.checkpoint_listing import checkpoint_name as checkpoint_name
from convoy.checkpoint_listing import checkpoint_path as checkpoint_path
from convoy.checkpoint_listing import checkpoint_root as checkpoint_root
from convoy.checkpoint_listing import committed_checkpoints as committed_checkpoints
from convoy.checkpoint_listing import local_copy as local_copy
from convoy.checkpoint_listing import partial_checkpoints as partial_checkpoints
from convoy.checkpoint_listing import read_meta as read_meta
from convoy.distributed import WorkerContext, barrier, is_distributed
from convoy.dynamo_guard import dynamo_stand_in
from convoy.errors import ConvoyError
from convoy.storage import RunStorage, StorageError

DCP_GROUP_WARNING = "torch.distributed is (disabled|unavailable)"
DCP_MODULES = r"torch\.distributed\.checkpoint"


def ignore_dcp_group_warning() -> None:
    """From now on in this process, DCP's warning on a save or load without a process group
    ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to
    save in a single process") is not shown: torch 2.13 gives it on every such call, even when
    ``no_dist`` asks for one, and here that is the intent (a ``local`` run of one worker, an
    export, rank 0 saving alone). Process-wide rather than around each call: an asynchronous
    save warns later, from torch's writer thread."""
    warnings.filterwarnings("ignore", DCP_GROUP_WARNING, UserWarning, DCP_MODULES)


@dataclass(frozen=True)
class Position:
    """Where training stands: optimizer steps done, and the place in the current epoch."""

    step: int
    epoch: int
    steps_into_epoch: int


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

    def select(self, metas: dict[str, dict[str, Any]]) -> list[str]:
        scored = []
        for name, meta in metas.items():
            value = meta.get("metrics", {}).get(self.metric)
            if value is not None:
                scored.append((value, name))
        scored.sort(key=lambda item: item[0], reverse=self.mode == "max")
        return [name for _, name in scored[: self.count]]


class CheckpointStorageError(ConvoyError):
    """Writing a checkpoint failed (no space, permissions, unreachable storage)."""


CheckpointReporter = Callable[[str, dict[str, Any]], None]
"""Called on every rank after a commit with the checkpoint's path relative to the run
directory and its metrics (the Ray launcher hands it to ``ray.train.report``)."""


@dataclass
class _PendingSave:
    future: Any
    meta: dict[str, Any]
    name: str
    written_to: Path
    started: float
    written: list[float] = field(default_factory=list)
    """When the background write finished (``time.perf_counter()``), once it has."""


class CheckpointManager:
    """Saves and restores one run's checkpoints; every rank calls every method.

    ``reporter`` hands each committed checkpoint to the launcher. A launcher that reports
    checkpoints (Ray Train) also owns their retention, so then this manager deletes nothing.
    """

    def __init__(
        self,
        storage: RunStorage,
        ctx: WorkerContext,
        keep_latest: int,
        best: BestPolicy | None = None,
        reporter: CheckpointReporter | None = None,
        on_commit: Callable[[str, dict[str, Any]], None] | None = None,
        trainable_only: bool = False,
    ) -> None:
        self.storage = storage
        self.options = StateDictOptions(ignore_frozen_params=trainable_only)
        # Loading them back leaves the frozen keys out on purpose (the keys that train are
        # checked against the checkpoint's first, by check_model_keys).
        self.load_options = StateDictOptions(
            ignore_frozen_params=trainable_only, strict=not trainable_only
        )
        """``trainable_only`` (LoRA): the frozen base is not saved (it is rebuilt from the
        model's folder or seed at every start), only what trains and its optimizer state."""
        self.ctx = ctx
        self.keep_latest = keep_latest
        self.best = best
        self.reporter = reporter
        self.on_commit = on_commit
        """Told of every commit (path relative to the run, the checkpoint's meta), every rank."""
        self._pending: _PendingSave | None = None
        self._group: Any = None
        self._alone = False
        self.save_seconds: float | None = None
        """How long the last committed save took on this rank, from its start to its commit
        (an asynchronous one: to the end of its background write, plus the commit); read
        back from the checkpoint's meta after a resume. What a stop with a deadline weighs
        against the time it has left."""

    def save(
        self,
        position: Position,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        asynchronous: bool = False,
        alone: bool = False,
    ) -> str:
        """Write every rank's shards, then commit; returns the checkpoint's name.

        With ``asynchronous`` the state is staged to CPU memory now and written by a
        background thread while training goes on; the commit happens in ``wait()``, which the
        next save (and the end of training) calls first.

        With ``alone`` this rank (rank 0, where every rank holds the whole state) writes all
        of it and commits without a collective, so ranks that may be gone are not waited for.
        """
        if alone:
            self._pending = None  # its commit would be a collective; a later save stands in
        self.wait()
        self._alone = alone
        try:
            return self._save(position, model, optimizer, extra, asynchronous and not alone)
        finally:
            self._alone = False

    def _save(
        self,
        position: Position,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        asynchronous: bool,
    ) -> str:
        started = time.perf_counter()
        name = checkpoint_name(position.step)
        if self.ctx.is_main:
            with self._storage_errors(name):
                # A leftover of a crashed attempt, or the same step saved again.
                self._delete(name)
        self._barrier()
        written_to = self.storage.local_path(checkpoint_path(name)) or self._staging_dir(name)
        with self._storage_errors(name):
            written_to.mkdir(parents=True, exist_ok=True)
            _write_json(written_to / f"rng_rank{self.ctx.rank}.json", _rng_state())
        with dynamo_stand_in():  # it asks whether a module is compiled: none is without Dynamo
            model_state, optim_state = get_state_dict(model, optimizer, options=self.options)
        state = {"model": model_state, "optim": optim_state}
        meta = {
            "step": position.step,
            "epoch": position.epoch,
            "steps_into_epoch": position.steps_into_epoch,
            "world_size": self.ctx.world_size,
            **extra,
        }
        if asynchronous:
            ignore_dcp_group_warning()
            future = dcp.async_save(
                state,
                checkpoint_id=written_to,
                process_group=self._background_group(),
                no_dist=not is_distributed(),
            )
            pending = _PendingSave(future, meta, name, written_to, started)
            # A plain Future here (no staging future was asked for).
            future.add_done_callback(  # type: ignore[union-attr]
                lambda _: pending.written.append(time.perf_counter())
            )
            self._pending = pending
            return name
        ignore_dcp_group_warning()
        with self._storage_errors(name):
            dcp.save(state, checkpoint_id=written_to, no_dist=self._alone or not is_distributed())
        meta["save_seconds"] = time.perf_counter() - started
        self._publish(meta, name, written_to)
        self.save_seconds = time.perf_counter() - started
        return name

    def wait(self) -> None:
        """Finish and commit a pending asynchronous save (every rank calls this)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with self._storage_errors(pending.name):
            pending.future.result()
        writing = (pending.written or [time.perf_counter()])[0] - pending.started
        pending.meta["save_seconds"] = writing
        committing = time.perf_counter()
        self._publish(pending.meta, pending.name, pending.written_to)
        self.save_seconds = writing + time.perf_counter() - committing

    def _staging_dir(self, name: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"convoy-{name}-rank{self.ctx.rank}-"))

    def _publish(self, meta: dict[str, Any], name: str, written_to: Path) -> None:
        """Upload this rank's files if they were staged, commit, and report the commit."""
        if self.storage.local_path(checkpoint_path(name)) is None:
            with self._storage_errors(name):
                self.storage.upload(written_to, checkpoint_path(name))
            shutil.rmtree(written_to, ignore_errors=True)
        self._commit(meta, name)
        if self.reporter is not None:
            self.reporter(checkpoint_path(name), meta.get("metrics", {}))
        if self.on_commit is not None:
            self.on_commit(checkpoint_path(name), meta)

    @contextlib.contextmanager
    def _storage_errors(self, name: str) -> Iterator[None]:
        """Turn a storage failure into one clear error; committed checkpoints are untouched."""
        try:
            yield
        except (OSError, CheckpointException) as exc:
            try:
                found = committed_checkpoints(self.storage)
                kept = found[-1] if found else "none yet"
            except OSError:
                kept = "unknown: the storage cannot be listed either"
            if isinstance(exc, StorageError):
                detail, hint = f"{exc.what}: {exc.detail}", exc.hint
            else:
                detail = f"{type(exc).__name__}: {_first_line(exc)}"
                hint = "check free space and permissions of run.storage_dir"
            raise CheckpointStorageError(
                f"checkpoint: cannot write {self.storage.uri}/{checkpoint_path(name)} "
                f"({detail}); committed checkpoints are intact (latest: {kept}); {hint}"
            ) from None

    def _background_group(self) -> Any:
        # Background writes run collectives of their own; on the training group they could
        # interleave with the training's collectives, so they get a group of their own.
        if self._group is None and is_distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _commit(self, meta: dict[str, Any], name: str) -> None:
        self._barrier()  # every rank's shards and RNG file are in place
        if self.ctx.is_main:
            with self._storage_errors(name):
                self.storage.write_text(f"{checkpoint_path(name)}/{META_FILE}", json.dumps(meta))
            if self.reporter is None:
                self._prune()
        self._barrier()

    def _barrier(self) -> None:
        if not self._alone:
            barrier()

    def report_once_committed(self, name: str, deadline: float | None) -> None:
        """On a rank that did not take part in a save made ``alone``: wait until it is
        committed (or the deadline passes), then report it as every rank reports a commit."""
        marker = f"{checkpoint_path(name)}/{META_FILE}"
        give_up = deadline if deadline is not None else time.time() + 120.0
        while not self.storage.exists(marker):
            if time.time() > give_up:
                return
            time.sleep(0.1)
        meta = json.loads(self.storage.read_text(marker))
        if self.reporter is not None:
            self.reporter(checkpoint_path(name), meta.get("metrics", {}))

    def _delete(self, name: str) -> None:
        # The commit marker goes first: a deletion cut short leaves a partial, never a
        # committed checkpoint with missing shards.
        self.storage.delete(f"{checkpoint_path(name)}/{META_FILE}")
        self.storage.delete(checkpoint_path(name))

    def _prune(self) -> None:
        """Delete what neither the latest-K nor the best-K rule keeps (after a commit only)."""
        found = committed_checkpoints(self.storage)
        keep = set(found[-self.keep_latest :])
        if self.best is not None:
            keep |= set(self.best.select({n: read_meta(self.storage, n) for n in found}))
        for old in found:
            if old not in keep:
                self._delete(old)

    def load_latest(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, preferred: str | None = None
    ) -> tuple[str, dict[str, Any]] | None:
        """Restore model, optimizer and (same world size) RNG from a committed checkpoint.

        That is ``preferred`` (a name) if it is committed, else the latest. Returns its name
        and meta, or None when there is none. The caller restores the LR schedule, grad scaler
        and data position from the meta.
        """
        found = committed_checkpoints(self.storage)
        if not found:
            return None
        name = preferred if preferred in found else found[-1]
        meta = read_meta(self.storage, name)
        with dynamo_stand_in():
            model_state, optim_state = get_state_dict(model, optimizer, options=self.options)
        ignore_dcp_group_warning()
        with local_copy(self.storage, name) as path:
            check_model_keys(path, name, set(model_state))
            dcp.load(
                {"model": model_state, "optim": optim_state},
                checkpoint_id=path,
                # FSDP1's ShardedTensors: torch's default "flattening" of them (meant for
                # FSDP1 nested in tensor parallelism, which Convoy does not build) drops those
                # with no shard on this rank (a small parameter whole on another rank, e.g. a
                # ViT's cls_token), and DCP then takes the missing keys for a pre-2.4
                # checkpoint and fails ("Missing key in checkpoint state_dict:
                # optim.param_groups"). Kept as they are, every rank plans its own shards.
                planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
                no_dist=not is_distributed(),
            )
            rng_file = path / f"rng_rank{self.ctx.rank}.json"
            rng = json.loads(rng_file.read_text()) if rng_file.exists() else None
        # dcp.load fills the given state dicts in place.
        with dynamo_stand_in():
            set_state_dict(
                model,
                optimizer,
                model_state_dict=model_state,
                optim_state_dict=optim_state,
                options=self.load_options,
            )
        if meta["world_size"] == self.ctx.world_size and rng is not None:
            _set_rng_state(rng)
        self.save_seconds = meta.get("save_seconds")
        return name, meta


class CheckpointMismatchError(ConvoyError):
    """A checkpoint holds another model's parameters than the one resuming from it."""


def check_model_keys(path: Path, name: str, wanted: set[str]) -> None:
    """Refuse, in one line, to resume a model from checkpoint ``name`` (at ``path``) that
    lacks some of its parameters (``wanted``: their names), before DCP's own error."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    held = {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    missing, extra = sorted(wanted - held), sorted(held - wanted)
    if not missing:
        return

    def some(keys: list[str]) -> str:
        return keys[0] + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")

    holds = f" and holds {some(extra)}" if extra else ""
    raise CheckpointMismatchError(
        f"checkpoint {name} does not fit this model: it lacks {some(missing)}{holds}. It was "
        "written by another model (model.name / model.kwargs), or by a Convoy from before "
        "the gpt and vit_* attention's qkv became q, k and v; resume it with what wrote it, "
        "or train under a new run.name (this run's checkpoints are kept)"
    )


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))
