"""Search spaces: parsing and validation against the recipe, without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.tune.space import (
    SpaceError,
    check_search,
    check_space,
    load_space,
    parse_space,
    trial_count,
)

RECIPE = {"model": {"name": "mlp"}, "strategy": {"name": "ddp"}, "scaling": {"num_workers": 2}}


def test_parses_every_kind() -> None:
    dims = parse_space(
        {
            "optim.lr": {"loguniform": ["1e-4", 3.0e-3]},
            "strategy.name": {"choice": ["ddp", "fsdp2"]},
            "data.batch_size": {"grid": [32, 64]},
            "optim.warmup_steps": {"randint": [0, 100]},
            "optim.weight_decay": {"uniform": [0.0, 0.3]},
        }
    )
    by_key = {d.key: d for d in dims}
    assert by_key["optim.lr"].values == (1e-4, 3e-3)  # "1e-4" read as the number
    assert by_key["optim.warmup_steps"].probes == (0, 99)  # Tune's randint: high exclusive
    assert by_key["data.batch_size"].categorical
    assert len(check_space(RECIPE, dims)) == 2 * 2 * 2 * 2 * 2


@pytest.mark.parametrize(
    ("space", "expected"),
    [
        ({"optim.lrr": {"uniform": [0.1, 0.2]}}, "did you mean 'lr'"),
        ({"optim.lr": {"loguniform": [-1.0, 0.1]}}, "loguniform needs low > 0"),
        ({"optim.lr": {"uniform": [0.0, 0.1]}}, "optim.lr: got 0.0; input should be greater"),
        ({"optim.lr": {"sobol": [0.1, 0.2]}}, "unknown kind 'sobol'"),
        ({"optim.lr": 0.1}, "expected one {KIND: VALUES}"),
        ({"optim.lr": {"uniform": [0.2, 0.1]}}, "needs low < high"),
        ({"data.batch_size": {"grid": [32, 33]}}, "data.batch_size: got 33"),
        ({"strategy.name": {"choice": ["ddp", "fsdp3"]}}, "'fsdp3'"),
        ({"run.name": {"choice": ["a", "b"]}}, "run.name cannot be swept"),
        ({"optim.warmup_steps": {"randint": [0.5, 3]}}, "randint takes integers"),
    ],
)
def test_bad_space_is_one_line(space: dict, expected: str) -> None:
    with pytest.raises(SpaceError) as error:
        check_space(RECIPE, parse_space(space, "s.yaml"), "s.yaml")
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_invalid_combination_is_named() -> None:
    dims = parse_space(
        {
            "strategy.name": {"choice": ["fsdp2", "ddp"]},
            "strategy.reshard_after_forward": {"choice": [True, False]},
        }
    )
    with pytest.raises(SpaceError) as error:
        check_space(RECIPE, dims, "s.yaml")
    text = str(error.value)
    assert "the combination strategy.name='ddp', strategy.reshard_after_forward=True" in text
    assert "unknown key" in text


def test_malformed_files(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("optim.lr: {uniform: [0.1, 0.2]\n")
    with pytest.raises(SpaceError, match="not valid YAML"):
        load_space(broken)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(SpaceError, match="expected a mapping"):
        load_space(empty)
    with pytest.raises(SpaceError, match="expected a YAML file that exists"):
        load_space(tmp_path / "missing.yaml")


def test_search_kinds_and_trial_counts() -> None:
    dims = parse_space(
        {"optim.lr": {"loguniform": [1e-4, 1e-3]}, "data.batch_size": {"grid": [32, 64]}}
    )
    with pytest.raises(SpaceError, match="grid search takes only grid and choice"):
        check_search(dims, "grid")
    with pytest.raises(SpaceError, match="allowed: 'grid', 'optuna', 'random'"):
        check_search(dims, "bayes")
    assert trial_count(dims, "random", 3) == 6  # 3 draws for each batch size
    assert trial_count(dims, "optuna", 3) == 3
    categorical = parse_space(
        {"strategy.name": {"choice": ["ddp", "fsdp2"]}, "data.batch_size": {"grid": [32, 64]}}
    )
    assert trial_count(categorical, "grid", 1) == 4
