"""The search space: a YAML mapping from dotted config fields to one sampling kind each.

    optim.lr: {loguniform: [1.0e-4, 3.0e-3]}
    strategy.name: {choice: [ddp, fsdp2]}
    data.batch_size: {grid: [32, 64]}

A space is checked against the recipe before Ray starts, through the same ``Job`` validation
a recipe gets: every field must exist (with a did-you-mean), every value a sample can take
must be valid for its field (each choice and grid value; the endpoints of ``uniform``,
``loguniform`` and ``randint``), and every combination of the categorical values with those
endpoints must make a valid job (``strategy.reshard_after_forward`` is not a DDP option).
Nothing here imports Ray; ``tune_domains`` does, lazily.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from convoy.config import Job, job_from_dict, read_yaml, set_field
from convoy.errors import ConfigError, ConvoyError, one_of

KINDS = ("choice", "grid", "uniform", "loguniform", "randint")
CATEGORICAL = ("choice", "grid")
SEARCHES = ("random", "grid", "optuna")
RESERVED = {
    "run.name": "the sweep names each trial's run after its trial id",
    "run.storage_dir": "the sweep puts every trial under <run.storage_dir>/<sweep name>/",
    "run.epochs": "it is ASHA's max_t for every trial; set it with -o run.epochs=N",
    "scaling.launcher": "every trial runs on Ray Train",
}
COMBINATIONS_CHECKED = 256
"""At most this many combinations of categorical values and endpoints are validated."""
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")


class SpaceError(ConvoyError):
    """A search space that cannot be swept (malformed, unknown kind, invalid values)."""


@dataclass(frozen=True)
class Dim:
    """One swept field: its dotted key, the sampling kind and the kind's values."""

    key: str
    kind: str
    values: tuple[Any, ...]
    """The categorical values, or ``(low, high)`` (``randint``: high exclusive, as Tune's)."""

    @property
    def categorical(self) -> bool:
        return self.kind in CATEGORICAL

    @property
    def probes(self) -> tuple[Any, ...]:
        """Every value a categorical dim takes; the extremes a numeric one can sample."""
        if self.kind == "randint":
            return (self.values[0], self.values[1] - 1)
        return self.values

    def describe(self) -> str:
        return f"{self.key}: {{{self.kind}: {list(self.values)}}}"


def load_space(path: str | Path) -> list[Dim]:
    """Read and parse a space file; every problem is one ``SpaceError`` line."""
    source = Path(path)
    if not source.is_file():
        raise SpaceError(f"--space: got {str(path)!r}; expected a YAML file that exists")
    try:
        data = read_yaml(source.read_text())
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpaceError(f"{path}: not valid YAML{line}: {problem}") from None
    return parse_space(data, str(path))


def parse_space(data: Any, source: str = "space") -> list[Dim]:
    """Turn ``{dotted.key: {kind: values}}`` into dims, checking the shape of each entry."""
    if not isinstance(data, dict) or not data:
        raise SpaceError(
            f"{source}: expected a mapping of dotted config fields to one kind each, e.g. "
            "optim.lr: {loguniform: [1.0e-4, 3.0e-3]}"
        )
    return [_parse_dim(str(key), spec, source) for key, spec in data.items()]


def _parse_dim(key: str, spec: Any, source: str) -> Dim:
    if key in RESERVED:
        raise SpaceError(f"{source}: {key} cannot be swept: {RESERVED[key]}")
    if not (isinstance(spec, dict) and len(spec) == 1):
        raise SpaceError(
            f"{source}: {key}: got {spec!r}; expected one {{KIND: VALUES}} with KIND one of "
            f"{', '.join(KINDS)} (a fixed value goes in the recipe or -o {key}=VALUE)"
        )
    kind, raw = next(iter(spec.items()))
    if kind not in KINDS:
        raise SpaceError(f"{source}: {key}: unknown kind {kind!r}; {one_of(KINDS)}")
    if not isinstance(raw, list) or not raw:
        raise SpaceError(f"{source}: {key}: {kind} takes a non-empty list, got {raw!r}")
    values = tuple(_number_or_value(v) for v in raw)
    if kind in CATEGORICAL:
        return Dim(key, kind, values)
    return Dim(key, kind, _bounds(key, kind, values, source))


def _number_or_value(value: Any) -> Any:
    # YAML 1.1 reads 3e-4 (no dot) as a string; a user writing it means the number.
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _bounds(key: str, kind: str, values: tuple[Any, ...], source: str) -> tuple[Any, ...]:
    """``[low, high]`` of a numeric kind, checked for order (and positivity for loguniform)."""
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if len(values) != 2 or not numeric:
        raise SpaceError(f"{source}: {key}: {kind} takes [low, high] numbers, got {list(values)}")
    low, high = values
    if kind == "randint":
        if low != int(low) or high != int(high):
            raise SpaceError(f"{source}: {key}: randint takes integers, got {list(values)}")
        low, high = int(low), int(high)
    if not low < high:
        raise SpaceError(f"{source}: {key}: {kind} needs low < high, got [{low}, {high}]")
    if kind == "loguniform" and low <= 0:
        raise SpaceError(f"{source}: {key}: loguniform needs low > 0, got [{low}, {high}]")
    if kind == "randint":
        return (low, high)
    return (float(low), float(high))


