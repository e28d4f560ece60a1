"""Loading: YAML recipe + dotted overrides -> ``Job``, with errors that name the field.

``load_job`` reads a recipe (``read_yaml``: YAML without YAML 1.1's base-60 numbers) and
applies ``-o key.path=value`` overrides (``parse_override``, ``apply_overrides``,
``set_field``); ``job_from_dict`` validates, turning pydantic's ``ValidationError`` into one
``ConfigError`` that names the field, the value and what is allowed; ``job_from_saved`` reads
back what Convoy wrote itself; ``job_to_yaml`` writes a resolved job out.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from convoy.config.job import Job
from convoy.config.strategy import STRATEGY_MODELS, STRATEGY_NAMES, SingleStrategyConfig
from convoy.config.training import TORCH_DEFAULTS, OptimConfig
from convoy.errors import ConfigError, one_of

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a key path and a YAML-parsed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError("-o", text, "overrides look like key.path=value, e.g. optim.lr=3e-4")
    raw = raw.strip()
    if ":" in raw and not raw.startswith(("{", "[")):
        return key.strip().split("."), raw  # YAML 1.1 would read 1:2 as the base-60 number 62
    value = yaml.safe_load(raw) if raw else ""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 3e-4 (no dot) as a string
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with every ``key.path=value`` override applied."""
    result = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        _set_in_place(result, path, value)
    return result


