"""Sizes and lists on ``convoy plan``'s command line: parsing them, and printing bytes."""

from __future__ import annotations

import re

from convoy.errors import ConfigError, one_of
from convoy.plan.job import strategy_order

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
MEMORY_FORMS = "a size such as 80GiB, 80GB, 24G, 81920MiB or plain bytes"


def parse_memory(text: str, flag: str = "--gpu-memory") -> int:
    """Bytes in ``text``: ``80GiB`` (binary), ``80GB`` / ``80G`` (decimal, as GPU vendors
    print them), ``81920MiB``, or a plain byte count. Raises ``ConfigError`` naming ``flag``."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(flag, text, f"allowed: {MEMORY_FORMS}")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise ConfigError(flag, text, f"must be more than 0 bytes; allowed: {MEMORY_FORMS}")
    return int(value)


def format_bytes(value: float) -> str:
    """``1536`` -> ``1.5 KiB``; binary units, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return (
                f"{value / size:.3g} {unit}"
                if value / size < 1000
                else f"{value / size:.0f} {unit}"
            )
    return f"{value:.0f} B"


def parse_world_sizes(text: str, flag: str = "--world-sizes") -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]``; each a positive integer."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size <= 0 for size in sizes):
        raise ConfigError(flag, text, "allowed: positive integers, e.g. 1,2,4,8")
    return sorted(set(sizes))


def parse_strategies(text: str) -> list[str]:
    """``"fsdp2,single"`` -> ``["single", "fsdp2"]``: Convoy strategy names, in the planner's
    order (``strategy_order``)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = strategy_order()
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        shown = unknown[0] if unknown else text
        raise ConfigError("--strategies", shown, one_of(known))
    return [name for name in known if name in names]
