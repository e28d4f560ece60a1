"""Imports that can fail: the user's own code by import path (``package.module:attribute``
for models, data and tasks, with one-line errors that name the config field), and the optional
packages of Convoy's extras (``missing_extra``: the one line that says how to install one).

``make run`` installs the core and the ``ray`` extra only; every other extra (``plot``,
``tracking``, ``text``, ``sensors``, ``k8s``, ``lightning``, ``tune``) is installed by
``make dev`` / ``make test`` or by hand, so each feature that needs one checks for it before
any worker starts and says the exact install line.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from convoy.errors import ConfigError


def describe(exc: BaseException) -> str:
    """An exception as ``Type: message`` on one line."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def import_attribute(field: str, path: str, form: str) -> Any:
    """The attribute ``path`` names (``package.module:attribute``), imported; a
    ``ConfigError`` on ``field`` when the form is wrong, the module does not import (its own
    error shown) or has no such attribute. ``form`` says what the field expects."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(field, path, form)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raises while importing
        raise ConfigError(field, path, f"could not import {module_name}: {describe(exc)}") from None
    if not hasattr(module, attr):
        raise ConfigError(field, path, f"module {module_name} has no attribute {attr!r}")
    return getattr(module, attr)


CHECKOUT_TARGETS = {
    "ray": "make run",
    # Not in `make dev`: its Triton dependency is large and runs on CUDA only.
    "fused": ".venv/bin/pip install -c constraints.txt -e '.[fused]'",
}
"""The command that installs an extra into a checkout's ``.venv`` (any other: make dev)."""


def missing_extra(what: str, package: str, extra: str) -> str:
    """The one line that says ``what`` needs ``package``, which is not installed, and the exact
    command that installs the extra that brings it, e.g. ``convoy report needs matplotlib (the
    'plot' extra): pip install 'convoy[plot]' (in a checkout: make dev)``."""
    target = CHECKOUT_TARGETS.get(extra, "make dev")
    return (
        f"{what} needs {package} (the {extra!r} extra): "
        f"pip install 'convoy[{extra}]' (in a checkout: {target})"
    )


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it. A module set to
    ``None`` in ``sys.modules`` (how tests simulate a missing package) counts as missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package; a module without a spec
        return False
