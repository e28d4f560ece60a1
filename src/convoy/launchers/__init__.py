"""Launchers: ``scaling.launcher`` -> where the workers run (local, torchrun, ray).

The registry follows the one list of launchers, the section classes in
``convoy.config.scaling`` (``LAUNCHER_MODELS``): launcher ``x`` is the ``Launcher`` subclass
named ``x`` in ``convoy/launchers/x.py``, and its ``config_model`` is that section, which
carries the facts the schema and the rest of Convoy ask of it. A launcher's module is imported
only when it is chosen: Ray's takes a while, and the other launchers work without Ray.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from convoy.config import LAUNCHER_NAMES
from convoy.errors import ConfigError, one_of

if TYPE_CHECKING:
    from convoy.launchers.base import Launcher, RunResult


def launcher_class(name: str, field: str = "scaling.launcher") -> type[Launcher]:
    """The class of launcher ``name``; a ``ConfigError`` naming ``field`` and the valid names
    for an unknown one."""
    if name not in LAUNCHER_NAMES:
        raise ConfigError(field, name, one_of(LAUNCHER_NAMES))
    return _class_in_module(name)


def get_launcher(name: str) -> Launcher:
    """The launcher for ``name``; its module is imported only when chosen."""
    return launcher_class(name)()


@functools.cache
def _class_in_module(name: str) -> type[Launcher]:
    from convoy.launchers.base import Launcher

    module = importlib.import_module(f"{__name__}.{name}")
    for value in vars(module).values():
        # The base class names no launcher (``name`` is set by each subclass).
        is_launcher = isinstance(value, type) and issubclass(value, Launcher)
        if is_launcher and getattr(value, "name", None) == name:
            return value
    raise ImportError(f"{module.__name__} defines no Launcher subclass with name = {name!r}")


def __getattr__(name: str) -> Any:
    # ``Launcher`` and ``RunResult`` load with ``base`` (torch) on first use, so a process
    # that imports one launcher helper (Ray Train's controller) does not import torch.
    if name in ("Launcher", "RunResult"):
        from convoy.launchers import base

        return getattr(base, name)
    raise AttributeError(f"module 'convoy.launchers' has no attribute {name!r}")


__all__ = ["LAUNCHER_NAMES", "Launcher", "RunResult", "get_launcher", "launcher_class"]
