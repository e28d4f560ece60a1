"""Torch's Dynamo guards that import Dynamo before anything is compiled.

torch wraps some functions with ``torch._disable_dynamo`` so that Dynamo never traces them;
the wrapper imports ``torch._dynamo`` (and sympy with it: 1.5-2 CPU-s) on its first call,
whether or not anything is ever compiled. While Dynamo is not imported nothing can be
compiling, so calling the function itself is what the guard would do. ``defer_guard`` makes a
wrapper do that until Dynamo is imported (by a compile, or by DDP and FSDP2, whose
constructors import it), and then take the real guard, as torch would have.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

DYNAMO = "torch._dynamo"
_GUARD_CODE = torch._disable_dynamo(lambda: None).__code__
"""The code of torch's wrapper: a function is only deferred when it is exactly that wrapper
(another torch release may guard otherwise; then nothing changes here)."""


def defer_guard(wrapper: Callable[..., Any]) -> None:
    """Have ``torch._disable_dynamo``'s ``wrapper`` call its function directly while Dynamo
    is not imported, and take the real guard once it is."""
    if DYNAMO in sys.modules or getattr(wrapper, "__code__", None) is not _GUARD_CODE:
        return
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or (), strict=True))
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

    setattr(fn, cache, guarded_once_dynamo_is_loaded)
