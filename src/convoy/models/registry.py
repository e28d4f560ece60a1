"""Model registry: a name (or ``package.module:factory``) -> a factory returning ``nn.Module``.

Factories take keyword arguments only. The dataset supplies ``num_classes``, ``in_channels``
and ``image_size`` unless the recipe's ``model.kwargs`` sets them, and those three are passed
only to factories that accept them. Models that expose ``blocks`` (an ``nn.ModuleList``) get
per-block sharding from the FSDP strategies; others are sharded as one unit.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from convoy.errors import ConfigError, one_of
from convoy.models.mlp import mlp
from convoy.models.vit import vit_course, vit_tiny

ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {
    "vit_course": vit_course,
    "vit_tiny": vit_tiny,
    "mlp": mlp,
}
DATA_SHAPED_KWARGS = ("num_classes", "in_channels", "image_size")


def resolve_factory(name: str) -> ModelFactory:
    """Look up a registered name or import ``package.module:factory``."""
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise ConfigError(
            "model.name", name, f"{one_of(MODELS)}, or a factory path 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("model.name", name, f"could not import the factory: {exc}") from None
    if not callable(factory):
        raise ConfigError("model.name", name, "the import path must name a callable")
    return factory


def check_model(name: str, kwargs: dict[str, Any]) -> None:
    """Fail early if the factory does not exist or does not accept ``kwargs``."""
    params = inspect.signature(resolve_factory(name)).parameters
    if name in MODELS:  # built-in factories forward **kwargs to a class: check the class
        params = inspect.signature(_model_class(name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in kwargs:
        if key not in params:
            raise ConfigError(f"model.kwargs.{key}", kwargs[key], f"{name} takes {one_of(params)}")


def _model_class(name: str) -> Callable[..., nn.Module]:
    from convoy.models.mlp import MLP
    from convoy.models.vit import ViT

    return MLP if name == "mlp" else ViT


def build_model(name: str, kwargs: dict[str, Any], data_shape: dict[str, int]) -> nn.Module:
    """Build a model, filling data-shaped arguments the factory accepts from the dataset."""
    factory = resolve_factory(name)
    params = inspect.signature(_model_class(name) if name in MODELS else factory).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    merged = {k: v for k, v in data_shape.items() if takes_any or k in params}
    merged.update(kwargs)
    try:
        return factory(**merged)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.kwargs", kwargs, f"{name} rejected them: {exc}") from None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