def set_field(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of the recipe dict ``data`` with the dotted field ``key`` set to ``value``."""
    result = _deep_copy(data)
    _set_in_place(result, key.split("."), value)
    return result


def _set_in_place(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(path[: i + 1]), child, "it is a value, not a section")
        node = child
    node[path[-1]] = value


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def job_from_dict(data: dict[str, Any]) -> Job:
    """Validate a plain dict into a ``Job``; pydantic errors become one ``ConfigError``."""
    try:
        return Job.model_validate(data)
    except ValidationError as exc:
        raise _to_config_error(exc, data) from None


def job_from_saved(data: dict[str, Any], overrides: list[str] | None = None) -> Job:
    """A job Convoy wrote itself (a checkpoint's ``meta.json``, an export's ``model.json``, a
    run's ``config.yaml``), validated, with ``overrides`` applied after.

    Every reader of a saved job goes through here, not ``job_from_dict``. Jobs saved before
    the optimizer fields followed ``TORCH_DEFAULTS`` hold ``weight_decay``, ``momentum`` and
    ``betas`` whatever ``optim.name`` is: ``momentum: 0.9`` under adamw, ``betas`` under sgd.
    The optimizer never read the field it does not have, so it is dropped here, and the run
    loads as it trained (its ``weight_decay`` was always written out). A recipe or an
    override that sets such a field is still refused (``OptimConfig``).
    """
    saved = _deep_copy(data)
    optim = saved.get("optim")
    if isinstance(optim, dict):
        own = TORCH_DEFAULTS.get(optim.get("name", OptimConfig.model_fields["name"].default))
        if own is not None:  # an unknown name is left for validation to name
            for key in {k for fields in TORCH_DEFAULTS.values() for k in fields} - own.keys():
                optim.pop(key, None)
    return job_from_dict(apply_overrides(saved, overrides or []))


class RecipeLoader(yaml.SafeLoader):
    """YAML without YAML 1.1's base-60 numbers: ``1:4`` is the text "1:4" (an elastic range),
    not the number 64."""


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if rx.pattern.find(":[0-5]?[0-9]") < 0]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern in (
    (
        "tag:yaml.org,2002:int",
        r"[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+",
    ),
    (
        "tag:yaml.org,2002:float",
        r"[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
    ),
):
    RecipeLoader.add_implicit_resolver(_tag, re.compile(f"^(?:{_pattern})$"), list("-+0123456789."))


def read_yaml(text: str) -> Any:
    """Parse recipe or config YAML (``RecipeLoader``)."""
    return yaml.load(text, Loader=RecipeLoader)


def load_job(path: str | Path | None = None, overrides: list[str] | None = None) -> Job:
    """Load a YAML recipe (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        recipe = Path(path)
        if not recipe.is_file():
            raise ConfigError("recipe", str(path), "expected a YAML file that exists")
        try:
            loaded = read_yaml(recipe.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError("recipe", str(path), f"not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError("recipe", str(path), "the top level must be a mapping of sections")
        data = loaded or {}
    return job_from_dict(apply_overrides(data, overrides or []))


def job_to_yaml(job: Job) -> str:
    """The resolved config as YAML (what ``convoy config show`` prints and runs save)."""
    return yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False)


def _to_config_error(exc: ValidationError, data: dict[str, Any]) -> ConfigError:
    """Turn pydantic's first error into one readable paragraph."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    raw_loc = [str(p) for p in err["loc"]]
    # pydantic puts the strategy's discriminator tag into the path: strategy.ddp.comm_hook.
    loc = [
        p
        for i, p in enumerate(raw_loc)
        if not (i and raw_loc[i - 1] == "strategy" and p in STRATEGY_NAMES)
    ]
    field = ".".join(loc) or "config"
    value = err.get("input")
    union = _union_members(errors)
    if union:  # the member's tag ends the path: run.compile.bool
        return ConfigError(".".join(loc[:-1]), value, "allowed: " + union)
    kind = err["type"]
    if kind == "extra_forbidden":
        parent_model = _section_model(loc[:-1], data)
        known = sorted(parent_model.model_fields) if parent_model else []
        guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.5)
        hint = f" (did you mean {guess[0]!r}?)" if guess else ""
        if loc[:1] == ["strategy"] and len(loc) == 2:
            owners = [name for name, m in STRATEGY_MODELS.items() if loc[1] in m.model_fields]
            if owners:  # another strategy's option, e.g. fsdp2's tp_size under ddp
                hint = f" for this strategy (an option of {' and '.join(map(repr, owners))})"
        return ConfigError(field, value, f"unknown key{hint}; {one_of(known)}")
    if kind == "union_tag_invalid":
        return ConfigError(field + ".name", err["ctx"]["tag"], one_of(STRATEGY_NAMES))
    if kind == "missing":
        return ConfigError(field, None, "this field is required")
    if kind == "value_error":  # our own validators: the message is the allowed clause
        return ConfigError(field, value, str(err["ctx"]["error"]))
    return ConfigError(field, value, err["msg"][0].lower() + err["msg"][1:])


def _union_members(errors: list[Any]) -> str | None:
    """What a field typed as a union (``run.compile: bool | Literal["blocks", "model"]``)
    accepts, from pydantic's one error per member (each with the member's tag last in its
    path): ``true, false, 'blocks' or 'model'``. None when the first error is not a union's."""
    first = errors[0]
    members = [e for e in errors if e["loc"][:-1] == first["loc"][:-1] and _is_member_tag(e)]
    if len(first["loc"]) < 2 or len(members) < 2 or not _is_member_tag(first):
        return None
    allowed: list[str] = []
    for member in members:
        if member["type"] == "literal_error":
            allowed += member["ctx"]["expected"].replace(" or ", ", ").split(", ")
        elif member["type"].startswith("bool"):
            allowed += ["true", "false"]
        else:  # "Input should be a valid integer, unable to ..." -> "a valid integer"
            allowed.append(member["msg"].removeprefix("Input should be ").split(",")[0])
    return ", ".join(allowed[:-1]) + " or " + allowed[-1]


# The last path element of a union member's error: a type's tag, never a field's name.
SCALAR_TAGS = frozenset({"bool", "int", "float", "str", "bytes", "none"})


def _is_member_tag(error: Any) -> bool:
    tag = str(error["loc"][-1])
    return tag in SCALAR_TAGS or "[" in tag


def _section_model(loc: list[str], data: dict[str, Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = Job
    node: Any = data
    for part in loc:
        node = node.get(part, {}) if isinstance(node, dict) else {}
        if part == "strategy":
            # The named strategy's section; single's (it has no options) for none or unknown.
            name = node.get("name") if isinstance(node, dict) else None
            model = STRATEGY_MODELS.get(str(name), SingleStrategyConfig)
            continue
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model
