"""A meta-built model filled on fake tensors as ``convoy.models.init`` fills it for real:
what ``convoy plan --check`` tracks as a layout's set-up (``convoy.plan.check``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


class FakeWeights:
    """Fills a meta-built model as ``convoy.models.init.InitialWeights`` does, on fake
    tensors, under the set-up tracker: the strategy's layout materialized (the rank's part),
    then each module's full parameters made in turn (their values are not needed to follow
    memory). A shared parameter is made once."""

    def __init__(self, mode: FakeTensorMode, tracker: Any) -> None:
        self.mode = mode
        self.tracker = tracker
        self.filled: set[int] = set()

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """``to_empty`` on ``device``, as fake tensors, with tied parameters tied again
        (``to_empty`` makes one tensor per module that holds a parameter)."""
        old = {
            (id(m), k): p
            for m in model.modules()
            for k, p in m._parameters.items()
            if p is not None
        }
        # The skeleton's tensors are plain meta ones: the mode takes them as inputs once.
        self.mode.allow_non_fake_inputs = True
        try:
            with self.mode, self.tracker:
                model.to_empty(device=device)
                made: dict[int, Any] = {}
                for module in model.modules():
                    for key, param in list(module._parameters.items()):
                        before = old.get((id(module), key))
                        if before is not None:
                            module._parameters[key] = made.setdefault(id(before), param)
        finally:
            self.mode.allow_non_fake_inputs = False

    def fill(self, model: nn.Module) -> None:
        """Each module's own full parameters, one module at a time."""
        with self.mode, self.tracker:
            for module in model.modules():
                self._make_values(module)

    def materialize_and_fill(self, module: nn.Module, device: torch.device) -> None:
        """One module's own (FSDP1's ``param_init_fn``; FSDP1 runs on real tensors here)."""
        with self.mode, self.tracker:
            module.to_empty(device=device, recurse=False)
            self._make_values(module)

    def _make_values(self, module: nn.Module) -> None:
        own = [p for p in module.parameters(recurse=False) if id(p) not in self.filled]
        self.filled.update(id(p) for p in own)
        values = [torch.empty(p.shape, dtype=p.dtype) for p in own]  # full shapes (DTensor)
        del values
