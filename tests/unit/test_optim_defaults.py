"""The optimizer's fields default to torch's for the chosen optimizer, a field it does not have
is refused (but dropped from a job Convoy saved before), and ``convoy train`` says first which
optimizer and schedule it will use."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.cli import main
from convoy.commands.train import optimizer_line
from convoy.config import (
    TORCH_DEFAULTS,
    OptimConfig,
    job_from_dict,
    job_from_saved,
    job_to_yaml,
    load_job,
)
from convoy.errors import ConfigError

TORCH_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@pytest.mark.parametrize("name", sorted(TORCH_DEFAULTS))
def test_defaults_are_torchs(name: str) -> None:
    signature = inspect.signature(TORCH_OPTIMIZERS[name]).parameters
    assert TORCH_DEFAULTS[name] == {key: signature[key].default for key in TORCH_DEFAULTS[name]}
    assert OptimConfig().lr == signature["lr"].default


def test_sgd_has_no_weight_decay_and_torchs_momentum() -> None:
    cfg = OptimConfig(name="sgd")
    assert (cfg.weight_decay, cfg.momentum, cfg.betas) == (0.0, 0.0, None)
    assert cfg.hyperparameters == {"momentum": 0.0, "weight_decay": 0.0}


def test_adamw_defaults() -> None:
    cfg = OptimConfig()
    assert (cfg.name, cfg.weight_decay, cfg.betas, cfg.momentum) == (
        "adamw",
        0.01,
        (0.9, 0.999),
        None,
    )


def test_explicit_values_are_kept() -> None:
    sgd = OptimConfig(name="sgd", momentum=0.9, weight_decay=5e-4)
    assert (sgd.momentum, sgd.weight_decay) == (0.9, 5e-4)
    adamw = OptimConfig(weight_decay=0.05, betas=(0.9, 0.95))
    assert (adamw.weight_decay, adamw.betas) == (0.05, (0.9, 0.95))
    assert load_job("recipes/lm_tiny.yaml").optim.betas == (0.9, 0.95)


def test_config_show_prints_the_resolved_values() -> None:
    text = job_to_yaml(load_job(None, ["optim.name=sgd"]))
    assert "  weight_decay: 0.0\n  momentum: 0.0\n  betas: null\n" in text


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["optim.name=sgd", "optim.betas=[0.9, 0.95]"],
            "optim.betas: got (0.9, 0.95); set but optim.name is 'sgd', which has no betas; "
            "remove it, or use optim.name: adamw",
        ),
        (["optim.momentum=0.9"], "optim.momentum: got 0.9; set but optim.name is 'adamw'"),
        (["optim.betas=[0.9, 1.5]"], "optim.betas: got [0.9, 1.5]; allowed: two numbers in"),
        (["optim.name=sgd", "optim.momentum=1"], "optim.momentum: got 1; input should be less"),
    ],
)
def test_a_field_the_optimizer_lacks_is_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_job(None, overrides)
    assert str(error.value).startswith(expected)


def saved_before_torch_defaults(name: str) -> dict[str, Any]:
    """A job as runs saved it before the optimizer fields followed torch's: all three written
    out whatever the optimizer (momentum under adamw, betas under sgd)."""
    data = load_job(None, [f"optim.name={name}"]).model_dump(mode="json")
    data["optim"].update(weight_decay=0.05, momentum=0.9, betas=[0.9, 0.999])
    return data


@pytest.mark.parametrize(
    ("name", "lacks", "used"),
    [
        ("adamw", "momentum", {"betas": (0.9, 0.999), "weight_decay": 0.05}),
        ("sgd", "betas", {"momentum": 0.9, "weight_decay": 0.05}),
    ],
)
def test_a_saved_job_drops_the_field_its_optimizer_never_read(
    name: str, lacks: str, used: dict[str, Any]
) -> None:
    data = saved_before_torch_defaults(name)
    with pytest.raises(ConfigError, match=rf"^optim\.{lacks}: .* has no {lacks};"):
        job_from_dict(data)  # as a recipe
    job = job_from_saved(data)
    assert job.optim.hyperparameters == used
    assert getattr(job.optim, lacks) is None
    assert data["optim"][lacks] is not None  # the caller's dict is left as it was
    assert job_from_saved(job.model_dump(mode="json")) == job  # today's shape round-trips


def test_overrides_on_a_saved_job_are_checked_like_a_recipes() -> None:
    data = saved_before_torch_defaults("adamw")
    assert job_from_saved(data, ["optim.lr=0.1"]).optim.lr == 0.1
    with pytest.raises(ConfigError) as error:
        job_from_saved(data, ["optim.momentum=0.5"])
    assert str(error.value).startswith("optim.momentum: got 0.5; set but optim.name is 'adamw'")
    with pytest.raises(ConfigError, match=r"^optim\.name: got 'lamb'"):
        job_from_saved({"optim": {"name": "lamb", "momentum": 0.9}})


def test_first_line_names_optimizer_schedule_and_defaults() -> None:
    job = load_job(None, ["optim.name=sgd", "optim.lr=0.01", "optim.momentum=0.9"])
    assert optimizer_line(job) == (
        "convoy: optimizer sgd(lr=0.01, momentum=0.9, weight_decay=0) | "
        "schedule cosine(warmup_steps=0, min_lr_ratio=0) over 1 epoch | "
        "defaults: weight_decay, schedule, warmup_steps, min_lr_ratio"
    )
    job = load_job("recipes/lm_tiny.yaml", ["optim.schedule=constant", "run.max_steps=9"])
    assert optimizer_line(job) == (
        "convoy: optimizer adamw(lr=0.003, betas=(0.9, 0.95), weight_decay=0.1) | "
        "schedule constant(warmup_steps=20) over 20 epochs, at most 9 steps"
    )


def test_convoy_train_prints_it_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [
        "model.name=mlp",
        "strategy.name=single",
        "scaling.launcher=local",
        "scaling.num_workers=1",
        "optim.name=sgd",
        "run.max_steps=2",
        "run.progress=off",
        f"run.storage_dir={tmp_path}",
    ]
    assert main(["train", *(arg for o in overrides for arg in ("-o", o))]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("convoy: optimizer sgd(lr=0.001, momentum=0, weight_decay=0) | ")
