"""Learning-rate schedule, lr scaling, and the weight-decay split of the optimizer."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from convoy.config import OptimConfig
from convoy.engine.schedule import (
    build_optimizer,
    build_scheduler,
    canonical_name,
    lr_factor,
    no_decay_names,
    peak_lr,
)
from convoy.models import build_model

DIGITS_SHAPE = {"num_classes": 10, "in_channels": 1, "image_size": 8}


def test_warmup_is_linear_up_to_one() -> None:
    cfg = OptimConfig(warmup_steps=4)
    assert [lr_factor(s, cfg, 20) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


@pytest.mark.parametrize(("warmup", "min_ratio"), [(0, 0.0), (4, 0.1), (10, 0.5)])
def test_cosine_decays_to_min_lr_ratio(warmup: int, min_ratio: float) -> None:
    cfg = OptimConfig(warmup_steps=warmup, min_lr_ratio=min_ratio)
    factors = [lr_factor(s, cfg, 30) for s in range(warmup, 40)]
    assert factors[0] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors))  # non-increasing
    midpoint = warmup + (30 - warmup) // 2  # 30 - warmup is even for every case
    assert lr_factor(midpoint, cfg, 30) == pytest.approx(min_ratio + (1 - min_ratio) / 2)
    assert lr_factor(30, cfg, 30) == pytest.approx(min_ratio)
    assert lr_factor(39, cfg, 30) == pytest.approx(min_ratio)  # stays at the floor


def test_constant_schedule_stays_at_one_after_warmup() -> None:
    cfg = OptimConfig(warmup_steps=3, schedule="constant", min_lr_ratio=0.2)
    assert [lr_factor(s, cfg, 10) for s in range(15)] == [1 / 3, 2 / 3] + [1.0] * 13


def test_scheduler_applies_the_factor_to_every_group() -> None:
    cfg = OptimConfig(lr=0.1, warmup_steps=2)
    model = nn.Linear(2, 2)
    optimizer = build_optimizer(cfg, model, no_decay_names(model), lr=0.1)
    scheduler = build_scheduler(optimizer, cfg, total_steps=10)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.05])
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1, 0.1])


def test_peak_lr_scales_linearly_with_global_batch() -> None:
    assert peak_lr(OptimConfig(lr=1e-3), 1024) == 1e-3
    cfg = OptimConfig(lr=1e-3, scale_lr_base_batch=256)
    assert peak_lr(cfg, 256) == pytest.approx(1e-3)
    assert peak_lr(cfg, 1024) == pytest.approx(4e-3)
    assert peak_lr(cfg, 64) == pytest.approx(2.5e-4)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("blocks.0.norm1.weight", "blocks.0.norm1.weight"),
        ("module.head.bias", "head.bias"),
        ("_orig_mod.head.bias", "head.bias"),
        ("blocks.0._fsdp_wrapped_module.attn.q.weight", "blocks.0.attn.q.weight"),
        ("module.blocks.1._fsdp_wrapped_module.norm2.bias", "blocks.1.norm2.bias"),
        ("submodule.bias", "submodule.bias"),  # only whole path components are stripped
        ("_orig_mod.module.head.bias", "head.bias"),
        (
            "module._fsdp_wrapped_module.blocks.1._fsdp_wrapped_module.norm2.bias",
            "blocks.1.norm2.bias",
        ),
    ],
)
def test_canonical_name_strips_wrapper_prefixes(name: str, expected: str) -> None:
    assert canonical_name(name) == expected


class Wrapper(nn.Module):
    """Inserts ``<attr>.`` into every parameter name, as DDP / FSDP1 / compile do."""

    def __init__(self, inner: nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)


def wrap(model: nn.Module, outer: tuple[str, ...]) -> nn.Module:
    """Wrap each block in ``_fsdp_wrapped_module``, then the model in each of ``outer``."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = Wrapper(block, "_fsdp_wrapped_module")
    for attr in outer:
        model = Wrapper(model, attr)
    return model


@pytest.mark.parametrize(
    "outer",
    [
        None,
        ("module",),
        ("_fsdp_wrapped_module",),
        ("_fsdp_wrapped_module", "module"),
    ],
)
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
def test_params_under_2d_get_no_weight_decay(outer: tuple[str, ...] | None, optim: str) -> None:
    model = build_model("vit_tiny", {"depth": 2}, DIGITS_SHAPE)
    model.head.weight.requires_grad_(False)
    no_decay = no_decay_names(model)
    low_dim = {id(p) for p in model.parameters() if p.ndim < 2}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if outer is not None:
        model = wrap(model, outer)
        assert all(n.startswith(f"{outer[-1]}.") for n, _ in model.named_parameters())
    cfg = OptimConfig(name=optim, weight_decay=0.05)
    optimizer = build_optimizer(cfg, model, no_decay, lr=1e-3)
    decay, plain = optimizer.param_groups
    assert (decay["weight_decay"], plain["weight_decay"]) == (0.05, 0.0)
    assert {id(p) for p in plain["params"]} == low_dim
    assert {id(p) for p in decay["params"]} == trainable - low_dim
    assert isinstance(optimizer, torch.optim.SGD if optim == "sgd" else torch.optim.AdamW)


def test_no_decay_names_are_biases_and_norms() -> None:
    names = no_decay_names(build_model("vit_tiny", {"depth": 1}, DIGITS_SHAPE))
    assert {"head.bias", "norm.weight", "blocks.0.norm1.bias", "blocks.0.attn.k.bias"} <= names
    assert not names & {"head.weight", "blocks.0.attn.k.weight", "pos_embed", "cls_token"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"name": "sgd"}, {"momentum": 0.0, "weight_decay": 0.0}),
        ({"name": "sgd", "momentum": 0.9}, {"momentum": 0.9, "weight_decay": 0.0}),
        ({"name": "adamw"}, {"betas": (0.9, 0.999), "weight_decay": 0.01}),
        (
            {"name": "adamw", "betas": (0.9, 0.95), "weight_decay": 0.1},
            {"betas": (0.9, 0.95), "weight_decay": 0.1},
        ),
    ],
)
def test_the_optimizer_built_has_the_resolved_values(
    overrides: dict[str, object], expected: dict[str, object]
) -> None:
    model = build_model("mlp", {"hidden": 8}, DIGITS_SHAPE)
    optimizer = build_optimizer(OptimConfig(**overrides), model, no_decay_names(model), lr=0.01)
    decay, plain = optimizer.param_groups
    assert {key: decay[key] for key in expected} == expected
    assert plain["weight_decay"] == 0.0 and decay["lr"] == 0.01
