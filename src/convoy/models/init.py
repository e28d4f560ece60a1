"""Initial weights that do not depend on the layout: build on meta, shard, then fill.

A model whose class defines ``init_module(module)`` is built with every parameter on the meta
device (no memory) and its buffers real (rotary tables and running statistics are computed
in ``__init__`` as usual). The strategy applies its layout to that skeleton (tensor
parallelism, FSDP units, the root), materializes only what the rank holds
(``materialize``), and ``fill`` writes each parameter's values into it.

The values are made on the CPU one init unit at a time (a block, or the rest of the model),
from an untouched meta copy of the model: the unit is made whole, and each of its modules,
children first, gets ``reset_parameters()`` (torch's default, where it has one) and then the
model's ``init_module(module)``, from a generator seeded by the run's seed and the module's
qualified name. Each rank copies out its slice of each parameter (its DTensor placements
decide which). So:

- the values do not depend on the layout: ``single``, ``ddp``, ``fsdp2`` x 4, ``hsdp`` 2x2 and
  ``fsdp2 + tp 2`` start from the same full state, bit for bit, without a seed checkpoint
  and without DTensor's random ops (which differ by layout and do not run on a CPU mesh);
- no rank of a sharded strategy holds more than its shards plus one unit whole;
- the seeds are names, not an order, so wrapping blocks (activation checkpointing, compile)
  changes nothing.

A model without ``init_module`` (a user's factory whose ``__init__`` initializes or loads its
weights, an ``hf`` model read from a folder) is built for real as before: Convoy cannot know
what its ``__init__`` wrote. Under a sharded strategy every rank then holds it whole before
sharding, and the engine says so.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from convoy.errors import ConfigError
from convoy.models.hf_weights import FolderWeights, is_dtensor, local_region

InitModule = Callable[[nn.Module], None]


def builds_on_meta(model: nn.Module) -> bool:
    """Whether ``model`` says how each module is initialized (``init_module``), so Convoy can
    build it on the meta device and fill it after sharding."""
    return callable(getattr(model, "init_module", None))


def mark(module: nn.Module, **attributes: object) -> None:
    """Set plain attributes on ``module`` that its model's ``init_module`` reads (a role, a
    standard deviation): they travel with the module, into the copies Convoy initializes."""
    vars(module).update(attributes)


@torch.no_grad()
def init_in_place(model: nn.Module) -> None:
    """Apply ``model.init_module`` to each of its modules where they are (the model's own
    ``__init__``, built outside Convoy's engine; nothing happens to meta parameters)."""
    init_module: InitModule = getattr(model, "init_module")  # noqa: B009 (typed as a tensor)
    for module in model.modules():
        init_module(module)


_META_BUILDS = [0]


def building_on_meta() -> bool:
    """Whether a ``parameters_on_meta`` build is under way: a factory that would read weights
    (``hf`` from a folder) leaves them for ``InitialWeights`` to read by slice."""
    return _META_BUILDS[0] > 0


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers goes to the meta device (it is allocated
    for an instant, one at a time); buffers, and any other tensor ``__init__`` makes, stay
    real. ``__init__``'s own initialization of parameters is then a no-op."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign, assignment]
    _META_BUILDS[0] += 1
    try:
        with _SkipInPlaceOnMeta():
            yield
    finally:
        _META_BUILDS[0] -= 1
        nn.Module.register_parameter = register  # type: ignore[method-assign]


class _SkipInPlaceOnMeta(TorchFunctionMode):
    """In-place ops on meta tensors (``__init__``'s ``normal_``, ``uniform_``, ``zero_`` on
    its meta parameters) return at once: they would change nothing, and their meta kernels
    are torch's reference implementations, whose first call imports sympy and Dynamo (about
    1.5 CPU-s a process, issue 40's cost)."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        # A tensor method's self, or an nn.init function's ``tensor`` (passed by keyword).
        first = args[0] if args else (kwargs or {}).get("tensor")
        in_place = name.endswith("_") and not name.startswith("_")
        if in_place and isinstance(first, torch.Tensor) and first.is_meta:
            return first
        return func(*args, **(kwargs or {}))


def module_seed(seed: int, name: str) -> int:
    """A module's own seed: the run's seed and its qualified name, hashed (stable across
    processes and Python versions, unlike ``hash``). A layer wrapped by LoRA
    (``<name>.base_layer``) keeps the seed of ``<name>``: the base is the same with adapters."""
    name = name.replace(".base_layer", "")
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class InitialWeights:
    """The initial weights of a model built on meta (``parameters_on_meta``), made one init
    unit at a time from ``seed``; see the module docstring.

    An init unit is a subtree made whole on the CPU at once: each of the model's ``blocks``
    (its FSDP units), and the rest of the model. Inside a unit, modules are initialized
    children first (as ``transformers`` does), so a module's ``init_module`` may also set its
    children's parameters (GPT-2's scaled ``c_proj``), and the unit's values still do not
    depend on the layout. A model whose ``init_module`` sets only a module's own parameters
    says so with ``init_unit = "module"`` (Convoy's built-ins): each module is then a unit of
    its own, and set-up holds at most one module's parameters whole beside the shards."""

    def __init__(self, model: nn.Module, seed: int) -> None:
        init_module = getattr(model, "init_module", None)
        assert callable(init_module), "built on meta only where the model has init_module"
        self.init_module: InitModule = init_module
        self.seed = seed
        self.folder: FolderWeights | None = getattr(model, "weights_folder", None)
        """Trained weights to read in (``hf`` from a folder); the init fills what it lacks."""
        self.model_name = type(model).__name__
        # A meta copy (buffers copied: small) keeps the untouched layout the values are made
        # in; the strategy is free to change the model's (DTensors, wrappers).
        pristine = copy.deepcopy(model)
        pairs = list(zip(model.named_modules(), pristine.modules(), strict=True))
        self.names = {id(twin): name for (name, _), twin in pairs}
        self.twin_of = {id(module): twin for (_, module), twin in pairs}
        self.unit_of = _units(pristine)
        self.filled: set[int] = set()
        self.materialized: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self._cached: tuple[int, dict[int, dict[str, torch.Tensor]]] | None = None

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        """Give every meta parameter and buffer of ``model`` (as the strategy has laid it
        out: local shards of DTensors) real, unset memory on ``device``; buffers keep the
        values ``__init__`` gave them."""
        _to_empty(model, device, recurse=True, memo=self.materialized)

    def fill(self, model: nn.Module) -> None:
        """Write every parameter's initial values into ``model``'s (this rank's part), one
        init unit after another (each made once)."""
        by_unit: dict[int, list[nn.Module]] = {}
        for module in model.modules():
            twin = self.twin_of.get(id(module))
            if twin is not None:
                by_unit.setdefault(id(self.unit_of[id(twin)]), []).append(module)
        for modules in by_unit.values():
            for module in modules:
                self.fill_module(module)
        self._cached = None
        release_freed_memory()

    def materialize_and_fill(self, module: nn.Module, device: torch.device) -> None:
        """One module's own tensors, materialized on ``device`` and filled: FSDP1's
        ``param_init_fn``, which it calls on each module before flattening it."""
        _to_empty(module, device, recurse=False, memo=self.materialized)
        self.fill_module(module)

    @torch.no_grad()
    def fill_module(self, module: nn.Module) -> None:
        """Fill ``module``'s own parameters and buffers (wrappers that hold no tensors of
        their own, such as DDP or a checkpoint wrapper, have nothing to fill)."""
        twin = self.twin_of.get(id(module))
        todo = {
            k: p
            for k, p in module._parameters.items()
            if p is not None and id(p) not in self.filled
        }
        if twin is None or not (todo or any(b is not None for b in module._buffers.values())):
            return
        name = self.names[id(twin)]
        values: dict[str, torch.Tensor] | None = None
        for key, param in todo.items():
            qualified = f"{name}.{key}" if name else key
            if self.folder is not None and self.folder.stored_name(qualified) is not None:
                self.folder.load_into(qualified, param)
            else:
                if values is None:
                    values = self._unit_values(self.unit_of[id(twin)])[id(twin)]
                _copy_into(param, values[key])
            self.filled.add(id(param))
        if self.folder is not None:
            return  # buffers keep what __init__ computed (rotary tables)
        values = values or self._unit_values(self.unit_of[id(twin)])[id(twin)]
        for key, buffer in module._buffers.items():
            if buffer is not None and key in values:
                _copy_into(buffer, values[key])

    def _unit_values(self, unit: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
        """Every module's full initial tensors in ``unit``, by its twin's id; the last unit's
        are kept, as its modules are filled one after another."""
        if self._cached is not None and self._cached[0] == id(unit):
            return self._cached[1]
        if self._cached is not None:
            self._cached = None  # the last unit's memory goes before this one's comes
            release_freed_memory()
        values = self._make_unit(unit)
        self._cached = (id(unit), values)
        return values

    def _make_unit(self, unit: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
        """``unit`` made whole on the CPU and initialized, children first, each module from
        its own seed; then its tensors, and the unit back to meta."""
        members = [m for m in _post_order(unit) if self.unit_of.get(id(m)) is unit]
        for module in members:
            for key, param in module._parameters.items():
                if param is not None and param.is_meta:
                    module._parameters[key] = nn.Parameter(_unset(param), param.requires_grad)
        for module in members:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(module_seed(self.seed, self.names[id(module)]))
                reset = getattr(module, "reset_parameters", None)
                # torch's convention: reset_parameters sets the module's own parameters
                if callable(reset) and any(p is not None for p in module._parameters.values()):
                    reset()
                self.init_module(module)
        values = {id(m): self._tensors_of(m) for m in members}
        for module in members:
            for key, param in module._parameters.items():
                if param is not None:
                    module._parameters[key] = nn.Parameter(
                        param.detach().to("meta"), param.requires_grad
                    )
        return values

    def _tensors_of(self, module: nn.Module) -> dict[str, torch.Tensor]:
        tensors = {k: p.detach() for k, p in module._parameters.items() if p is not None}
        for key, value in tensors.items():
            if value.is_floating_point() and value.isnan().any():
                name = self.names[id(module)]
                raise ConfigError(
                    "model.name",
                    self.model_name,
                    f"parameter {name + '.' if name else ''}{key!r} is set neither by its "
                    f"module's reset_parameters() nor by {self.model_name}.init_module(): "
                    "initialize it there",
                )
        buffers = {k: b.detach() for k, b in module._buffers.items() if b is not None}
        return {**tensors, **buffers}


def _units(model: nn.Module) -> dict[int, nn.Module]:
    """Each module's init unit (by id): itself, where the model's ``init_unit`` is
    ``"module"`` (its ``init_module`` sets a module's own parameters only); otherwise the
    block it is in, or the model for the rest."""
    if getattr(model, "init_unit", "block") == "module":
        return {id(m): m for m in model.modules()}
    unit_of = {id(m): model for m in model.modules()}
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        for block in blocks:
            for module in block.modules():
                unit_of[id(module)] = block
    return unit_of


def _post_order(module: nn.Module) -> list[nn.Module]:
    """``module``'s subtree, children before their parent (each module once)."""
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        order.append(m)

    visit(module)
    return order


def _to_empty(
    module: nn.Module,
    device: torch.device,
    recurse: bool,
    memo: dict[int, tuple[nn.Parameter, nn.Parameter]],
) -> None:
    """``module.to_empty``, keeping the values of buffers that are real already and the ties
    between parameters (``to_empty`` makes a new tensor per module that holds one: a tied
    head would come apart from its embedding). ``memo`` maps each parameter already
    materialized (by id; the old one kept, so its id is not reused) to its new one, across
    calls: FSDP1 materializes module by module."""
    modules = list(module.modules()) if recurse else [module]
    saved = {
        (id(m), key): buffer
        for m in modules
        for key, buffer in m._buffers.items()
        if buffer is not None and not buffer.is_meta
    }
    old = {(id(m), key): p for m in modules for key, p in m._parameters.items() if p is not None}
    # module.to_empty, without its empty_like: on a meta tensor that is torch's reference
    # kernel, whose first call imports sympy (1 CPU-s a process).
    module._apply(lambda t: _empty_like(t, device), recurse=recurse)
    for m in modules:
        for key in list(m._parameters):
            before = old.get((id(m), key))
            if before is None:
                continue
            if id(before) in memo:
                m._parameters[key] = memo[id(before)][1]  # tied to one made before
            else:
                memo[id(before)] = (before, m._parameters[key])  # type: ignore[assignment]
        for key, buffer in m._buffers.items():
            value = saved.get((id(m), key))
            if buffer is not None and value is not None:
                buffer.copy_(value)


def release_freed_memory() -> None:
    """Hand the memory freed since the last call back to the system (glibc's
    ``malloc_trim``): a unit's full tensors, made and dropped one after another in sizes the
    allocator keeps on its heap, would otherwise stay resident beside the shards (measured:
    0.6-1.1 GiB a rank of gpt_1b under fsdp2 x 4). Nothing happens off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Unset memory of ``tensor``'s shape and dtype on ``device``; for a DTensor, its local
    part, in the same layout."""
    if is_dtensor(tensor):
        from torch.distributed.tensor import DTensor

        assert isinstance(tensor, DTensor)
        local = torch.empty(tensor.to_local().shape, dtype=tensor.dtype, device=device)
        return DTensor.from_local(
            local,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def _unset(param: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``param``'s full shape and dtype, NaN where it can be: a value no init
    leaves behind, so a parameter nobody set is found."""
    if param.is_floating_point() or param.is_complex():
        return torch.full(param.shape, math.nan, dtype=param.dtype)
    return torch.zeros(param.shape, dtype=param.dtype)


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, on the CPU) into ``target``: all of it, or the part
    a DTensor holds on this rank (its placements say which: shards, strided shards or
    replicas), without any communication."""
    if is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        assert isinstance(target, torch.distributed.tensor.DTensor)
        region = local_region(target)
        if region is not None:  # this rank's block of rows / columns: a view, no copy
            target.to_local().copy_(full[region])
            return
        mesh = target.device_mesh
        part = distribute_tensor(
            full.to(device=mesh.device_type, dtype=target.dtype),
            mesh,
            target.placements,
            src_data_rank=None,
        )
        target.to_local().copy_(part.to_local())
        return
    target.copy_(full.to(dtype=target.dtype))
