"""Whether a job fits a rank's memory: its own layout planned beside the other layouts of its
world size, and the one line that refuses it (``convoy.preflight.check_memory`` raises it
before any worker starts).
"""

from __future__ import annotations

from typing import Any

from convoy.config import Job, tp_size_of
from convoy.plan.model import ModelSource
from convoy.plan.parse import format_bytes
from convoy.plan.planner import SETUP, Layout, Plan, Planner, plan_job, quiet_warnings


def plan_world_size(job: Job, shape: dict[str, int], sample: tuple[Any, Any], memory: int) -> Plan:
    """Every layout of ``job``'s world size, planned against ``memory`` bytes a rank, from
    the data's ``shape`` and a ``sample`` batch (the data is not read again)."""
    source = ModelSource(dict(shape), sample)
    with quiet_warnings():
        planner = Planner(job, source)
        return plan_job(
            job, world_sizes=[job.scaling.max_workers], gpu_memory=memory, planner=planner
        )


def own_layout(plan: Plan) -> Layout | None:
    """The layout the plan's job runs (its strategy and tensor-parallel size), if planned."""
    strategy = plan.job.strategy
    return next(
        (
            layout
            for layout in plan.layouts
            if layout.strategy == strategy.name and layout.tp_size == tp_size_of(strategy)
        ),
        None,
    )


def memory_refusal(plan: Plan, where: str) -> str | None:
    """Why the plan's job cannot start, in one line: its layout's planned peak, the memory a
    rank has (``plan.gpu_memory``; ``where``: what that figure is), and the layouts of the
    same world size that fit. None where its layout fits or was not planned."""
    own = own_layout(plan)
    if own is None or plan.fits(own) is not False:
        return None
    size = own.world_size
    fitting = [f"{lay.name} ({format_bytes(lay.peak)})" for lay in plan.layouts if plan.fits(lay)]
    whole = ""
    if own.peak_moment == SETUP and own.whole_build:
        whole = f": every rank builds the whole model ({format_bytes(own.whole_build)}) first"
    return (
        f"{own.name} x {size} needs {format_bytes(own.peak)} a rank (convoy plan's peak, at "
        f"{own.peak_moment}{whole}), and a rank has {format_bytes(plan.gpu_memory or 0)} here "
        f"({where}); at {size} workers, these fit: {', '.join(fitting) or 'none'}; set "
        "run.skip_memory_check=true to start it anyway"
    )
