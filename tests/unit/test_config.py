"""Config loading, overrides and every bad-input error (raised before any worker starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from convoy.config import Job, apply_overrides, job_to_yaml, load_job
from convoy.errors import ConfigError
from convoy.preflight import preflight

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_defaults_validate() -> None:
    job = load_job()
    assert job.strategy.name == "ddp"
    assert job.scaling.num_workers == 2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_parses(recipe: Path, cifar_tarball: Path, tmp_path: Path) -> None:
    overrides = []
    if "cifar10" in recipe.read_text():
        overrides.append(f"data.path={cifar_tarball}")
    if "name: series" in recipe.read_text():  # the recipe's data is written by synth-telematics
        from convoy.data.telematics import FleetSpec, write_fleet

        write_fleet(FleetSpec(devices=3, hours=0.05, rate_hz=20), str(tmp_path / "fleet"))
        overrides.append(f"data.path={tmp_path / 'fleet'}")
    if "models/chat" in recipe.read_text():  # the folder examples/chat_model.py makes
        folder = chat_model_folder(tmp_path / "chat")
        overrides += [f"model.kwargs.path={folder}", f"data.tokenizer_path={folder}"]
    job = load_job(recipe, overrides)
    assert isinstance(job, Job)
    # Everything the driver checks before workers start holds (factories, data, model fit).
    assert preflight(job).model == job.model
    # A resolved config round-trips through YAML unchanged.
    assert load_job_from_text(job_to_yaml(job), recipe.parent / "roundtrip.yaml") == job


def chat_model_folder(folder: Path) -> Path:
    """``examples/chat_model.py``'s folder (tokenizer, chat template, tiny Llama), untrained."""
    import importlib.util

    pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
    path = Path(__file__).resolve().parents[2] / "examples" / "chat_model.py"
    spec = importlib.util.spec_from_file_location("chat_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_folder(folder, pretrain_steps=0)  # type: ignore[no-any-return]


def load_job_from_text(text: str, path: Path) -> Job:
    import yaml

    from convoy.config import job_from_dict

    return job_from_dict(yaml.safe_load(text))


def test_overrides_parse_yaml_values_and_nest() -> None:
    data = apply_overrides(
        {"optim": {"lr": 1.0}}, ["optim.lr=3e-4", "strategy.name=fsdp2", "run.epochs=4"]
    )
    assert data == {"optim": {"lr": 3e-4}, "strategy": {"name": "fsdp2"}, "run": {"epochs": 4}}


def test_override_changes_strategy_and_workers() -> None:
    job = load_job(
        RECIPES[0].parent / "default.yaml",
        ["strategy.name=fsdp2", "scaling.num_workers=2", "optim.lr=3e-4"],
    )
    assert job.strategy.name == "fsdp2"
    assert job.optim.lr == 3e-4


def test_progress_off_survives_yaml_boolean() -> None:
    assert load_job(None, ["run.progress=off"]).run.progress == "off"


def test_config_is_frozen() -> None:
    job = load_job()
    with pytest.raises(ValueError):
        job.optim.lr = 1.0  # type: ignore[misc]


BAD_INPUTS = [
    (["strategy.name=zero3"], "strategy.name", "'ddp', 'fsdp', 'fsdp2', 'hsdp', 'single'"),
    (["model.name=resnet"], "model.name", "'vit_course', 'vit_tiny'"),
    (["data.name=mnist"], "data.name", "'digits', 'hf_dataset', 'imagefolder', 'numpy', 'parquet'"),
    (["optim.wieght_decay=0.1"], "optim.wieght_decay", "did you mean 'weight_decay'"),
    (
        ["strategy.name=ddp", "strategy.tp_size=2"],
        "strategy.tp_size",
        "an option of 'fsdp2' and 'hsdp'",
    ),
    (["optimizer.lr=0.1"], "optimizer", "did you mean 'optim'"),
    (["optim.lr=fast"], "optim.lr", "valid number"),
    (["run.epochs=many"], "run.epochs", "valid integer"),
    (["data.batch_size=0"], "data.batch_size", "greater than 0"),
    (["optim.lr=-1"], "optim.lr", "greater than 0"),
    (["scaling.num_workers=-2"], "scaling.num_workers", "greater than 0"),
    (
        ["data.batch_size=30", "scaling.num_workers=4", "strategy.name=ddp"],
        "data.batch_size",
        "4 x 1 = 4",
    ),
    (
        [
            "data.batch_size=64",
            "optim.grad_accum_steps=3",
            "strategy.name=ddp",
            "scaling.num_workers=2",
        ],
        "data.batch_size",
        "2 x 3 = 6",
    ),
    (["precision=fp16"], "precision", "needs a GPU"),
    (["data.name=cifar10", "data.path=/nonexistent/cifar"], "data.path", "does not exist"),
    (["data.name=cifar10"], "data.path", "never downloads"),
    (["data.name=imagefolder", "data.path=/nonexistent"], "data.path", "no train/ folder"),
    (
        ["strategy.name=single", "scaling.num_workers=2"],
        "strategy.name",
        "scaling.num_workers is 2",
    ),
    (
        ["scaling.launcher=local", "strategy.name=ddp", "scaling.num_workers=2"],
        "scaling.num_workers",
        "one in-process worker",
    ),
    (["scaling.launcher=slurm"], "scaling.launcher", "'local', 'torchrun' or 'ray'"),
    (
        ["strategy.name=ddp", "strategy.comm_hook=int4"],
        "strategy.comm_hook",
        "'none', 'fp16' or 'bf16'",
    ),
    (
        ["strategy.name=ddp", "strategy.reshard_after_forward=false"],
        "strategy.reshard_after_forward",
        "'comm_hook'",
    ),
    (["model.kwargs.width=5"], "model.kwargs.width", "takes"),
    (["fault.kind=raise", "fault.rank=3"], "fault.rank", "ranks are 0..0"),
    (["fault.kind=freeze"], "fault.kind", "'hang', 'slow' or 'preempt'"),
    (
        ["scaling.relax_collectives_on_preemption=true", "strategy={name: fsdp2}"],
        "scaling.relax_collectives_on_preemption",
        "strategy 'fsdp2' shards them",
    ),
    (
        ["scaling.relax_collectives_on_preemption=true", "scaling.launcher=torchrun"],
        "scaling.relax_collectives_on_preemption",
        "an option of scaling.launcher 'ray'",
    ),
    (
        ["fault.kind=preempt", "run.stop_on_signal=false"],
        "fault.kind",
        "needs run.stop_on_signal: true",
    ),
    (["checkpoint.keep_latest=0"], "checkpoint.keep_latest", "greater than 0"),
    # A field of two types (a boolean or a name): every member's values, the field's own path.
    (
        ["run.compile=maybe"],
        "run.compile",
        "got 'maybe'; allowed: true, false, 'blocks' or 'model'",
    ),
    (["model.name=no_such_pkg.mod:factory"], "model.name", "could not import"),
    (["run.storage_dir=gs://bucket/runs"], "run.storage_dir", "or s3://bucket/prefix"),
    (["run.storage_dir=s3:///runs"], "run.storage_dir", "needs a bucket"),
    (
        ["scaling.launcher=ray", "checkpoint.keep_best=2", "checkpoint.keep_latest=2"],
        "checkpoint.keep_latest",
        "plus only the latest checkpoint; set keep_latest: 1",
    ),
]


@pytest.mark.parametrize(("overrides", "field", "allowed"), BAD_INPUTS, ids=lambda v: str(v))
def test_bad_input_names_field_value_and_allowed(
    overrides: list[str], field: str, allowed: str
) -> None:
    base = ["strategy.name=single", "scaling.num_workers=1"]
    with pytest.raises(ConfigError) as info:
        preflight(load_job(None, base + overrides))
    message = str(info.value)
    assert message.startswith(field + ":"), message
    assert allowed in message, message
    assert "\n" not in message  # one paragraph


def test_schema_alone_touches_no_files_or_imports() -> None:
    """A recorded job loads anywhere (export on another machine); preflight checks the rest."""
    job = load_job(None, ["data.name=cifar10", "data.path=/moved/away", "model.name=pkg.gone:fn"])
    assert job.data.path == "/moved/away"
    with pytest.raises(ConfigError, match=r"^model\.name: .*could not import"):
        preflight(job)


def test_missing_recipe_file() -> None:
    with pytest.raises(ConfigError, match=r"recipe: got 'nope\.yaml'"):
        load_job("nope.yaml")


def test_recipe_must_be_a_mapping(tmp_path: Path) -> None:
    recipe = tmp_path / "list.yaml"
    recipe.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_job(recipe)


def test_malformed_override() -> None:
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        load_job(None, ["optim.lr"])


def test_a_config_error_survives_pickling() -> None:
    """Raised in a Ray worker, it reaches the driver whole (Ray pickles the exception)."""
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError("strategy.shard_size", 4, "must divide 6")))
    assert (error.field, error.value, error.allowed) == ("strategy.shard_size", 4, "must divide 6")
    assert str(error) == "strategy.shard_size: got 4; must divide 6"


def test_a_union_error_lists_each_members_values_and_two_fields_are_not_a_union() -> None:
    """Pydantic reports one error per member of a union, the member's tag last in the path;
    two plain fields that fail on the same value are not read as one union."""
    from typing import Literal

    from pydantic import BaseModel, ValidationError

    from convoy.config.loading import _union_members

    class Section(BaseModel):
        size: int | Literal["auto"] = "auto"
        first: int = 0
        second: int = 0

    class Outer(BaseModel):
        section: Section = Section()

    with pytest.raises(ValidationError) as union:
        Outer(section={"size": "big"})
    assert _union_members(union.value.errors()) == "a valid integer or 'auto'"
    with pytest.raises(ValidationError) as fields:  # section.first, section.second: one parent
        Outer(section={"first": "x", "second": "x"})
    assert _union_members(fields.value.errors()) is None
