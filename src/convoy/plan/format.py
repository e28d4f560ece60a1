"""A plan printed: a plain table (``format_plan``, ``format_table``) or JSON-ready data
(``plan_to_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from convoy.plan.parse import format_bytes
from convoy.plan.planner import CATEGORIES, Plan


def format_plan(plan: Plan) -> str:
    """The plan as a plain table: one row per layout, bytes per rank at its peak, and its
    set-up's peak (the model built, laid out and filled) apart."""
    header = ["layout", "batch/rank", *CATEGORIES, "peak", "peak at", "set-up"]
    if plan.gpu_memory is not None:
        header.append(f"fits {format_bytes(plan.gpu_memory)}")
    rows = []
    for layout in plan.layouts:
        parts = layout.at_peak()
        row = [
            f"{layout.name} x {layout.world_size}",
            str(layout.micro_batch),
            *(format_bytes(parts[c]) for c in CATEGORIES),
            format_bytes(layout.peak),
            layout.peak_moment,
            format_bytes(layout.setup),
        ]
        if plan.gpu_memory is not None:
            row.append("yes" if plan.fits(layout) else "no")
        rows.append(row)
    lines = [
        f"plan: {plan.job.model.name} ({parameters_line(plan)}), {plan.job.precision}, "
        f"{plan.job.optim.name}, global batch {plan.job.data.batch_size}, "
        f"grad_accum_steps {plan.job.optim.grad_accum_steps}; bytes per rank at its peak",
        format_table(header, rows),
        *lora_lines(plan),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    if plan.gpu_memory is not None:
        best = plan.smallest_fit()
        lines.append(
            f"smallest layout that fits {format_bytes(plan.gpu_memory)}: "
            + (f"{best.name} x {best.world_size} ({format_bytes(best.peak)})" if best else "none")
        )
    return "\n".join(lines)


def parameters_line(plan: Plan) -> str:
    """The model's parameters; under LoRA, how many of them train."""
    lora = plan.job.model.lora
    if lora is None:
        return f"{plan.param_count:,} parameters"
    share = 100 * plan.trainable / max(plan.param_count, 1)
    return (
        f"{plan.param_count:,} parameters, {plan.trainable:,} trainable ({share:.2f}%: LoRA "
        f"r={lora.r} on {', '.join(lora.target_modules)})"
    )


def lora_lines(plan: Plan) -> list[str]:
    """Under LoRA, the bytes of the frozen and the trainable parameters, and what only the
    trainable ones have; nothing otherwise."""
    if plan.job.model.lora is None:
        return []
    return [
        f"LoRA: frozen parameters {format_bytes(4 * plan.frozen)}, trainable "
        f"{format_bytes(4 * plan.trainable)} (fp32, whole model); gradients, optimizer state "
        "and DDP's buckets are the trainable ones' only, FSDP gathers both"
    ]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned with two spaces; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data."""
    best = plan.smallest_fit()
    return {
        "model": plan.job.model.name,
        "parameters": plan.param_count,
        "trainable_parameters": plan.trainable,
        "frozen_parameter_bytes": 4 * plan.frozen,
        "trainable_parameter_bytes": 4 * plan.trainable,
        "precision": plan.job.precision,
        "optimizer": plan.job.optim.name,
        "global_batch": plan.job.data.batch_size,
        "gpu_memory": plan.gpu_memory,
        "layouts": [
            {
                "strategy": lay.strategy,
                "tp_size": lay.tp_size,
                "world_size": lay.world_size,
                "micro_batch": lay.micro_batch,
                "peak": lay.peak,
                "peak_moment": lay.peak_moment,
                "setup": lay.setup,
                "whole_build": lay.whole_build,
                "at_peak": lay.at_peak(),
                "moments": lay.moments,
                "fits": plan.fits(lay),
            }
            for lay in plan.layouts
        ],
        "smallest_fit": None
        if best is None
        else {"strategy": best.strategy, "tp_size": best.tp_size, "world_size": best.world_size},
        "notes": plan.notes,
    }
