"""What is done to each of the model's blocks before a strategy shards it: activation
checkpointing and ``torch.compile``.

Each block is compiled, then checkpointed, then sharded, and both work on each block's
``forward`` in place, so they compose with every strategy: DDP, FSDP and FSDP2 call
the block as before, their hooks stay outside the compiled graph, and the module tree and its
state-dict keys do not change (a checkpoint saved with either loads without it, and back).

Activation checkpointing keeps a checkpointed block's input and recomputes its activations
in backward (``torch.utils.checkpoint``, non-reentrant, RNG state restored: the same math).
``torch.compile`` compiles each block's forward as one graph (``fullgraph``), as TorchTitan
does per transformer block; a model without ``blocks`` is compiled whole. The checkpoint wraps
the compiled block (TorchTitan compiles the checkpointed one): the recompute is the same whole
block, and the compiler then never traces checkpointing's saved-tensor hooks, which in torch
2.13 fail on tensor parallelism's ``DTensor`` conversions inside a block.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from convoy.errors import ConfigError


def prepare_blocks(model: nn.Module, strategy_cfg: Any, compile_mode: bool | str) -> nn.Module:
    """Apply the strategy section's ``activation_checkpointing`` and ``run.compile`` to
    ``model``'s blocks, in place; returns ``model``."""
    mode = getattr(strategy_cfg, "activation_checkpointing", "none")
    if compile_mode == "model":  # the whole forward; checkpointed blocks inside trace too
        model.forward = torch.compile(model.forward)
    elif compile_mode:
        for target in compiled_targets(model):
            target.forward = torch.compile(target.forward, fullgraph=True)
    if mode != "none":
        every = 1 if mode == "full" else strategy_cfg.checkpoint_every
        for index, block in enumerate(model_blocks(model, mode)):
            if index % every == 0:
                block.forward = checkpointed(block.forward)
    return model


def compiled_targets(model: nn.Module, compile_mode: bool | str = "blocks") -> list[nn.Module]:
    """What ``run.compile`` compiles: each of the model's ``blocks`` (else the whole model),
    or the whole model for ``model``."""
    blocks = getattr(model, "blocks", None)
    if compile_mode == "model" or not (isinstance(blocks, nn.ModuleList) and len(blocks)):
        return [model]
    return list(blocks)


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks ``prepare_blocks`` checkpointed."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return []
    return [block for block in blocks if getattr(block.forward, CHECKPOINTED, False)]


def model_blocks(model: nn.Module, mode: str) -> list[nn.Module]:
    """The model's repeated blocks (``model.blocks``); a ``ConfigError`` where it has none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    raise ConfigError(
        "strategy.activation_checkpointing",
        mode,
        f"works per block, and {type(model).__name__} has no `blocks` (an nn.ModuleList of "
        "its repeated layers); expose them as `self.blocks`, or set it to 'none'",
    )


def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose activations are recomputed in backward instead of kept."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    setattr(run, CHECKPOINTED, True)
    return run


CHECKPOINTED = "_convoy_checkpointed"
"""Marks a block forward that ``checkpointed`` wrapped."""


def compile_seconds() -> float:
    """Seconds this process has spent in ``torch.compile`` (Dynamo's tracing and the
    backend's code generation), as Dynamo itself counts them; 0 before Dynamo is loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0  # nothing compiled, and importing Dynamo would cost a second
    # Dynamo's trace and the forward's compile, then AOT Autograd's lazy backward compile
    # (on the first backward through each graph).
    keys = ("_compile.compile_inner", "backward._backward_impl")
    return float(sum(sum(utils.compilation_time_metrics.get(key, [])) for key in keys))
