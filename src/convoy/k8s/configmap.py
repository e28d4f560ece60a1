"""The recipe ConfigMap: its name, its size, and the recipe it carries, loaded as
``convoy train`` in the pod will load it (``recipe_job``).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import yaml

from convoy.config import Job, job_from_dict
from convoy.errors import ConfigError
from convoy.k8s import naming


def configmap_problems(obj: dict[str, Any]) -> list[str]:
    problems = []
    name = obj.get("metadata", {}).get("name", "")
    if not naming.is_dns1123_subdomain(name):
        problems.append(f"metadata.name: got {name!r}; a DNS-1123 name")
    data = obj.get("data") or {}
    size = sum(len(str(v).encode()) for v in data.values())
    if size > 1_048_576:
        problems.append(f"data: {size} bytes; a ConfigMap holds at most 1 MiB")
    key = PurePosixPath(RECIPE_PATH).name
    if key in data:
        try:
            recipe_job(str(data[key]))
        except ConfigError as exc:
            problems.append(f"ConfigMap/{name} data.{key}: {exc}")
    return problems


RECIPE_PATH = "/etc/convoy/recipe.yaml"  # convoy.k8s.render.RECIPE_PATH


def recipe_job(text: str) -> Job:
    """The recipe a ConfigMap carries, loaded as ``convoy train`` in the pod will load it."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("recipe", "...", f"not valid YAML ({_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError("recipe", data, "the top level must be a mapping of sections")
    return job_from_dict(data)


def _first_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
