"""Model registry: a name (or ``package.module:factory``) -> a factory returning ``nn.Module``.

Built in: vision (``vit_course``, ``vit_tiny``, ``mlp``), causal language models (``gpt`` and
the presets ``gpt_tiny``, ``gpt_small``, ``gpt_1b``), a time-series classifier
(``conv1d``), a network for tabular rows (``tabular_mlp``) and any Hugging Face
``transformers`` model from a local folder or a config (``hf``, ``convoy.models.huggingface``).

Factories take keyword arguments only. The dataset supplies its data-shaped arguments
(``num_classes``, ``in_channels``, ``image_size``, ``vocab_size``, ``num_features``...) unless
the recipe's ``model.kwargs`` sets them, and each is passed only to factories that accept it.
Models that expose ``blocks`` (an ``nn.ModuleList``) get per-block sharding from the FSDP
strategies; others are sharded as one unit.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convoy.errors import ConfigError, ConvoyError, one_of
from convoy.imports import import_attribute
from convoy.models.gpt import GPT, gpt_1b, gpt_small, gpt_tiny
from convoy.models.huggingface import hf
from convoy.models.init import InitialWeights, builds_on_meta, parameters_on_meta
from convoy.models.lora import apply_lora
from convoy.models.mlp import MLP
from convoy.models.sequence import Conv1dNet
from convoy.models.tabular import TabularMLP
from convoy.models.vit import vit_course, vit_tiny

ModelFactory = Callable[..., nn.Module]

MODELS: dict[str, ModelFactory] = {
    "vit_course": vit_course,
    "vit_tiny": vit_tiny,
    "mlp": MLP,
    "gpt": GPT,
    "gpt_tiny": gpt_tiny,
    "gpt_small": gpt_small,
    "gpt_1b": gpt_1b,
    "conv1d": Conv1dNet,
    "tabular_mlp": TabularMLP,
    "hf": hf,
}


def resolve_factory(name: str) -> ModelFactory:
    """Look up a registered name or import ``package.module:factory``."""
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise ConfigError(
            "model.name", name, f"{one_of(MODELS)}, or a factory path 'package.module:function'"
        )
    factory = import_attribute("model.name", name, "a model factory is 'package.module:function'")
    if not callable(factory):
        raise ConfigError("model.name", name, "the import path must name a callable")
    return factory


def _accepts(factory: ModelFactory) -> tuple[set[str], bool]:
    """The keyword names a factory takes, and whether it takes any (``**kwargs``)."""
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return set(params), takes_any


def check_model(name: str, kwargs: dict[str, Any]) -> None:
    """Fail early if the factory does not exist or does not accept ``kwargs``."""
    names, takes_any = _accepts(resolve_factory(name))
    for key in kwargs:
        if not takes_any and key not in names:
            raise ConfigError(f"model.kwargs.{key}", kwargs[key], f"{name} takes {one_of(names)}")


def build_model(name: str, kwargs: dict[str, Any], data_shape: dict[str, int]) -> nn.Module:
    """Build a model, filling data-shaped arguments the factory accepts from the dataset."""
    factory = resolve_factory(name)
    names, takes_any = _accepts(factory)
    merged = {k: v for k, v in data_shape.items() if takes_any or k in names}
    merged.update(kwargs)
    try:
        return factory(**merged)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.kwargs", kwargs, f"{name} rejected them: {exc}") from None


def build_skeleton(
    name: str, kwargs: dict[str, Any], data_shape: dict[str, int], seed: int, lora: Any = None
) -> tuple[nn.Module, InitialWeights | None]:
    """The model with its parameters on the meta device and the initial weights that fill
    them once the strategy has laid it out (``convoy.models.init``), where the model says how
    each module is initialized (``init_module``); otherwise built for real, as
    ``build_model``, and None. ``lora`` (``model.lora``): with PEFT's adapters, the rest
    frozen (``convoy.models.lora``)."""
    if _may_build_on_meta(name, kwargs):
        model = _try_on_meta(name, kwargs, data_shape, lora)
        if model is not None:
            return model, InitialWeights(model, seed)
    model = build_model(name, kwargs, data_shape)
    return (model if lora is None else apply_lora(model, lora)), None


def build_initial(
    name: str, kwargs: dict[str, Any], data_shape: dict[str, int], seed: int, lora: Any = None
) -> nn.Module:
    """The whole model on the CPU with the initial weights the engine trains from under any
    strategy (``run.seed`` = ``seed``)."""
    model, weights = build_skeleton(name, kwargs, data_shape, seed, lora)
    if weights is not None:
        weights.materialize(model, torch.device("cpu"))
        weights.fill(model)
    return model


def _factory_class(name: str) -> type | None:
    """The class a factory builds, where it is one (through ``functools.partial``)."""
    factory = resolve_factory(name)
    while isinstance(factory, functools.partial):
        factory = factory.func
    return factory if isinstance(factory, type) else None


def _class_has_init_module(name: str) -> bool:
    return callable(getattr(_factory_class(name), "init_module", None))


def _may_build_on_meta(name: str, kwargs: dict[str, Any]) -> bool:
    # A class says before it is built; a function is tried on meta (cheap) and asked after.
    return _factory_class(name) is None or _class_has_init_module(name)


def check_builds_on_meta(
    name: str, kwargs: dict[str, Any], data_shape: dict[str, int], lora: Any = None
) -> None:
    """The driver's check: a model that will be built on the meta device builds there (a
    ``ConfigError`` in one line where its factory fails on meta), and takes its adapters
    (``model.lora``: target modules that exist)."""
    if _may_build_on_meta(name, kwargs):
        _try_on_meta(name, kwargs, data_shape, lora)


def _try_on_meta(
    name: str, kwargs: dict[str, Any], data_shape: dict[str, int], lora: Any = None
) -> nn.Module | None:
    """The model built with its parameters on meta, or None where it has no ``init_module``
    or its factory copied values into them (weights it loaded, which meta would drop). A
    factory that fails on meta is a ``ConfigError`` if its model has ``init_module`` (it asked
    to be built there); otherwise None: it is built for real, as before."""
    with (
        torch.random.fork_rng(devices=[]),  # a build that is thrown away leaves no trace
        parameters_on_meta(),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        try:
            model = build_model(name, kwargs, data_shape)
            if lora is not None and builds_on_meta(model):
                model = apply_lora(model, lora)
        except ConvoyError:
            raise
        except Exception as exc:
            if not _class_has_init_module(name):
                return None
            raise ConfigError(
                "model.name",
                name,
                f"it has init_module, so it is built with its parameters on the meta device, "
                f"and its factory failed there ({type(exc).__name__}: {exc}); make __init__ "
                "create parameters without reading their values, or drop init_module",
            ) from None
    loaded = any("meta parameter" in str(w.message) for w in caught)
    for w in caught:
        if "meta parameter" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model if builds_on_meta(model) and not loaded else None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
