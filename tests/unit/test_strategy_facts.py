"""Each strategy's class carries what the rest of Convoy asks about it: the facts pinned here
are the ones the planner, ``plan --check``, ``bench compare`` and the Lightning integration
used when they still branched on the strategy's name. Outside ``convoy/strategies/`` no code
spells a strategy's name (``convoy/config/strategy.py``'s one list of config models aside),
and outside ``convoy/launchers/`` none compares a launcher's or a data loader's name: it asks
the launcher's class (``job.scaling.launcher_section``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import convoy
from convoy.config import (
    LAUNCHER_NAMES,
    LOADER_NAMES,
    STRATEGY_MODELS,
    STRATEGY_NAMES,
    load_job,
    micro_batch,
    split_batch,
)
from convoy.errors import ConfigError
from convoy.plan import strategy_order
from convoy.strategies import strategy_class, strategy_classes

SRC = Path(convoy.__file__).parent


def _name_literals(path: Path) -> list[str]:
    """Every place in ``path`` that spells a strategy name as a string literal, but
    docstrings and the ``name`` field of the strategy config models (``config/strategy.py``)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in STRATEGY_NAMES):
            continue
        if isinstance(parents.get(node), ast.Expr):  # a docstring
            continue
        if path.parts[-2:] == ("config", "strategy.py") and _in_name_field(node, parents):
            continue
        found.append((node.lineno, node.col_offset, node.value))
    return [f"{path}:{line}: {value!r}" for line, _, value in sorted(found)]


def _in_name_field(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``name: Literal["x"] = "x"`` of a config model: the one list of strategies."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.AnnAssign):
            return isinstance(node.target, ast.Name) and node.target.id == "name"
    return False


def test_no_strategy_name_is_spelled_outside_strategies() -> None:
    files = [p for p in SRC.rglob("*.py") if "strategies" not in p.relative_to(SRC).parts]
    found = [hit for path in sorted(files) for hit in _name_literals(path)]
    assert not found, "ask the strategy's class (convoy.strategies), not its name:\n" + "\n".join(
        found
    )


def test_the_scan_finds_a_comparison(tmp_path: Path) -> None:
    module = tmp_path / "planner.py"
    module.write_text(
        '"""fsdp2"""\n'
        "def f(name):\n"
        '    return name == "fsdp2" or name in ("ddp", "fsdp")\n'
        'SHARDED = {"fsdp": 1}\n'
    )
    hits = [hit.rsplit(": ", 1)[1] for hit in _name_literals(module)]
    assert hits == ["'fsdp2'", "'ddp'", "'fsdp'", "'fsdp'"]


def _compared_names(path: Path, names: set[str]) -> list[str]:
    """Every comparison in ``path`` (``==``, ``!=``, ``in``, ``not in``...) with one of
    ``names`` as a string literal on either side, alone or in a tuple, list or set."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            found += [
                (item.lineno, item.col_offset, item.value)
                for item in items
                if isinstance(item, ast.Constant) and item.value in names
            ]
    return [f"{path}:{line}: {value!r}" for line, _, value in sorted(found)]


LAUNCHER_AND_LOADER_NAMES = {*LAUNCHER_NAMES, *LOADER_NAMES}


def test_no_launcher_or_loader_name_is_compared_outside_launchers() -> None:
    files = [p for p in SRC.rglob("*.py") if "launchers" not in p.relative_to(SRC).parts]
    found = [
        hit for path in sorted(files) for hit in _compared_names(path, LAUNCHER_AND_LOADER_NAMES)
    ]
    assert not found, (
        "ask the launcher's class (job.scaling.launcher_section, job.data_from_driver), "
        "not its name:\n" + "\n".join(found)
    )


def test_the_launcher_scan_finds_a_comparison(tmp_path: Path) -> None:
    module = tmp_path / "tune.py"
    module.write_text(
        '"""ray"""\n'
        "def f(job):\n"
        '    if job.scaling.launcher != "ray" or job.data.loader == "ray_data":\n'
        '        return "torchrun" in (job.scaling.launcher,) or job.scaling.launcher in ("local", "torch")\n'
        'NAMES = {"ray": 1}\n'
    )
    hits = [hit.rsplit(": ", 1)[1] for hit in _compared_names(module, LAUNCHER_AND_LOADER_NAMES)]
    assert hits == ["'ray'", "'ray_data'", "'torchrun'", "'local'", "'torch'"]


def test_the_registry_follows_the_config_list() -> None:
    classes = strategy_classes()
    assert list(classes) == list(STRATEGY_NAMES) == ["single", "ddp", "fsdp", "fsdp2", "hsdp"]
    for name, cls in classes.items():
        assert cls.name == name
        assert cls.config_model is STRATEGY_MODELS[name]
        assert cls.__module__ == f"convoy.strategies.{name}"  # one file per strategy
    with pytest.raises(ConfigError, match="'ddp', 'fsdp', 'fsdp2', 'hsdp', 'single'"):
        strategy_class("zero3")


def test_import_convoy_leaves_the_strategy_modules_unloaded() -> None:
    code = (
        "import sys, convoy, convoy.strategies, convoy.config\n"
        "heavy = [m for m in ('torch.distributed.fsdp', 'convoy.strategies.fsdp2') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_config_knows_what_the_class_shards() -> None:
    """The schema's own fact (relaxed collectives need every rank to hold the whole model and
    optimizer) agrees with the class's ``sharding``."""
    for name, cls in strategy_classes().items():
        sharding = cls.sharding
        shards = sharding.parameters or sharding.optimizer_state
        assert STRATEGY_MODELS[name].shards_model_state is shards, name


