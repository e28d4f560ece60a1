"""Run a function on a real gloo process group of N CPU processes (for tests and debugging).

In the style of Accelerate's ``debug_launcher``: ``run_on_gloo(fn, 2, *args)`` spawns two
processes, gives each a ``WorkerContext`` that joins a loopback TCP rendezvous, calls
``fn(ctx, *args)`` and returns every rank's return value in rank order. ``fn`` must be
importable (defined at module level). A rank that raises prints its traceback and exits with
code 1, which ``torch.multiprocessing`` reports as a ``ProcessExitedException``.

The ranks are forked from a fork server that has imported torch and the engine once per
calling process: a spawned rank spends seconds of CPU importing them, and a test suite starts
hundreds of ranks. Each rank gets the caller's environment as it is at the call, as a spawned
one would.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from convoy.config import Job
from convoy.distributed import (
    WorkerContext,
    all_gather_objects,
    default_threads,
    exit_without_teardown,
    free_port,
    process_group,
)
from convoy.engine.loop import train
from convoy.fork_server import also_preload, fork_server_start_method
from convoy.outputs import RunOutputs
from convoy.storage import RunStorage

# A ViT small enough for CPU tests that still has transformer blocks to shard.
TINY_VIT_OVERRIDES = (
    "model.name=vit_tiny",
    "model.kwargs.depth=2",
    "model.kwargs.hidden=32",
    "model.kwargs.mlp=64",
)


def parity_overrides(
    storage: Any, strategy: str, workers: int, steps: int, seed: int, name: str
) -> list[str]:
    """The overrides a strategy-parity run shares: ``strategy`` on ``workers`` ranks (one:
    the local launcher, more: torchrun), ``steps`` steps with every step's loss logged."""
    return [
        f"strategy.name={strategy}",
        f"scaling.num_workers={workers}",
        "scaling.launcher=local" if workers == 1 else "scaling.launcher=torchrun",
        f"run.max_steps={steps}",
        "run.log_every_steps=1",
        "run.progress=off",
        f"run.seed={seed}",
        f"run.storage_dir={storage}",
        f"run.name={name}",
    ]


def train_on_rank(ctx: WorkerContext, job: Job) -> dict[str, Any]:
    """``run_on_gloo(train_on_rank, 2, job)`` trains ``job`` on two spawned ranks."""
    return train(job, ctx)


def initial_full_states(
    ctx: WorkerContext, jobs: list[Job], data_shape: dict[str, int]
) -> list[dict[str, Any]]:
    """Each job's model as the engine builds it (on meta where it can), laid out by the job's
    strategy and filled, then gathered whole: for each job, ``state`` (the full state dict on
    rank 0, empty on the others) and ``bytes_read_per_rank`` (what each rank read from an
    ``hf`` folder's files). For tests that the initial weights do not depend on the layout."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from convoy.models.registry import build_skeleton
    from convoy.strategies import build_strategy
    from convoy.strategies.base import dtype_from_name
    from convoy.strategies.blocks import prepare_blocks

    states: list[dict[str, Any]] = []
    with process_group(ctx, 120.0, needed=ctx.world_size > 1):
        for job in jobs:
            strategy = build_strategy(
                job.strategy, ctx.device, dtype_from_name(job.precision), ctx.local_world_size
            )
            model, weights = build_skeleton(
                job.model.name, job.model.kwargs, data_shape, job.run.seed, job.model.lora
            )
            model = strategy.wrap(prepare_blocks(model, job.strategy, job.run.compile), weights)
            if isinstance(model, FSDP):
                state = _fsdp1_full_state(model)
            else:
                options = StateDictOptions(full_state_dict=True, cpu_offload=True)
                state = get_model_state_dict(model, options=options)
            folder = getattr(weights, "folder", None)
            read = all_gather_objects(folder.bytes_read if folder is not None else 0)
            states.append({"state": state if ctx.is_main else {}, "bytes_read_per_rank": read})
    return states


def _fsdp1_full_state(model: torch.nn.Module) -> dict[str, Any]:
    """FSDP1's parameters gathered whole. Not its full state dict: that crashes (SIGSEGV in
    its clone hook) on 2 gloo ranks with a tied head, in torch 2.13."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return {
            name.replace("_fsdp_wrapped_module.", ""): param.detach().clone()
            for name, param in model.named_parameters(remove_duplicate=False)
        }


CENSUS_VARIABLE = "CONVOY_CENSUS_VALUE"
"""The environment variable each rank of ``rank_census`` reports, as the launch gave it."""


def rank_census(job: Job, ctx: WorkerContext, tag: str) -> dict[str, Any]:
    """A worker entry (``WorkerEntry("convoy.testing:rank_census", {"tag": ...})``) for
    launcher tests: every rank's identity and its ``CENSUS_VARIABLE``, gathered over the real
    process group; rank 0 writes it as the run's summary. Each rank also prints a line
    ``census <tag> rank <rank>`` on its standard output."""
    print(f"census {tag} rank {ctx.rank}", flush=True)
    with process_group(ctx, job.run.collective_timeout_s):
        me = {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "tag": tag,
            "pid": os.getpid(),
            "environment": os.environ.get(CENSUS_VARIABLE),
            # The module a started worker runs; a forked one's is its parent's.
            "argv0": sys.argv[0],
        }
        summary = {"ranks": all_gather_objects(me)}
    RunOutputs(RunStorage.at(job.run_uri), ctx.is_main).write_summary(summary)
    return summary


# The models the parity tests' ranks build, imported once in this process's fork server
# besides the engine (1.3 s of CPU a rank for Llama's); skipped there where the hf extra is
# not installed. Set on import, so that it holds whichever starts the server first: a rank
# here or a torchrun launch (whose workers come from the same server).
also_preload(["transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"])


def run_on_gloo(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(ctx, *args)`` on ``world_size`` new CPU ranks; results in rank order."""
    with tempfile.TemporaryDirectory(prefix="convoy-gloo-") as tmp:
        # A TCP store hosted by rank 0; file stores were seen to abort at exit under load.
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(
            _entry,
            args=(fn, world_size, init_method, tmp, args, dict(os.environ)),
            nprocs=world_size,
            start_method=fork_server_start_method(),
            join=True,
        )
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    init_method: str,
    tmp: str,
    args: tuple[Any, ...],
    environ: dict[str, str],
) -> None:
    # The fork server kept the environment of its own start; a rank sees the caller's.
    os.environ.clear()
    os.environ.update(environ)
    ctx = WorkerContext(
        rank=rank,
        local_rank=rank,
        world_size=world_size,
        local_world_size=world_size,
        init_method=init_method,
    )
    # Split the cores between the ranks, as the launchers do (the engine sets it again).
    torch.set_num_threads(default_threads(world_size))
    try:
        result = fn(ctx, *args)
    except BaseException:
        # Exit at once so peers blocked in a collective see the connection drop, instead of
        # waiting for a teardown that can hang with the process group still alive.
        traceback.print_exc()
        exit_without_teardown(1)
    (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    exit_without_teardown()
