"""Tasks: ``task.name`` -> what a batch is, the loss and the metrics.

Built-ins: ``classification``, ``language_modeling``, ``regression``; the user's own by import
path ``package.module:Class`` (a ``convoy.tasks.Task`` subclass), built with ``task.kwargs``.
"""

from __future__ import annotations

import difflib
from typing import Any

from convoy.errors import ConfigError, one_of
from convoy.imports import import_attribute
from convoy.tasks.base import Task
from convoy.tasks.classification import Classification
from convoy.tasks.language_modeling import LanguageModeling
from convoy.tasks.regression import Regression

TASKS: dict[str, type[Task]] = {
    "classification": Classification,
    "language_modeling": LanguageModeling,
    "regression": Regression,
}


def resolve_task(name: str) -> type[Task]:
    """A built-in task class, or the ``Task`` subclass at ``package.module:Class``."""
    if name in TASKS:
        return TASKS[name]
    if ":" not in name:
        guess = difflib.get_close_matches(name, TASKS, n=1, cutoff=0.6)
        hint = f"did you mean {guess[0]!r}? " if guess else ""
        raise ConfigError(
            "task.name", name, f"{hint}{one_of(TASKS)}, or a class 'package.module:Class'"
        )
    found = import_attribute("task.name", name, "a task class is 'package.module:Class'")
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ConfigError(
            "task.name", name, "the import path must name a subclass of convoy.tasks.Task"
        )
    return found


def build_task(name: str, kwargs: dict[str, Any]) -> Task:
    """Instantiate the task ``name`` with ``kwargs``; a constructor error names the field."""
    cls = resolve_task(name)
    try:
        return cls(**kwargs)
    except Exception as exc:  # the user's constructor: any failure is a config problem
        raise ConfigError(
            "task.kwargs", kwargs, f"{name} rejected them: {type(exc).__name__}: {exc}"
        ) from None


__all__ = ["TASKS", "Classification", "LanguageModeling", "Regression", "Task", "build_task"]