def test_what_each_strategy_shards() -> None:
    sharded = {n for n, cls in strategy_classes().items() if cls.sharding.parameters}
    assert sharded == {"fsdp", "fsdp2", "hsdp"}  # the planner's SHARDED, and hsdp
    mesh_dims = {"fsdp": "world", "fsdp2": "world", "hsdp": "shard"}
    for name, cls in strategy_classes().items():
        facts = cls.sharding
        assert facts.parameters == facts.gradients == facts.optimizer_state == (name in sharded)
        assert facts.mesh_dim == mesh_dims.get(name)
    assert strategy_class("fsdp").sharding.layout == "flat_per_unit"
    assert strategy_class("fsdp2").sharding.layout == "per_parameter"
    assert strategy_class("hsdp").sharding.layout == "per_parameter"
    casts = {n for n, cls in strategy_classes().items() if cls.casts_parameters}
    assert casts == {"fsdp", "fsdp2", "hsdp"}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_buckets_units_and_gathers_as_the_planner_modelled_them(world_size: int) -> None:
    buffers = {n: cls.comm_buffers for n, cls in strategy_classes().items()}
    assert buffers == {
        "single": "none",
        "ddp": "ddp_buckets",
        "fsdp": "fsdp_units",
        "fsdp2": "fsdp_units",
        "hsdp": "fsdp_units",
    }
    for name, cls in strategy_classes().items():
        # The planner's gathers(): FSDP2 at any world size, FSDP1 only on more than one.
        before = name in ("fsdp2", "hsdp") or (name == "fsdp" and world_size > 1)
        assert cls.gathers_parameters(world_size) == before, name


def test_workers_and_the_planners_order() -> None:
    limits = {n: cls.max_world_size() for n, cls in strategy_classes().items()}
    assert limits == {"single": 1, "ddp": None, "fsdp": None, "fsdp2": None, "hsdp": None}
    assert not strategy_class("single").runs_on(2) and strategy_class("ddp").runs_on(64)
    # The planner's STRATEGY_ORDER, hsdp after the layouts it refines.
    assert strategy_order() == ["single", "ddp", "fsdp2", "fsdp", "hsdp"]


