"""The base of every config section: frozen, unknown keys forbidden."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every config section: frozen, unknown keys forbidden."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())
