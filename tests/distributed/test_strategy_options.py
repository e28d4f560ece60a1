"""Strategy options on real gloo groups: compression hooks, mixed precision, CPU offload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_strategy_parity import STEPS, parity_job, step_losses
from torch import nn

from convoy.config import load_job
from convoy.data.sources import load_digits
from convoy.distributed import WorkerContext, join_process_group
from convoy.engine.loop import train
from convoy.models.registry import build_model
from convoy.strategies import build_strategy
from convoy.testing import run_on_gloo, train_on_rank

pytestmark = pytest.mark.distributed

# fp32 reference for the options below: 8 steps of the parity job (see test_strategy_parity).
OPTIONS = [
    ("ddp", "fp32", ["strategy.comm_hook=fp16"]),
    ("ddp", "fp32", ["strategy.comm_hook=bf16"]),
    ("ddp", "bf16", []),
    ("fsdp", "bf16", []),
    ("fsdp2", "bf16", []),
    ("fsdp2", "bf16", ["strategy.reduce_dtype=bf16", "strategy.reshard_after_forward=false"]),
    ("fsdp2", "fp32", ["strategy.cpu_offload=true"]),
]


def dtypes_seen_in_forward(
    ctx: WorkerContext, strategy_name: str, precision: str
) -> dict[str, str]:
    """Wrap the tiny ViT and report the dtype a block's Linear computes with vs stores."""
    join_process_group(ctx, timeout_s=60)
    torch.manual_seed(0)
    model = build_model(
        "vit_tiny", {"depth": 2, "hidden": 32, "mlp": 64}, load_digits(load_job().data).shape
    )
    job = load_job(None, [f"strategy.name={strategy_name}", f"precision={precision}"])
    strategy = build_strategy(
        job.strategy, ctx.device, getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[precision])
    )
    wrapped = strategy.wrap(model)
    seen: dict[str, str] = {}
    linear: nn.Linear = strategy.unwrap(wrapped).blocks[0].mlp[0]  # type: ignore[index,assignment]

    def record(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        seen.setdefault("compute", str(output.dtype))

    linear.register_forward_hook(record)
    wrapped(torch.randn(4, 1, 8, 8)).float().sum().backward()
    seen["stored"] = str(next(wrapped.parameters()).dtype)
    return seen


@pytest.fixture(scope="module")
def fp32_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    job = parity_job(tmp_path_factory.mktemp("fp32"), "single", 1)
    train(job, WorkerContext())
    return step_losses(job)


@pytest.mark.parametrize(("strategy", "precision", "extra"), OPTIONS, ids=str)
def test_option_trains_close_to_fp32(
    strategy: str, precision: str, extra: list[str], fp32_losses: list[float], tmp_path: Path
) -> None:
    job = parity_job(tmp_path, strategy, 2, [f"precision={precision}", *extra])
    run_on_gloo(train_on_rank, 2, job)
    losses = step_losses(job)
    assert len(losses) == STEPS
    # Lower-precision math changes the losses a little, never a lot.
    assert losses == pytest.approx(fp32_losses, rel=0.03)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_bf16_is_real_mixed_precision(strategy: str) -> None:
    """Blocks compute in bf16 while the sharded master parameters stay fp32."""
    seen = run_on_gloo(dtypes_seen_in_forward, 2, strategy, "bf16")[0]
    assert seen == {"compute": "torch.bfloat16", "stored": "torch.float32"}


def test_fp32_fsdp2_computes_in_fp32() -> None:
    seen = run_on_gloo(dtypes_seen_in_forward, 2, "fsdp2", "fp32")[0]
    assert seen == {"compute": "torch.float32", "stored": "torch.float32"}


def hsdp_layout(ctx: WorkerContext, shard_size: int | None, tp: int = 1) -> dict[str, object]:
    """Wrap the tiny ViT under hsdp; the mesh and placements of one parameter."""
    from torch.distributed.tensor import DTensor

    join_process_group(ctx, timeout_s=60)
    model = build_model(
        "vit_tiny", {"depth": 2, "hidden": 32, "mlp": 64}, load_digits(load_job().data).shape
    )
    # Under Ray the placement decides the workers per node: given here as 2.
    overrides = ["strategy.name=hsdp", f"scaling.num_workers={ctx.world_size}"]
    overrides += ["scaling.launcher=ray", f"strategy.tp_size={tp}"]
    overrides += [f"strategy.shard_size={shard_size}"] * bool(shard_size)
    job = load_job(None, overrides)
    strategy = build_strategy(job.strategy, ctx.device, torch.float32, local_world_size=2 * tp)
    wrapped = strategy.wrap(model)
    weight = wrapped.blocks[0].mlp[0].weight  # type: ignore[index,union-attr]
    norm = wrapped.blocks[0].norm1.weight  # type: ignore[index,union-attr]
    assert isinstance(weight, DTensor) and isinstance(norm, DTensor)
    return {
        "mesh": tuple(weight.device_mesh.shape),
        "names": weight.device_mesh.mesh_dim_names,
        "placements": [str(p) for p in weight.placements],
        "norm": [str(p) for p in norm.placements],
    }


def test_hsdp_shards_within_a_group_and_replicates_across() -> None:
    """4 ranks, shard groups of 2 (given, or the workers of a node by default): a 2 x 2
    mesh, each parameter replicated over the first dimension and dim-0 sharded over the
    second."""
    for shard_size in (2, None):
        layouts = run_on_gloo(hsdp_layout, 4, shard_size)
        assert layouts[0] == {
            "mesh": (2, 2),
            "names": ("replicate", "shard"),
            "placements": ["R", "S(0)"],  # Replicate(), Shard(0)
            "norm": ["R", "S(0)"],
        }


def test_hsdp_with_tensor_parallel_is_a_three_dimensional_mesh() -> None:
    """8 ranks, hsdp with tp 2 and the default shard group (a node's 4 workers over tp 2:
    2): replicate x shard x tp. A column-split weight is split over tp too (FSDP's
    dim-0 shard taken within each tp slice: a strided shard); a norm is whole over tp."""
    layouts = run_on_gloo(hsdp_layout, 8, None, 2)
    assert layouts[0] == {
        "mesh": (2, 2, 2),
        "names": ("replicate", "shard", "tp"),
        "placements": ["R", "_S(0, 2)", "S(0)"],
        "norm": ["R", "S(0)", "R"],
    }
