"""Tensor parallelism for ``fsdp2`` / ``hsdp`` (``strategy.tp_size``): the model's own plan
applied over the tensor-parallel dimension of the mesh, before FSDP2 shards over the rest.

The plan (``model.tensor_parallel_plan(tp_size)``, see ``convoy.models.tensor_parallel``)
splits some modules' matrices. Every other parameter is whole on each rank of the group, and
becomes a replicated ``DTensor`` on the same mesh, as TorchTitan makes every parameter one:
FSDP2 then shards all of them over one 2-D mesh, and gradient clipping and the optimizer's
foreach kernels see a single mesh (they refuse to mix meshes). Their modules still compute on
plain tensors: a forward pre-hook hands each module the local copy of its replicated
parameters (``to_local``, whose backward takes the gradient as the replicated gradient it is:
every rank of the group computed the same one).
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from convoy.errors import ConfigError

PLAN_METHOD = "tensor_parallel_plan"


class ReplicateParallel(ParallelStyle):
    """A module left whole on every rank of the group (a norm between split layers): its
    parameters become replicated ``DTensor``s and it computes on ``DTensor`` views of its
    inputs, returning plain tensors, as TorchTitan's ``NoParallel`` does. Conversions only, no
    side effects: it traces under ``torch.compile`` inside a checkpointed block, where the
    pre-hook that ``replicate_the_rest`` installs does not."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _replicated_inputs, _local_outputs)


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def model_plan(model: nn.Module, tp_size: int) -> dict[str, Any]:
    """``model``'s tensor-parallel plan for ``tp_size`` ranks, checked against its modules;
    a ``ConfigError`` on ``strategy.tp_size`` where it has none or the sizes do not split."""
    method = getattr(model, PLAN_METHOD, None)
    name = type(model).__name__
    if not callable(method):
        raise ConfigError(
            "strategy.tp_size",
            tp_size,
            f"{name} states no tensor-parallel plan; give it a method {PLAN_METHOD}(self, "
            "tp_size) returning {module path: ColwiseParallel() or RowwiseParallel()} as "
            "torch.distributed.tensor.parallel.parallelize_module takes it, or set "
            "strategy.tp_size=1",
        )
    try:
        plan = dict(method(tp_size))
    except ValueError as exc:
        raise ConfigError("strategy.tp_size", tp_size, f"{name}: {exc}") from None
    check_plan(model, plan, tp_size)
    return plan


def check_plan(model: nn.Module, plan: dict[str, Any], tp_size: int) -> None:
    """Every planned path names a module, and every linear it splits splits evenly."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for pattern, style in plan.items():
        matched = list(planned_modules(model, pattern).values())
        if not matched:
            raise ConfigError(
                "strategy.tp_size",
                tp_size,
                f"{type(model).__name__}'s tensor-parallel plan names {pattern!r}, which is "
                "no module of the model",
            )
        for module in matched:
            if not isinstance(module, nn.Linear):
                continue
            split = {ColwiseParallel: "out_features", RowwiseParallel: "in_features"}
            field = next((f for kind, f in split.items() if type(style) is kind), None)
            size = getattr(module, field) if field else 0
            if size % tp_size:
                raise ConfigError(
                    "strategy.tp_size",
                    tp_size,
                    f"must divide {pattern}'s {field} ({size}), which the plan splits",
                )


def planned_modules(model: nn.Module, pattern: str) -> dict[str, nn.Module]:
    """The modules a plan's path names, by path: ``*`` matches one path component, as in
    ``parallelize_module``."""
    parts = pattern.split(".")
    return {
        path: module
        for path, module in model.named_modules()
        if path
        and len(path.split(".")) == len(parts)
        and all(map(fnmatch.fnmatchcase, path.split("."), parts))
    }


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` by its plan over ``mesh`` (the tensor-parallel dimension) and make its
    other parameters replicated ``DTensor``s there; in place."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, model_plan(model, mesh.size()))
    replicate_the_rest(model, mesh)
    return model


def replicate_the_rest(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter the plan left as a plain tensor becomes a replicated ``DTensor`` on
    ``mesh`` (tied parameters stay one), and its module computes on the local copy."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        names = tuple(
            name
            for name, param in module._parameters.items()
            if param is not None and not isinstance(param, DTensor)
        )
        for name in names:
            param = module._parameters[name]
            assert param is not None
            if id(param) not in made:
                replicated = distribute_tensor(param.data, mesh, [Replicate()])
                made[id(param)] = nn.Parameter(replicated, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
        if names:
            local = _LocalParameters(names)
            module.register_forward_pre_hook(local.enter)
            module.register_forward_hook(local.leave)


class _LocalParameters:
    """Shows a module the local tensors of its replicated parameters during its forward.

    An instance attribute shadows the module's registered parameter (``nn.Module`` looks in
    ``_parameters`` only when normal lookup fails); the forward hook removes it. FSDP2's own
    pre-forward hook runs first (it is prepended), so the parameter seen is the unsharded one.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def enter(self, module: nn.Module, args: Any) -> None:
        for name in self.names:
            param = module._parameters[name]
            assert isinstance(param, DTensor)
            module.__dict__[name] = param.to_local()

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        for name in self.names:
            module.__dict__.pop(name, None)
