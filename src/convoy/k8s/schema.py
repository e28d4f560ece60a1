"""A manifest against the KubeRay v1.7.0 CRDs shipped in ``crds/``: the schema made strict as
``kubectl --validate=strict`` is (``strict``), checked with ``jsonschema``
(``schema_problems``), and the CRD's CEL rules (``x-kubernetes-validations``) evaluated with
cel-python (``cel_problems``).

The ``jsonschema`` and ``cel-python`` packages are imported only when a manifest is checked.
"""

from __future__ import annotations

import difflib
import functools
from importlib import resources
from typing import Any

import yaml

from convoy.k8s import require

CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The strict JSON schema of ``kind``'s v1 version in the shipped CRD."""
    text = resources.files("convoy.k8s").joinpath("crds", CRD_FILES[kind]).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(text, Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """An OpenAPI v3 structural schema as the JSON schema an API server enforces, plus
    ``kubectl --validate=strict``: objects with declared properties refuse others unless
    ``x-kubernetes-preserve-unknown-fields``; ``x-kubernetes-int-or-string`` takes either."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def json_path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def schema_problems(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    jsonschema = require("jsonschema")
    validator = jsonschema.Draft7Validator(schema)
    problems = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path))):
        problems += _describe(error)
    return problems


def _describe(error: Any) -> list[str]:
    path = json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        known = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - set(known))
        lines = []
        for key in unknown:
            guess = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" (did you mean {guess[0]!r}?)" if guess else ""
            where = f"{path}.{key}" if error.absolute_path else key
            lines.append(f"{where}: unknown field{hint}; allowed: {', '.join(known)}")
        return lines
    if error.validator == "anyOf" and all(
        s.get("type") in {"integer", "string"} for s in error.validator_value
    ):
        return [
            f"{path}: got {error.instance!r}; expected an integer or a quantity string "
            "(e.g. 500m, 8Gi, 2)"
        ]
    if error.validator == "pattern" and "[numkMGTPE]" in str(error.validator_value):
        return [
            f"{path}: got {error.instance!r}; expected an integer or a quantity string "
            "(e.g. 500m, 8Gi, 2)"
        ]
    if error.validator == "enum":
        allowed = ", ".join(repr(v) for v in error.validator_value)
        return [f"{path}: got {error.instance!r}; allowed: {allowed}"]
    if error.validator == "required":
        return [f"{path}: {error.message}"]
    return [f"{path}: got {error.instance!r}; {error.message.split(' is ', 1)[-1]}"]


def cel_problems(obj: Any, schema: dict[str, Any], path: tuple[Any, ...] = ()) -> list[str]:
    """Evaluate the schema's CEL rules wherever the manifest has a value."""
    problems = []
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: only an update has an old object
        if not _cel_holds(rule["rule"], obj):
            message = rule.get("message") or f"must satisfy {rule['rule']}"
            problems.append(f"{json_path(path)}: {message}")
    if isinstance(obj, dict):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            child = properties.get(key, extra if isinstance(extra, dict) else None)
            if child:
                problems += cel_problems(value, child, (*path, key))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            problems += cel_problems(value, schema["items"], (*path, i))
    return problems


@functools.cache
def _cel_program(rule: str) -> Any:
    celpy = require("celpy")
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _cel_holds(rule: str, value: Any) -> bool:
    celpy = require("celpy")
    try:
        result = _cel_program(rule).evaluate({"self": celpy.json_to_cel(value)})
    except Exception:  # an evaluation error fails the rule, as on an API server
        return False
    # celpy's BoolType is an int; an error comes back as a CELEvalError value, not raised.
    return isinstance(result, int) and bool(result)
