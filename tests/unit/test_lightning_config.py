"""Bad ``lightning:`` input is refused in the driver, one line each, before any worker starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from convoy.cli import main
from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.launchers import get_launcher
from convoy.launchers.base import LIGHTNING, TRAIN, default_entry
from convoy.preflight import preflight

pytest.importorskip("lightning")

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "lightning_digits.yaml"
MODULE = "examples.lightning_classifier:DigitsClassifier"
DATAMODULE = "examples.lightning_classifier:DigitsDataModule"
OWN_LOADERS = """
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class SelfContained(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)


class NoData(SelfContained):
    train_dataloader = L.LightningModule.train_dataloader
"""


@pytest.fixture(autouse=True)
def examples_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``convoy train`` run from the repository: its ``examples`` package imports."""
    monkeypatch.syspath_prepend(str(REPO))


def job(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    base = [f"run.storage_dir={tmp_path}", "scaling.launcher=local", "scaling.num_workers=1"]
    return load_job(RECIPE, [*base, *overrides])


def refusal(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        preflight(job(tmp_path, *overrides))
    assert "\n" not in str(caught.value)
    return caught.value


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module on sys.path whose LightningModules bring (or lack) their own loaders."""
    (tmp_path / "own_loaders.py").write_text(OWN_LOADERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "own_loaders", raising=False)
    return "own_loaders"


def test_the_recipe_passes_and_picks_the_lightning_entry(tmp_path: Path) -> None:
    checked = preflight(job(tmp_path))
    assert default_entry(checked) == LIGHTNING
    assert default_entry(load_job(None)) == TRAIN


def test_a_class_that_is_not_a_lightning_module(tmp_path: Path) -> None:
    error = refusal(tmp_path, f"lightning.module={DATAMODULE}")
    assert error.field == "lightning.module"
    assert "is not a lightning.LightningModule" in str(error)
    error = refusal(tmp_path, f"lightning.datamodule={MODULE}")
    assert error.field == "lightning.datamodule"
    assert "is not a lightning.LightningDataModule" in str(error)


def test_a_path_that_does_not_import_or_is_misspelled(tmp_path: Path) -> None:
    error = refusal(tmp_path, "lightning.module=examples.no_such_file:Model")
    assert "could not import examples.no_such_file" in str(error)
    error = refusal(tmp_path, "lightning.module=examples.lightning_classifier:DigitClassifier")
    assert f"did you mean {MODULE}?" in str(error)


def test_lightning_missing_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)
    error = refusal(tmp_path)
    assert "pip install 'convoy[lightning]'" in str(error)


def test_a_module_with_its_own_loaders_needs_no_datamodule(
    tmp_path: Path, user_module: str
) -> None:
    own = [f"lightning.module={user_module}:SelfContained", "lightning.module_kwargs={}"]
    preflight(job(tmp_path, *own, "lightning.datamodule=null"))
    no_data = [f"lightning.module={user_module}:NoData", "lightning.module_kwargs={}"]
    error = refusal(tmp_path, *no_data, "lightning.datamodule=null")
    assert error.field == "lightning.datamodule"
    assert "defines no train_dataloader" in str(error)


def test_strategies_and_options_lightning_cannot_run(tmp_path: Path) -> None:
    error = refusal(tmp_path, "strategy.name=fsdp")
    assert "needs a GPU" in str(error) and "fsdp2" in str(error)
    error = refusal(tmp_path, "strategy.name=fsdp2", "strategy.cpu_offload=true")
    assert error.field == "strategy.cpu_offload"
    error = refusal(tmp_path, "checkpoint.keep_best=1")
    assert error.field == "checkpoint.keep_best"
    # What a LightningModule does itself, in its configure_model.
    error = refusal(tmp_path, "strategy.name=ddp", "strategy.activation_checkpointing=full")
    assert error.field == "strategy.activation_checkpointing"
    assert refusal(tmp_path, "run.compile=true").field == "run.compile"
    split = ["scaling.launcher=torchrun", "scaling.num_workers=2", "strategy.tp_size=2"]
    error = refusal(tmp_path, "strategy.name=fsdp2", *split)
    assert error.field == "strategy.tp_size" and "parallelize_module" in str(error)
    hybrid = ["scaling.launcher=torchrun", "scaling.num_workers=4", "strategy.shard_size=2"]
    error = refusal(tmp_path, "strategy.name=hsdp", *hybrid)
    assert error.field == "strategy.name" and "2-D mesh" in str(error)


def test_trainer_kwargs_convoy_sets_or_trainer_lacks(tmp_path: Path) -> None:
    error = refusal(tmp_path, "lightning.trainer_kwargs.max_epochs=5")
    assert "Convoy sets max_epochs from run.epochs" in str(error)
    error = refusal(tmp_path, "lightning.trainer_kwargs.gradient_clip_vale=1.0")
    assert "did you mean 'gradient_clip_val'?" in str(error)
    preflight(job(tmp_path, "lightning.trainer_kwargs.gradient_clip_val=1.0"))


EARLY_STOPPING = "'lightning.pytorch.callbacks:EarlyStopping'"


def test_callbacks_and_loggers_come_as_class_specs(tmp_path: Path) -> None:
    from convoy.integrations.lightning import user_extensions
    from convoy.integrations.lightning_checks import class_specs

    callbacks = (
        f"lightning.trainer_kwargs.callbacks=[{{class: {EARLY_STOPPING}, "
        "kwargs: {monitor: val_loss, patience: 2}}, "
        "'lightning.pytorch.callbacks:LearningRateMonitor']"
    )
    logger = "lightning.trainer_kwargs.logger={class: 'lightning.pytorch.loggers:CSVLogger'}"
    checked = preflight(job(tmp_path, callbacks, logger))
    kwargs = checked.lightning.trainer_kwargs
    assert [(s.path, s.kwargs) for s in class_specs("callbacks", kwargs["callbacks"])] == [
        ("lightning.pytorch.callbacks:EarlyStopping", {"monitor": "val_loss", "patience": 2}),
        ("lightning.pytorch.callbacks:LearningRateMonitor", {}),
    ]
    early, monitor = user_extensions("callbacks", kwargs["callbacks"], tmp_path)
    assert (type(early).__name__, early.monitor, early.patience) == ("EarlyStopping", "val_loss", 2)
    assert type(monitor).__name__ == "LearningRateMonitor"
    (csv_logger,) = user_extensions("logger", kwargs["logger"], tmp_path)
    assert csv_logger.save_dir == str(tmp_path)  # a logger given no save_dir: the run dir


def test_callback_and_logger_specs_that_are_refused(tmp_path: Path) -> None:
    key = "lightning.trainer_kwargs.callbacks"
    error = refusal(tmp_path, f"{key}=[{{class: {EARLY_STOPPING}, kwargs: {{patience: 1}}}}, 3]")
    assert error.field == f"{key}[1]" and "expected 'package.module:Class'" in str(error)
    error = refusal(tmp_path, f"{key}=[{{klass: {EARLY_STOPPING}}}]")
    assert error.field == f"{key}[0]"
    error = refusal(tmp_path, f"{key}=['examples.no_such_file:Stop']")
    assert "could not import examples.no_such_file" in str(error)
    error = refusal(tmp_path, f"{key}=['{MODULE}']")
    assert "is not a lightning.Callback" in str(error)
    error = refusal(tmp_path, f"{key}=[{{class: {EARLY_STOPPING}, kwargs: {{patiense: 1}}}}]")
    assert error.field == f"{key}[0].kwargs" and "patiense" in str(error)
    error = refusal(tmp_path, f"lightning.trainer_kwargs.logger=[{EARLY_STOPPING}]")
    assert error.field == "lightning.trainer_kwargs.logger[0]"
    assert "is not a lightning.Logger" in str(error)


def test_a_callback_whose_constructor_raises_is_one_line_in_the_worker(tmp_path: Path) -> None:
    from convoy.integrations.lightning import user_extensions

    path = "lightning.pytorch.callbacks:EarlyStopping"
    spec = {"class": path, "kwargs": {"monitor": "val_loss", "mode": "sideways"}}
    with pytest.raises(ConfigError) as failure:
        user_extensions("callbacks", [spec], tmp_path)
    assert failure.value.field == "lightning.trainer_kwargs.callbacks[0].kwargs"
    assert f"{path} raised" in str(failure.value) and "sideways" in str(failure.value)


def test_constructor_kwargs_are_bound_in_the_driver(tmp_path: Path) -> None:
    error = refusal(tmp_path, "lightning.module_kwargs.hiden=32")
    assert error.field == "lightning.module_kwargs"
    assert "hiden" in str(error)


def test_launch_refuses_before_any_worker_and_the_cli_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = job(tmp_path, "strategy.name=fsdp")
    with pytest.raises(ConfigError):
        get_launcher("local").launch(bad)
    assert not (tmp_path / "unnamed").exists() and not list(tmp_path.iterdir())
    code = main(
        ["train", str(RECIPE), "-o", f"run.storage_dir={tmp_path}", "-o", "strategy.name=fsdp"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convoy: error: strategy.name: got 'fsdp'")


def test_the_train_summary_prints_the_names_the_module_logged() -> None:
    from convoy.commands.summary_lines import format_summary

    summary = {
        "metrics": {"val_loss": 0.5, "val_acc": 0.875, "test_acc": 0.9},
        "task": "lightning examples.lightning_classifier:DigitsClassifier",
        "strategy": "ddp",
        "world_size": 2,
        "launcher": "ray",
        "precision": "fp32",
        "steps": 51,
        "wall_seconds": 1.0,
        "samples_per_second": 100.0,
        "step_seconds_median": 0.01,
        "data_wait_fraction": 0.1,
        "peak_memory_bytes_per_rank": [2**20, 2**20],
    }
    lines = format_summary(summary, "/runs/digits").splitlines()
    assert "split" not in " ".join(lines)  # no engine split/name rows, no empty table
    assert [line.split() for line in lines if line.startswith(("val_", "test_"))] == [
        ["val_loss", "0.5000"],
        ["val_acc", "0.8750"],
        ["test_acc", "0.9000"],
    ]


def test_the_summary_shows_the_first_batch_apart_where_it_weighs() -> None:
    from convoy.commands.summary_lines import data_wait

    summary = {"data_wait_fraction": 0.2, "first_batch_seconds": 2.8}
    assert data_wait({**summary, "data_wait_fraction_after_first": 0.012}) == (
        "20.0% (1.2% after the first batch, which took 2.80 s)"
    )
    assert data_wait({**summary, "data_wait_fraction_after_first": 0.195}) == "20.0%"
    assert data_wait({"data_wait_fraction": 0.2}) == "20.0%"  # a summary from before
