"""Each launcher's section class carries what the schema and the rest of Convoy ask about the
launcher (as a strategy's class does): how many workers it runs and how they sit on nodes,
the data loaders it takes and the one it builds in the driver, whether its workers are Ray
Train's. The launcher classes that start workers follow the same list."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from convoy.config import (
    LAUNCHER_MODELS,
    LAUNCHER_NAMES,
    LOADER_NAMES,
    LocalLauncherConfig,
    RayLauncherConfig,
    ScalingConfig,
    TorchrunConfig,
    load_job,
    world_sizes,
)
from convoy.errors import ConfigError
from convoy.launchers import get_launcher, launcher_class


def test_the_list_of_launchers_is_the_schemas() -> None:
    assert LAUNCHER_NAMES == ("local", "torchrun", "ray")
    assert get_args(ScalingConfig.model_fields["launcher"].annotation) == LAUNCHER_NAMES
    assert LOADER_NAMES == ("torch", "ray_data")
    assert all(model.takes_loader("torch") for model in LAUNCHER_MODELS.values())


def test_the_registry_follows_the_config_list() -> None:
    for name in LAUNCHER_NAMES:  # each module imports Ray itself only when it runs
        cls = launcher_class(name)
        assert cls.name == name
        assert cls.config_model is LAUNCHER_MODELS[name]
        assert cls.__module__ == f"convoy.launchers.{name}"  # one file per launcher
        assert type(get_launcher(name)) is cls
    with pytest.raises(ConfigError, match="allowed: 'local', 'ray', 'torchrun'"):
        launcher_class("slurm")


def test_loading_a_job_imports_no_launcher() -> None:
    code = (
        "import sys, convoy.config\n"
        "convoy.config.load_job(None, ['scaling.launcher=torchrun'])\n"
        "names = ('local', 'torchrun', 'ray')\n"
        "loaded = [n for n in names if f'convoy.launchers.{n}' in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_chosen_launcher_answers_for_itself() -> None:
    sections = {
        name: load_job(
            None, [f"scaling.launcher={name}", "scaling.num_workers=1"]
        ).scaling.launcher_section
        for name in LAUNCHER_NAMES
    }
    assert isinstance(sections["local"], LocalLauncherConfig)
    assert isinstance(sections["torchrun"], TorchrunConfig)
    assert isinstance(sections["ray"], RayLauncherConfig)
    assert [s.runs_ray_train for s in sections.values()] == [False, False, True]
    assert [s.takes_loader("ray_data") for s in sections.values()] == [False, False, True]


def test_workers_per_node_and_world_sizes() -> None:
    torchrun = load_job(
        None,
        [
            "scaling.launcher=torchrun",
            "scaling.num_workers=[2,4]",
            "scaling.torchrun.nproc_per_node=2",
            "data.batch_size=64",
        ],
    )
    assert torchrun.scaling.launcher_section.workers_per_node(torchrun.scaling) == 2
    assert world_sizes(torchrun.scaling) == [2, 4]  # whole nodes of 2
    ray = load_job(None, ["scaling.num_workers=[2,4]", "data.batch_size=48"])
    assert ray.scaling.launcher_section.workers_per_node(ray.scaling) is None  # placement's
    assert world_sizes(ray.scaling) == [2, 3, 4]
    local = load_job(None, ["scaling.launcher=local", "scaling.num_workers=1"])
    assert local.scaling.launcher_section.workers_per_node(local.scaling) == 1


def test_the_loader_is_chosen_once_by_the_launcher() -> None:
    streamed = load_job(None, ["data.loader=ray_data"])
    assert streamed.data_from_driver
    assert not load_job(None, []).data_from_driver
    assert not load_job(None, ["scaling.launcher=torchrun"]).data_from_driver


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.loader=ray_data", "scaling.launcher=torchrun"],
            "data.loader: got 'ray_data'; Ray Data streams into Ray Train workers, so it needs "
            "scaling.launcher: ray (got 'torchrun'); use data.loader: torch with that launcher",
        ),
        (
            ["scaling.launcher=local"],
            "scaling.num_workers: got 2; the 'local' launcher runs one in-process worker; use "
            "'torchrun' or 'ray' for more",
        ),
        (
            ["data.loader=ray_data", "scaling.num_workers=[2,4]", "data.batch_size=48"],
            "data.loader ray_data cuts the eval splits per rank",
        ),
    ],
)
def test_launcher_checks_keep_their_words(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(None, overrides)
    assert message in str(info.value)
