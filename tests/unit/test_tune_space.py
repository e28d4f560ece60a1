"""Search spaces: parsing and validation against the recipe, without Ray."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from convoy.tune.results import TrialRow, footer, interrupted, trial_status, unfinished
from convoy.tune.space import (
    SpaceError,
    check_search,
    check_space,
    load_space,
    parse_space,
    trial_count,
)
from convoy.tune.sweep import (
    Sweep,
    SweepError,
    SweepOutcome,
    plan_sweep,
    record_changes,
    sigterm_as_sigint,
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
        (
            {"optim.lrr": {"uniform": [0.1, 0.2]}},
            "optim.lrr: unknown field (did you mean 'optim.lr'?)",
        ),
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


LIGHTNING_RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "lightning_digits.yaml")


def lightning_sweep(tmp_path: Path, **options: Any) -> Sweep:
    space = tmp_path / "space.yaml"
    space.write_text("lightning.module_kwargs.lr: {loguniform: [1.0e-3, 1.0e-2]}\n")
    overrides = [f"run.storage_dir={tmp_path / 'runs'}", "run.epochs=2"]
    return plan_sweep(LIGHTNING_RECIPE, overrides, str(space), name="s", **options)


def test_lightning_recipe_needs_metric_and_mode(tmp_path: Path) -> None:
    with pytest.raises(SweepError) as error:
        lightning_sweep(tmp_path, metric="val_loss")
    assert str(error.value).startswith("--mode: required for a Lightning recipe")
    assert "--metric val_loss --mode min" in str(error.value)
    sweep = lightning_sweep(tmp_path, metric="val_acc", mode="max")
    # The module's own self.log names, taken as given (no task metric check).
    assert (sweep.metric, sweep.mode, sweep.lightning) == ("val_acc", "max", True)


def test_ignored_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SweepError, match=r"-o run\.name=foo: a sweep does not take run\.name"):
        plan_sweep(None, ["run.name=foo"], str(tmp_path / "space.yaml"))
    with pytest.raises(SweepError, match="--retry-errored: only with --resume"):
        plan_sweep(None, [], str(tmp_path / "space.yaml"), retry_errored=True)


def test_resume_names_the_changed_fields() -> None:
    saved = {"recipe": {"run": {"epochs": 2, "seed": 0}}, "space": {"optim.lr": {}}, "samples": 2}
    now = {"recipe": {"run": {"epochs": 3, "seed": 0}}, "space": {"optim.lr": {}}, "samples": 4}
    assert record_changes(saved, now) == [
        "run.epochs: the sweep has 2, this command 3",
        "--samples: the sweep has 2, this command 4",
    ]
    assert record_changes(saved, saved) == []


@pytest.mark.parametrize(
    ("tune_status", "summary", "asha", "analysis", "expected"),
    [
        ("TERMINATED", False, True, {"epoch": {}}, "stopped"),
        ("TERMINATED", False, False, {"epoch": {}}, "interrupted"),
        ("RUNNING", False, False, {}, "interrupted"),
        ("PENDING", False, False, {}, "not started"),
        ("TERMINATED", True, False, {"epoch": {}}, "finished"),
        ("TERMINATED", True, True, {"epoch": {}}, "stopped"),  # the run outran the stop
        ("ERROR", False, False, {}, "error"),
    ],
)
def test_trial_status(
    tune_status: str, summary: bool, asha: bool, analysis: dict, expected: str
) -> None:
    assert trial_status(tune_status, summary, asha, analysis) == expected


def test_footer_counts_interruptions_and_no_scheduler_clause(tmp_path: Path) -> None:
    sweep = lightning_sweep(tmp_path, metric="val_loss", mode="min", samples=4, scheduler="none")
    rows = [
        TrialRow("a", {}, 0.5, 2, "finished", {}, tmp_path),
        TrialRow("b", {}, None, 0, "interrupted", {}, tmp_path),
        TrialRow("c", {}, None, 0, "not started", {}, tmp_path),
    ]
    line = footer(sweep, rows, 12.0, 2)
    assert line == "2 trial(s) in 12 s, 2 at once; 1 interrupted; 2 of 4 not started"


@pytest.mark.parametrize(
    ("statuses", "left"),
    [
        (["finished", "stopped", "error"], False),  # ended, each its way
        (["finished", "interrupted", "finished"], True),  # the last one running was stopped
        (["finished", "not started", "finished"], True),
        (["finished", "finished"], True),  # Tune never created the third
    ],
)
def test_a_sweep_is_unfinished_while_a_trial_is_left_to_run(
    tmp_path: Path, statuses: list[str], left: bool
) -> None:
    sweep = lightning_sweep(tmp_path, metric="val_loss", mode="min", samples=3, scheduler="none")
    rows = [TrialRow(str(i), {}, None, 0, s, {}, tmp_path) for i, s in enumerate(statuses)]
    assert unfinished(sweep, rows) is left


def test_sigterm_stops_the_sweep_as_ctrl_c() -> None:
    got: list[int] = []
    # Tune's own SIGINT handler stands in the sweep; here one that records the signal.
    previous_int = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    previous_term = signal.getsignal(signal.SIGTERM)
    try:
        with sigterm_as_sigint():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # let the interpreter run the handlers
        assert got == [signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is previous_term
    finally:
        signal.signal(signal.SIGINT, previous_int)


@pytest.mark.parametrize(("tune_status", "resume"), [("TERMINATED", False), ("RUNNING", True)])
def test_a_sweep_tune_left_running_is_to_be_resumed_even_where_its_rows_finished(
    tmp_path: Path, tune_status: str, resume: bool
) -> None:
    """A trial whose run wrote its summary before Tune saw it end is resumed, by design."""
    sweep = lightning_sweep(tmp_path, metric="val_loss", mode="min", samples=1, scheduler="none")
    rows = [TrialRow("a", {}, 0.5, 2, "finished", {}, tmp_path)]
    outcome = SweepOutcome([SimpleNamespace(status=tune_status)], 1, 1.0, 0)
    assert interrupted(sweep, outcome, rows) is resume


def test_a_space_that_draws_nothing_is_enumerated_once(tmp_path: Path) -> None:
    """Random search over grid dims alone draws nothing: its default is one pass over the grid
    (not 8 repeats of the same trials with the same seed), and a new sweep asking for repeats
    is told how to repeat over seeds instead; a resumed sweep keeps what it started with."""
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {grid: [3.0e-3, 1.0e-3]}\n")
    storage = f"run.storage_dir={tmp_path / 'runs'}"
    sweep = plan_sweep(None, [storage], str(space))
    assert (sweep.samples, sweep.trials) == (1, 2)
    with pytest.raises(SweepError) as error:
        plan_sweep(None, [storage], str(space), samples=3)
    assert str(error.value).startswith("--samples: got 3; this space draws nothing at random")
    assert "run.seed: {grid: [0, 1, 2]}" in str(error.value)
    seeds = tmp_path / "seeds.yaml"
    seeds.write_text("optim.lr: {grid: [3.0e-3, 1.0e-3]}\nrun.seed: {grid: [0, 1, 2]}\n")
    assert plan_sweep(None, [storage], str(seeds)).trials == 6
    with pytest.raises(SweepError, match="--resume: no sweep to resume"):
        plan_sweep(None, [storage], str(space), samples=3, name="old", resume=True)
    # A sweep started under the old default (8 repeats) resumes, without --samples, as started.
    started = plan_sweep(None, [storage], str(space), name="old")
    started.sweep_dir.mkdir(parents=True)
    (started.sweep_dir / "sweep.json").write_text(json.dumps({**started.record(), "samples": 8}))
    started.tune_dir.mkdir()
    (started.tune_dir / "tuner.pkl").write_bytes(b"")
    resumed = plan_sweep(None, [storage], str(space), name="old", resume=True)
    assert (resumed.samples, resumed.trials) == (8, 16)
    drawn = tmp_path / "drawn.yaml"
    drawn.write_text(
        "optim.lr: {loguniform: [1.0e-4, 3.0e-3]}\ndata.batch_size: {grid: [32, 64]}\n"
    )
    assert (
        plan_sweep(None, [storage], str(drawn)).samples,
        plan_sweep(None, [storage], str(drawn)).trials,
    ) == (8, 16)