def test_memory_trackers_as_plan_check_chose_them() -> None:
    tracking = {n: cls.memory_tracking for n, cls in strategy_classes().items()}
    assert {n for n, t in tracking.items() if t} == {"single", "ddp", "fsdp2", "hsdp"}
    assert tracking["fsdp2"] is not None and tracking["fsdp2"].tracker == "FSDPMemTracker"
    assert tracking["hsdp"] == tracking["fsdp2"]
    assert tracking["single"] is not None and tracking["single"].tracker == "MemTracker"
    assert tracking["ddp"] is not None and not tracking["ddp"].fake_tensors
    assert "FSDP1" in strategy_class("fsdp").untracked_reason


def _old_comm_factor(name: str, cfg: Any, world_size: int) -> float:
    """``bench compare``'s formula before the strategies carried it."""
    if name == "single" or world_size == 1:
        return 0.0
    passes = 2.0
    if name == "fsdp" and cfg.sharding == "full_shard":
        passes = 3.0
    if name == "fsdp2" and cfg.reshard_after_forward:
        passes = 3.0
    return passes * (world_size - 1) / world_size


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["strategy.sharding=shard_grad_op"],
        ["strategy.sharding=no_shard"],
        ["strategy.reshard_after_forward=false"],
    ],
)
def test_comm_volume_is_the_compare_formula(options: list[str]) -> None:
    for name, cls in strategy_classes().items():
        if name == "hsdp":
            continue  # below: its own two-level formula
        own = [o for o in options if o.split("=")[0].split(".")[1] in cls.config_model.model_fields]
        cfg = load_job(None, [f"strategy.name={name}", "scaling.num_workers=1", *own]).strategy
        for n in (1, 2, 3, 4, 8):
            assert cls.comm_volume(cfg, n) == _old_comm_factor(name, cfg, n), (name, own, n)


@pytest.mark.parametrize(
    ("world", "shard", "expected"),
    [
        # fsdp2's three passes inside each shard group, 2 (r-1)/r of 1/shard across replicas.
        (4, 2, 3 * 1 / 2 + 2 * (1 / 2) / 2),
        (8, 4, 3 * 3 / 4 + 2 * (1 / 2) / 4),
        (8, 2, 3 * 1 / 2 + 2 * (3 / 4) / 2),
    ],
)
def test_hsdp_comm_volume_is_two_levels(world: int, shard: int, expected: float) -> None:
    cfg = load_job(
        None,
        [
            "strategy.name=hsdp",
            f"strategy.shard_size={shard}",
            f"scaling.num_workers={world}",
            "scaling.launcher=ray",
        ],
    ).strategy
    assert strategy_class("hsdp").comm_volume(cfg, world) == pytest.approx(expected)
    # Less than fsdp2 over every rank moves: the point of it.
    assert expected < strategy_class("fsdp2").comm_volume(cfg, world)


def test_lightning_counterparts() -> None:
    counterparts = {n: cls.lightning for n, cls in strategy_classes().items()}
    assert {n: c.strategy for n, c in counterparts.items()} == {
        "single": "SingleDeviceStrategy",
        "ddp": "DDPStrategy",
        "fsdp": "FSDPStrategy",
        "fsdp2": "ModelParallelStrategy",
        "hsdp": "ModelParallelStrategy",
    }
    assert [n for n, c in counterparts.items() if c.refused] == ["hsdp"]
    # Ray Train's subclasses, which prepare_trainer validates, for ddp and fsdp only.
    assert {n: c.ray_strategy for n, c in counterparts.items() if c.ray_strategy} == {
        "ddp": "RayDDPStrategy",
        "fsdp": "RayFSDPStrategy",
    }
    assert [n for n, c in counterparts.items() if c.needs_gpu] == ["fsdp"]


def test_one_rule_splits_the_global_batch() -> None:
    assert split_batch(32, 4, 2) == 4
    assert split_batch(30, 4, 1) is None
    job = load_job(None, ["data.batch_size=24", "optim.grad_accum_steps=2"])
    assert micro_batch(job, 3) == 4
    with pytest.raises(ConfigError, match=r"data\.batch_size.*5 x 2"):
        micro_batch(job, 5)
