"""Optimizer and learning-rate schedule: AdamW/SGD, linear warmup, then cosine or constant."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convoy.config import OptimConfig

# Wrappers insert these into parameter names; strip them to match the unwrapped model.
_WRAPPER_PREFIXES = re.compile(r"(^|\.)(?:(?:module|_fsdp_wrapped_module|_orig_mod)\.)+")


def canonical_name(name: str) -> str:
    return _WRAPPER_PREFIXES.sub(r"\1", name)


def no_decay_names(model: nn.Module) -> set[str]:
    """Biases, norms and embeddings (parameters under 2-D) get no weight decay.

    Computed on the unwrapped model: after sharding, a parameter's local shape says nothing.
    """
    return {canonical_name(n) for n, p in model.named_parameters() if p.ndim < 2}


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    """The configured lr, linearly scaled by global batch when ``scale_lr_base_batch`` is set."""
    if cfg.scale_lr_base_batch is None:
        return cfg.lr
    return cfg.lr * global_batch / cfg.scale_lr_base_batch


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}

# The methods torch wraps so that Dynamo never traces them (``torch._disable_dynamo``), and
# ``step``, which torch wraps to break Dynamo's graph around it: each wrapper imports
# torch._dynamo (and sympy) on its first call, 1-2 CPU-s in every process that trains.
_DYNAMO_GUARDED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


def eager_optimizer_class(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with its Dynamo guards taken off: the same methods, run as they are.

    The guards only matter where Dynamo compiles the code that calls the optimizer; Convoy
    compiles models, never its loop, so a job without ``run.compile`` has nothing for them to
    guard. Step hooks, the LR scheduler's bookkeeping and the profiler's step label stay
    (torch adds them around the class's ``step``, this one included)."""
    namespace: dict[str, Any] = {
        name: getattr(cls, name).__wrapped__
        for name in _DYNAMO_GUARDED
        if hasattr(getattr(cls, name), "__wrapped__")
    }
    step = _undecorated(cls.step)

    def eager_step(self: torch.optim.Optimizer, closure: Callable[[], float] | None = None) -> Any:
        # What torch's wrapper does besides the graph breaks: grad mode as the optimizer says.
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return step(self, closure)

    namespace["step"] = eager_step
    namespace["__doc__"] = cls.__doc__
    return type(cls.__name__, (cls,), namespace)


def _undecorated(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` under torch's wrappers (its profiler hook, if a first instance added it,
    and the graph-break wrapper)."""
    while hasattr(method, "__wrapped__"):
        method = method.__wrapped__
    return method


EAGER_OPTIMIZERS = {name: eager_optimizer_class(cls) for name, cls in OPTIMIZERS.items()}


def build_optimizer(
    cfg: OptimConfig, model: nn.Module, no_decay: set[str], lr: float, compiled: bool = False
) -> torch.optim.Optimizer:
    """``cfg``'s optimizer over ``model``'s trainable parameters: ``cfg.weight_decay`` on
    all but ``no_decay``, which get none. ``compiled``: the job compiles (keep torch's
    Dynamo guards on the optimizer)."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if canonical_name(name) in no_decay else decay).append(param)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    device = next((p.device for p in decay + plain), torch.device("cpu"))
    return make_optimizer(cfg, groups, lr, device, compiled)


def make_optimizer(
    cfg: OptimConfig,
    groups: list[dict[str, Any]],
    lr: float,
    device: torch.device | None = None,
    compiled: bool = False,
) -> torch.optim.Optimizer:
    """torch's optimizer named by ``cfg.name`` over param ``groups`` (each with its own
    ``weight_decay``), with the config's other fields (``momentum`` or ``betas``), fused
    where ``cfg.fused`` says (by default on CUDA); without torch's Dynamo guards unless the
    job compiles (``eager_optimizer_class``)."""
    shared = {k: v for k, v in cfg.hyperparameters.items() if k != "weight_decay"}
    fused = cfg.fused if cfg.fused is not None else device is not None and device.type == "cuda"
    if fused:
        shared["fused"] = True
    optimizer_class: Callable[..., torch.optim.Optimizer] = (
        OPTIMIZERS if compiled else EAGER_OPTIMIZERS
    )[cfg.name]
    return optimizer_class(groups, lr=lr, **shared)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): warmup, then cosine to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, total_steps)
    )
