"""Launchers: ``scaling.launcher`` -> where the workers run (local, torchrun, ray)."""

from __future__ import annotations

from convoy.errors import ConfigError, one_of
from convoy.launchers.base import Launcher, RunResult

LAUNCHER_NAMES = ("local", "torchrun", "ray")


def get_launcher(name: str) -> Launcher:
    """The launcher for ``name``; its module is imported only when chosen."""
    if name == "local":
        from convoy.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "torchrun":
        from convoy.launchers.torchrun import TorchrunLauncher

        return TorchrunLauncher()
    if name == "ray":
        from convoy.launchers.ray import RayLauncher

        return RayLauncher()
    raise ConfigError("scaling.launcher", name, one_of(LAUNCHER_NAMES))


__all__ = ["LAUNCHER_NAMES", "Launcher", "RunResult", "get_launcher"]
