"""Torch's Dynamo guards that import Dynamo before anything is compiled.

torch wraps some functions with ``torch._disable_dynamo`` so that Dynamo never traces them;
the wrapper imports ``torch._dynamo`` (and sympy with it: 1.5-2 CPU-s) on its first call,
whether or not anything is ever compiled. While Dynamo is not imported nothing can be
compiling, so calling the function itself is what the guard would do. ``defer_guard`` makes a
wrapper do that until Dynamo is imported (by a compile, say); its first call after that takes
the real guard, as torch's wrapper does on its own first call.

DDP imports Dynamo too: its constructor to read one Dynamo setting, its forward through such
a guard; and DCP's state-dict functions, to ask whether a module is a compiled one.
``dynamo_stand_in`` answers those while Dynamo is not imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

DYNAMO = "torch._dynamo"
_GUARD_CODE = torch._disable_dynamo(lambda: None).__code__
"""The code of torch's wrapper: a function is only deferred when it is exactly that wrapper
(another torch release may guard otherwise; then nothing changes here)."""


def defer_guard(wrapper: Callable[..., Any] | None) -> None:
    """Have ``torch._disable_dynamo``'s ``wrapper`` call its function directly while Dynamo
    is not imported, and take the real guard once it is."""
    code = getattr(wrapper, "__code__", None)
    if wrapper is None or DYNAMO in sys.modules or code is not _GUARD_CODE:
        return
    cells = dict(zip(code.co_freevars, wrapper.__closure__ or (), strict=True))
    fn, recursive = cells["fn"].cell_contents, cells["recursive"].cell_contents
    cache = "__dynamo_disable"  # where the wrapper keeps its guard (torch/_compile.py)
    if getattr(fn, cache, None) is not None:
        return

    def guarded_once_dynamo_is_loaded(*args: Any, **kwargs: Any) -> Any:
        if DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        guard = torch._dynamo.disable(fn, recursive, wrapping=False)
        setattr(fn, cache, guard)
        return guard(*args, **kwargs)

    _skipped_by_dynamo(guarded_once_dynamo_is_loaded.__code__)
    setattr(fn, cache, guarded_once_dynamo_is_loaded)


@functools.cache
def defer_meta_guards() -> None:
    """Defer (``defer_guard``) the guards of torch's Python references and meta kernels
    (``torch._refs``, ``torch._meta_registrations``). A model built or run on the meta device,
    as the driver's preflight and the FLOP count do, runs through them (``nn.init.normal_`` on
    meta is ``torch._refs.normal``), and their guards would import Dynamo, about 1.5 CPU-s with
    sympy, for a job that never compiles. About 120 wrappers, 5 ms, walked once a process (a
    local run's preflight and FLOP count share it; once Dynamo is imported there is nothing to
    defer, then or later)."""
    import torch._meta_registrations
    import torch._refs
    import torch._refs.nn.functional  # torch imports the three itself

    for module in (torch._refs, torch._refs.nn.functional, torch._meta_registrations):
        for value in list(vars(module).values()):
            # A reference's decorators each wrap the next (``__wrapped__``); the guard is one.
            for _ in range(8):
                if not callable(value):
                    break
                defer_guard(value)
                value = getattr(value, "__wrapped__", None)


def _skipped_by_dynamo(code: types.CodeType) -> None:
    """Have Dynamo run ``code``'s frames without tracing them, as it does torch's own wrapper
    (torch's files are skipped; this one is not). Else a compile whose graph reaches a
    deferred guard (a DDP model compiled after it was built) would trace this frame: the same
    results, with more graph breaks. torch's C API, which imports no Dynamo; with a torch
    release that lacks it the frame is traced, as said."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:
        return
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


class _ModuleUntilUsed:
    """Stands in for an unimported module: answers the attributes it is given, and imports the
    real module for any other (so a torch release that asks more gets the real answer)."""

    def __init__(self, name: str, **answers: Any) -> None:
        self._name = name
        self.__dict__.update(answers)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)


class _NoOptimizedModule:
    """What ``torch.compile`` returns for a module is an ``OptimizedModule``, a class of
    Dynamo's: while Dynamo is not imported, no module is one. This class has no instances."""


_DYNAMO_UNLOADED = _ModuleUntilUsed(
    DYNAMO,
    # Dynamo's default (``config.optimize_ddp = True``): the setting can only be changed
    # through ``torch._dynamo.config``, which imports Dynamo, and then it is not answered here.
    utils=_ModuleUntilUsed(f"{DYNAMO}.utils", get_optimize_ddp_mode=lambda: "ddp_optimizer"),
    eval_frame=_ModuleUntilUsed(f"{DYNAMO}.eval_frame", OptimizedModule=_NoOptimizedModule),
)


@contextlib.contextmanager
def dynamo_stand_in() -> Iterator[None]:
    """While Dynamo is not imported, ``torch._dynamo`` answers what torch asks of it without
    importing it (0.6 CPU-s in each worker beyond what DCP's DTensor imports; 1.5 in a process
    without DCP), for code that asks what only a compile could change:

    - DDP's constructor (torch 2.13) reads ``utils.get_optimize_ddp_mode()``, which only
      matters to a compiled model: nothing has compiled or changed that setting, so its default
      is the answer. DDP's forward guard (``_inside_ddp_forward``) is deferred as
      ``defer_guard`` says.
    - DCP's ``get_state_dict`` / ``set_state_dict`` ask, for each state-dict key, of the
      modules on its path (other than DDP and FSDP) whether one is an
      ``eval_frame.OptimizedModule``: none is.

    Anything else asked of ``torch._dynamo`` meanwhile imports it, as before, and the real
    module takes the stand-in's place on ``torch``. A reference taken inside the window
    (``from torch import _dynamo``, or ``torch._dynamo.utils`` kept in a variable) stays the
    stand-in: no torch code does that, only a user's hook run inside the window could. With
    Dynamo imported, nothing changes."""
    if DYNAMO in sys.modules:
        yield
        return
    inside_forward = vars(DistributedDataParallel).get("_inside_ddp_forward")
    defer_guard(getattr(inside_forward, "__wrapped__", None))  # under its @contextmanager
    setattr(torch, "_dynamo", _DYNAMO_UNLOADED)  # noqa: B010 (torch's lazy attribute)
    try:
        yield
    finally:
        # An import of the real module meanwhile has replaced the stand-in: keep that one.
        if torch.__dict__.get("_dynamo") is _DYNAMO_UNLOADED:
            delattr(torch, "_dynamo")
