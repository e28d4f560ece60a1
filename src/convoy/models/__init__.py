"""Models: a registry by name, plus user factories given as ``package.module:function``."""

from convoy.models.registry import MODELS, build_model, count_parameters

__all__ = ["MODELS", "build_model", "count_parameters"]
