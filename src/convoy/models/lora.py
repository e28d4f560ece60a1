"""LoRA adapters through PEFT (``model.lora``), on ``hf`` models and on any model by names.

``apply_lora`` injects PEFT's LoRA layers into the model the factory built
(``peft.inject_adapter_in_model``: the model keeps its class and its names, each target
linear becoming ``<name>.base_layer`` beside ``<name>.lora_A.default`` /
``lora_B.default``) and freezes everything else, before any strategy lays it out: FSDP
units then hold frozen and trainable parameters side by side (FSDP2 shards per parameter, so
that mixes freely), and the optimizer gets the adapters only.

Initial values, layout-independent as every model's (``convoy.models.init``): ``lora_A`` as
``nn.Linear``'s default (PEFT's ``init_lora_weights=True``: Kaiming-uniform), ``lora_B``
zero, so the adapted model starts as the base; the base layers keep the seeds of their names
without ``.base_layer`` (the same values as without LoRA), or the folder's weights.

``peft`` is the ``lora`` extra, imported only by a job with ``model.lora``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from convoy.errors import ConfigError, ConvoyError
from convoy.imports import missing_extra
from convoy.models.attention import init_role
from convoy.models.init import mark

ADAPTER = "default"
"""PEFT's adapter name: its keys are ``...lora_A.default.weight``."""


def peft_module() -> Any:
    """``peft``, or a ``ConvoyError`` with the install line (the ``lora`` extra)."""
    try:
        import peft
    except ImportError:
        raise ConvoyError(missing_extra("model.lora", "peft", "lora")) from None
    return peft


def apply_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """``model`` with LoRA adapters on ``cfg.target_modules`` (``model.lora``), its other
    parameters frozen; a ``ConfigError`` naming the candidates where no module matches."""
    peft = peft_module()
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=True,
    )
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except (ValueError, peft.tuners.tuners_utils.NoMatchingPeftModuleError):
        raise ConfigError(
            "model.lora.target_modules",
            list(cfg.target_modules),
            f"no module of {type(model).__name__} matches; its linear layers are named "
            f"{', '.join(linear_names(model)) or 'nothing'}",
        ) from None
    for name, module in model.named_modules():
        if name.endswith(f"lora_A.{ADAPTER}"):
            mark(module, init_role="lora_A")
        elif name.endswith(f"lora_B.{ADAPTER}"):
            mark(module, init_role="lora_B")
    base_init = getattr(model, "init_module", None)
    if callable(base_init):
        vars(model)["init_module"] = _lora_init(base_init)
    return model


def check_layout(cfg: Any, tp_size: int) -> None:
    """LoRA with tensor parallelism is refused: the plans split layers by their names, which
    the adapters' wrappers change (``q`` becomes ``q.base_layer`` beside ``q.lora_A``)."""
    if cfg is not None and tp_size > 1:
        raise ConfigError(
            "strategy.tp_size",
            tp_size,
            "model.lora trains under data parallelism only (single, ddp, fsdp2, hsdp): set "
            "strategy.tp_size=1",
        )


def _lora_init(base_init: Any) -> Any:
    """The model's ``init_module`` with PEFT's init of the adapters: A Kaiming-uniform (as
    ``nn.Linear``'s default), B zero."""

    def init_module(module: nn.Module) -> None:
        role = init_role(module)
        if role == "lora_A":
            assert isinstance(module, nn.Linear)
            nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif role == "lora_B":
            assert isinstance(module, nn.Linear)
            nn.init.zeros_(module.weight)
        else:
            base_init(module)

    return init_module


def linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (what ``target_modules`` takes)."""
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name
    }
    return sorted(names)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)`` parameters, each shared tensor once (PEFT's
    ``get_nb_trainable_parameters``)."""
    trainable = total = 0
    for param in model.parameters():
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return trainable, total
