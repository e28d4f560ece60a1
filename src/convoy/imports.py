"""The user's own code by import path: ``package.module:attribute`` for models, data and
tasks, with one-line errors that name the config field."""

from __future__ import annotations

import importlib
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
