"""``convoy plan``: how much memory one rank needs, per strategy and world size.

The planner composes a rank's peak from parts it derives from the recipe's own model, data,
optimizer and strategy, without Ray, workers or a GPU:

- **model state**: parameters (fp32 master weights), gradients and optimizer state, whole on
  ``single`` / ``ddp``, divided by the world size on ``fsdp`` / ``fsdp2`` (each parameter's
  dim 0 split in N, as ``fully_shard`` does, so rank 0 holds the rounded-up chunk);
- **activations** of one micro-batch (``data.batch_size / (N x optim.grad_accum_steps)``):
  the storages autograd saves during one forward and loss of the real model, measured by a
  forward under ``FakeTensorMode`` (no memory, any size) in the precision the strategy runs
  (autocast for single/ddp, bf16 parameters for FSDP with ``precision: bf16``), plus the
  output the loop keeps for its metrics;
- **backward transient**: the most bytes backward holds beyond the saved activations
  (gradients of activations, e.g. of the logits and the log-softmax; one parameter's gradient
  as it is produced), measured by running that micro-batch's backward on fake tensors while
  following which storages are live: autograd frees saved activations as it passes their
  nodes, so this is not a fixed multiple of the largest one;
- **communication buffers**: DDP's gradient buckets (1x gradients: Convoy's DDP keeps
  ``gradient_as_bucket_view`` off), FSDP's working set: FSDP2's as ``fully_shard`` runs
  it (``Planner._fsdp2_held``: the root and each block unsharded in turn, all-gather outputs,
  the one unit gathered ahead in backward where there is one, the unit's gradients before
  the reduce-scatter; separate unsharded storages even on one rank), FSDP1's the largest
  wrap unit unsharded plus the next one all-gathered ahead (``NO_SHARD`` on one rank);
- **optimizer-step transient**: what one step of the recipe's optimizer allocates on top of
  its state (AdamW's foreach path: ``exp_avg_sq.sqrt()`` for a parameter group and the
  per-tensor temporaries), measured by one step on fake tensors of this rank's shapes;
- **set-up**: what a rank holds while the model is built, laid out and filled
  (``convoy.plan.setup``): its part plus one module's values for a model built on the meta
  device (``init_module``), the whole model first for one that is not.

Under LoRA (``model.lora``) the model is built with its adapters, as the engine builds it:
parameters are all of them, frozen and trainable; gradients, optimizer state and DDP's
buckets are the trainable ones' only; FSDP gathers both but reduce-scatters the adapters'
gradients alone.

The peak is the largest of a few moments: the start of backward (activations and the
backward transient), under FSDP2 the model's forward (its most bytes live at once, with the
batch) and backward within the model (the transient from the outputs' gradient on), each
with what FSDP2 holds then, and backward through a unit (FSDP1: the largest, with the next
one all-gathered and its fp32 gradients), the optimizer step (gradients, state and its
transient), and the set-up before the first step. ``convoy.plan.check`` runs the training
step (``convoy.engine.step``, the loop's own) under torch's memory trackers and compares.

Files, by idea:

- ``parse``: ``--gpu-memory``, ``--world-sizes`` and ``--strategies`` parsed; bytes printed;
- ``job``: the strategies a plan knows, in its order of preference, and the job each layout
  runs (strategy, world size, micro-batch, compute dtype). What the planner knows of a
  strategy (what it shards and how, its communication buffers, whether it casts
  parameters) its class says (``convoy.strategies``); the planner never asks its name;
- ``model``: what the model is built from (``ModelSource``), fake tensors and batches, wrap
  units and shard sizes, a fake process group;
- ``measure``: activations and the backward transient, optimizer state and step transient,
  measured under ``FakeTensorMode``;
- ``setup``: the set-up phase of a layout (build, layout, fill);
- ``planner``: ``Layout``, ``Planner``, ``Plan`` and ``plan_job``;
- ``format``: the plan as a table or as JSON-ready data;
- ``fits``: a job against a rank's memory, and the line that refuses it
  (``convoy.preflight.check_memory``, before any worker starts);
- ``check``: ``convoy plan --check``, the plan against torch's memory trackers (with
  ``fake_fill``: a meta-built model filled on fake tensors).
"""

from __future__ import annotations

from convoy.plan.format import format_plan, format_table, plan_to_dict
from convoy.plan.job import (
    DEFAULT_WORLD_SIZES,
    compute_dtype,
    layout_job,
    micro_batch,
    strategy_order,
)
from convoy.plan.measure import (
    Activations,
    OptimizerCost,
    measure_activations,
    measure_optimizer,
)
from convoy.plan.model import (
    ModelSource,
    blocks_and_root,
    build_raw,
    build_skeleton,
    fake_batch,
    fake_process_group,
    load_source,
    local_shapes,
    shard_numel,
    to_fake,
    wrap_units,
)
from convoy.plan.parse import (
    MEMORY_FORMS,
    format_bytes,
    parse_memory,
    parse_strategies,
    parse_world_sizes,
)
from convoy.plan.planner import (
    CATEGORIES,
    SETUP,
    Layout,
    Plan,
    Planner,
    plan_job,
    quiet_warnings,
)

__all__ = [
    "CATEGORIES",
    "DEFAULT_WORLD_SIZES",
    "MEMORY_FORMS",
    "SETUP",
    "Activations",
    "Layout",
    "ModelSource",
    "OptimizerCost",
    "Plan",
    "Planner",
    "blocks_and_root",
    "build_raw",
    "build_skeleton",
    "compute_dtype",
    "fake_batch",
    "fake_process_group",
    "format_bytes",
    "format_plan",
    "format_table",
    "layout_job",
    "load_source",
    "local_shapes",
    "measure_activations",
    "measure_optimizer",
    "micro_batch",
    "parse_memory",
    "parse_strategies",
    "parse_world_sizes",
    "plan_job",
    "plan_to_dict",
    "quiet_warnings",
    "shard_numel",
    "strategy_order",
    "to_fake",
    "wrap_units",
]