def job_with(base: dict[str, Any], values: dict[str, Any]) -> Job:
    """The job ``base`` (a recipe dict) becomes with the sampled ``values`` applied."""
    data = base
    for key, value in values.items():
        data = set_field(data, key, value)
    return job_from_dict(data)


def combinations(dims: list[Dim]) -> tuple[list[dict[str, Any]], int]:
    """Up to ``COMBINATIONS_CHECKED`` of the combinations of every dim's probes, and how
    many there are in all."""
    total = math.prod(len(d.probes) for d in dims)
    picked = itertools.islice(itertools.product(*(d.probes for d in dims)), COMBINATIONS_CHECKED)
    return [dict(zip((d.key for d in dims), combo, strict=True)) for combo in picked], total


def check_space(base: dict[str, Any], dims: list[Dim], source: str = "space") -> list[Job]:
    """Validate every combination of probes against the recipe ``base``; returns their jobs.

    A value that fails in every combination it appears in is reported alone (an unknown
    field, a learning rate below zero); otherwise the first failing combination is named.
    """
    combos, _ = combinations(dims)
    outcomes: list[tuple[dict[str, Any], Job | ConfigError]] = []
    for combo in combos:
        try:
            outcomes.append((combo, job_with(base, combo)))
        except ConfigError as exc:
            outcomes.append((combo, exc))
    failed = [(combo, out) for combo, out in outcomes if isinstance(out, ConfigError)]
    if failed:
        combo, error = failed[0]
        raise _explain(dims, combo, error, outcomes, source)
    return [out for _, out in outcomes if isinstance(out, Job)]


def _explain(
    dims: list[Dim],
    combo: dict[str, Any],
    error: ConfigError,
    outcomes: list[tuple[dict[str, Any], Job | ConfigError]],
    source: str,
) -> SpaceError:
    for dim in dims:
        value = combo[dim.key]
        if not (error.field == dim.key or error.field.startswith(dim.key + ".")):
            continue
        same = [out for other, out in outcomes if _same(other[dim.key], value)]
        if all(isinstance(out, ConfigError) for out in same):
            if error.field == dim.key and error.allowed.startswith("unknown key"):
                return SpaceError(f"{source}: {_unknown_field(error)}")
            return SpaceError(f"{source}: {dim.describe()}: {error}")
    if len(dims) == 1:
        return SpaceError(f"{source}: {dims[0].describe()}: {error}")
    shown = ", ".join(f"{k}={v!r}" for k, v in combo.items())
    return SpaceError(f"{source}: the combination {shown} is not a valid config: {error}")


def _unknown_field(error: ConfigError) -> str:
    """``optim.lrr: unknown field (did you mean 'optim.lr'?)``: the space names a field that no
    recipe has (whatever value it would take), the suggestion dotted in full."""
    parent = error.field.rpartition(".")[0]
    guess = re.search(r"did you mean '([^']+)'", error.allowed)
    hint = f" (did you mean {'.'.join(filter(None, (parent, guess[1])))!r}?)" if guess else ""
    return f"{error.field}: unknown field{hint}"


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def check_search(dims: list[Dim], search: str, source: str = "space") -> None:
    """``--search grid`` enumerates: it takes only grid and choice dims."""
    if search not in SEARCHES:
        raise SpaceError(f"--search: got {search!r}; {one_of(SEARCHES)}")
    numeric = [d.key for d in dims if not d.categorical]
    if search == "grid" and numeric:
        raise SpaceError(
            f"--search grid: {source} samples {', '.join(numeric)} from a range; grid search "
            "takes only grid and choice dims (use --search random or optuna, or list values)"
        )


def draws_at_random(dims: list[Dim], search: str) -> bool:
    """Whether a sweep's trials draw values at random (so that repeating them differs):
    ``optuna`` does; ``random`` does where a dim is not a grid (a grid is enumerated);
    ``grid`` enumerates every dim."""
    if search == "optuna":
        return True
    return search == "random" and any(d.kind != "grid" for d in dims)


def trial_count(dims: list[Dim], search: str, samples: int) -> int:
    """How many trials the sweep runs, as Ray Tune counts them.

    ``random``: ``samples`` draws for each combination of the grid dims (Tune's num_samples
    repeats the grid); ``grid``: every combination of grid and choice values, ``samples``
    times; ``optuna``: ``samples`` trials (Optuna treats grid dims as choices).
    """
    if search == "optuna":
        return samples
    enumerated = [d for d in dims if d.kind == "grid" or search == "grid"]
    return samples * math.prod(len(d.values) for d in enumerated)


def tune_domains(dims: list[Dim], search: str) -> dict[str, Any]:
    """Ray Tune's ``param_space`` for the dims (flat dotted keys)."""
    from ray import tune  # the ray extra

    space: dict[str, Any] = {}
    for dim in dims:
        values = list(dim.values)
        if (dim.kind == "grid" and search != "optuna") or (
            dim.kind == "choice" and search == "grid"
        ):
            space[dim.key] = tune.grid_search(values)
        elif dim.categorical:
            space[dim.key] = tune.choice(values)
        elif dim.kind == "uniform":
            space[dim.key] = tune.uniform(*values)
        elif dim.kind == "loguniform":
            space[dim.key] = tune.loguniform(*values)
        else:
            space[dim.key] = tune.randint(*values)
    return space
