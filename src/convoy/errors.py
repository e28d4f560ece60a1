"""Errors a user can act on.

Every error Convoy raises for bad input is a ``ConvoyError``: one paragraph that names the
field, the value it got and what is allowed. The CLI prints it without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConvoyError(Exception):
    """An error caused by the user's input or environment, printed without a traceback."""


class ConfigError(ConvoyError):
    """A config field holds a value Convoy cannot use."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}: got {value!r}; {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled with its own arguments: an error raised in a Ray worker reaches the driver
        # (the default reduce passes only the message, which __init__ cannot take).
        return type(self), (self.field, self.value, self.allowed)


class DataError(ConvoyError):
    """A dataset is missing, unreadable or malformed."""


class ResourceError(ConvoyError):
    """The requested workers can never be placed on the available resources."""


class LaunchError(ConvoyError):
    """A launcher's workers failed."""


def one_of(names: Iterable[str]) -> str:
    """Render an 'allowed values' clause: ``allowed: 'a', 'b', 'c'``."""
    return "allowed: " + ", ".join(repr(n) for n in sorted(names))
