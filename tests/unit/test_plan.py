"""``convoy plan``: parsing its flags, and the analytic numbers on a model small enough to
count by hand."""

from __future__ import annotations

import pytest

from convoy.cli import main
from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.plan import (
    Planner,
    format_bytes,
    format_plan,
    parse_memory,
    parse_strategies,
    parse_world_sizes,
    plan_job,
    shard_numel,
)

# digits (1 x 8 x 8 -> 64 features), one block 64 -> 16, head 16 -> 10.
TINY = ["model.name=mlp", "model.kwargs={hidden: 16, depth: 1}", "data.batch_size=8"]
BLOCK = 64 * 16 + 16
HEAD = 16 * 10 + 10
PARAMS = BLOCK + HEAD  # 1210


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("24G", 24 * 10**9),
        ("81920MiB", 81920 * 2**20),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("123456", 123456),
        ("16gib", 16 * 2**30),
    ],
)
def test_memory_sizes_parse(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["80XB", "", "GiB", "-1GiB", "0", "eighty"])
def test_bad_memory_size_names_the_flag_and_the_forms(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_memory(text)
    assert info.value.field == "--gpu-memory"
    assert "80GiB" in str(info.value) and "81920MiB" in str(info.value)


def test_world_sizes_and_strategies_parse() -> None:
    assert parse_world_sizes("4,1,2,2") == [1, 2, 4]
    assert parse_strategies("fsdp,single") == ["single", "fsdp"]
    for bad in ("0,2", "a", ""):
        with pytest.raises(ConfigError, match="--world-sizes"):
            parse_world_sizes(bad)
    with pytest.raises(ConfigError, match="'fsdp3'"):
        parse_strategies("single,fsdp3")


def test_bad_flag_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "recipes/digits_mlp.yaml", "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("convoy: error: --gpu-memory: got 'lots'")


def test_shard_is_rank_zeros_rounded_up_chunk() -> None:
    import torch

    assert shard_numel(torch.empty(10, 16, device="meta"), 4) == 3 * 16
    assert shard_numel(torch.empty(16, device="meta"), 2) == 8
    assert shard_numel(torch.empty((), device="meta"), 8) == 1


def test_model_state_by_hand() -> None:
    planner = Planner(load_job("recipes/digits_mlp.yaml", TINY))
    assert planner.param_count == PARAMS
    assert planner.largest_unit == BLOCK
    single = planner.layout("single", 1)
    assert (single.params, single.grads, single.optimizer) == (4 * PARAMS, 4 * PARAMS, 8 * PARAMS)
    ddp = planner.layout("ddp", 2)
    assert ddp.comm == 4 * PARAMS  # buckets: a copy of every fp32 gradient
    assert ddp.micro_batch == 4
    fsdp2 = planner.layout("fsdp2", 2)
    # each parameter's dim 0 in halves: (16,64) -> 8x64, 16 -> 8, (10,16) -> 5x16, 10 -> 5
    shard = 8 * 64 + 8 + 5 * 16 + 5
    assert (fsdp2.params, fsdp2.grads, fsdp2.optimizer) == (4 * shard, 4 * shard, 8 * shard)
    # dims 0 (16, 10) split evenly in 2: no padding. The root (the head) reshards after
    # forward too; the one block has nothing to all-gather ahead of it in backward.
    held = {name: parts["comm"] for name, parts in fsdp2.moments.items()}
    assert held["forward (unit)"] == 4 * (HEAD + 2 * BLOCK)  # block's all-gather output + copy
    assert held["backward (in model)"] == 4 * (2 * HEAD + BLOCK)  # root and its grads; the block
    assert held["backward (unit)"] == 4 * (2 * HEAD + 2 * BLOCK)  # + the block's grads
    assert fsdp2.comm == held["backward (unit)"]


def test_fsdp2_gathers_ahead_only_where_a_unit_comes_next() -> None:
    two = Planner(
        load_job("recipes/digits_mlp.yaml", [*TINY, "model.kwargs={hidden: 16, depth: 2}"])
    )
    second = 16 * 16 + 16  # blocks 64 -> 16, 16 -> 16
    held = {name: parts["comm"] for name, parts in two.layout("fsdp2", 2).moments.items()}
    # backward through block 2: root and its grads, block 2 unsharded, block 1 all-gathered
    assert held["backward (in model)"] == 4 * (2 * HEAD + second + BLOCK)
    assert held["backward (unit)"] == 4 * (2 * HEAD + max(2 * BLOCK, 2 * second + BLOCK))
    # one rank: no all-gather output, the unsharded copies are filled from the shards
    one = {name: parts["comm"] for name, parts in two.layout("fsdp2", 1).moments.items()}
    assert one["forward (unit)"] == 4 * (HEAD + BLOCK)
    assert one["backward (in model)"] == 4 * (2 * HEAD + BLOCK)


# lm_tiny's gpt, 2 blocks of width 32, adapters of rank 2 on each attention's q and v
LORA_GPT = [
    "data.batch_size=8",
    "model.kwargs={dropout: 0.0, depth: 2, hidden: 32, heads: 2}",
    "model.lora={r: 2, target_modules: [q, v]}",
]
ADAPTERS = 2 * 2 * (2 * 32 + 32 * 2)  # blocks x modules x (A 2 x 32 + B 32 x 2)


def test_lora_holds_every_parameter_and_trains_the_adapters() -> None:
    """LoRA: the frozen base is held (sharded under fsdp2); gradients, optimizer state and
    DDP's buckets are the adapters' only, and the plan says what trains."""
    pytest.importorskip("peft")
    from convoy.plan import plan_to_dict

    job = load_job("recipes/lm_tiny.yaml", LORA_GPT)
    plan = plan_job(job, ["ddp", "fsdp2"], [2])
    whole = plan_job(load_job("recipes/lm_tiny.yaml", LORA_GPT[:2]), ["ddp"], [2])
    assert plan.trainable == ADAPTERS
    assert plan.param_count == whole.param_count + ADAPTERS
    ddp, fsdp2 = plan.layouts
    assert ddp.params == 4 * plan.param_count
    assert (ddp.grads, ddp.optimizer, ddp.comm) == (4 * ADAPTERS, 8 * ADAPTERS, 4 * ADAPTERS)
    # dim 0 in halves: A (2, 32) -> 1 x 32, B (32, 2) -> 16 x 2
    assert (fsdp2.grads, fsdp2.optimizer) == (2 * ADAPTERS, 4 * ADAPTERS)
    assert fsdp2.params < ddp.params
    text = format_plan(plan)
    assert f"{ADAPTERS} trainable" in text and "LoRA r=2 on q, v" in text
    assert f"LoRA: frozen parameters {format_bytes(4 * whole.param_count)}" in text
    data = plan_to_dict(plan)
    assert (data["trainable_parameters"], data["trainable_parameter_bytes"]) == (
        ADAPTERS,
        4 * ADAPTERS,
    )
    assert data["frozen_parameter_bytes"] == 4 * whole.param_count


def test_sgd_without_momentum_has_no_state() -> None:
    planner = Planner(load_job("recipes/digits_mlp.yaml", [*TINY, "optim.name=sgd"]))
    assert planner.layout("single", 1).optimizer == 0  # torch's default momentum: 0
    with_momentum = Planner(
        load_job("recipes/digits_mlp.yaml", [*TINY, "optim.name=sgd", "optim.momentum=0.9"])
    )
    assert with_momentum.layout("single", 1).optimizer == 4 * PARAMS


def test_activations_grow_with_the_micro_batch() -> None:
    planner = Planner(load_job("recipes/lm_tiny.yaml", ["data.batch_size=8"]))
    one, two = planner.layout("ddp", 2), planner.layout("ddp", 1)
    assert two.micro_batch == 2 * one.micro_batch
    assert two.activations == pytest.approx(2 * one.activations, rel=0.02)
    # the logits (batch x seq x vocab, fp32) are the largest activation: backward needs 2x
    logits = 4 * 8 * 128 * 2048
    assert two.backward_temp == 2 * logits


def test_smallest_fit_takes_fewest_workers_then_the_simplest_strategy() -> None:
    job = load_job("recipes/digits_mlp.yaml", TINY)
    everything = plan_job(job, world_sizes=[1, 2], gpu_memory=2**30)
    best = everything.smallest_fit()
    assert best is not None and (best.strategy, best.world_size) == ("single", 1)
    sharded = plan_job(job, ["fsdp", "fsdp2"], [1, 2], gpu_memory=2**30)
    best = sharded.smallest_fit()
    assert best is not None and (best.strategy, best.world_size) == ("fsdp2", 1)
    nothing = plan_job(job, world_sizes=[1], gpu_memory=1000)
    assert nothing.smallest_fit() is None
    assert "smallest layout that fits 1000 B: none" in format_plan(nothing)


def test_world_sizes_that_do_not_split_the_batch_are_left_out() -> None:
    plan = plan_job(load_job("recipes/digits_mlp.yaml", TINY), ["ddp"], [1, 3])
    assert [layout.world_size for layout in plan.layouts] == [1]
    assert any("world size 3" in note for note in plan.notes)


def test_a_model_that_cannot_be_built_on_meta_warns_and_builds_for_real(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = tmp_path / "reads_values.py"  # type: ignore[operator]
    module.write_text(
        "import torch\n"
        "def build(num_classes=10, in_channels=1, image_size=8):\n"
        "    layer = torch.nn.Linear(in_channels * image_size**2, num_classes)\n"
        "    assert float(layer.weight.abs().sum()) >= 0  # needs values: not on meta\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), layer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    job = load_job("recipes/digits_mlp.yaml", ["model.name=reads_values:build", "model.kwargs={}"])
    with pytest.warns(UserWarning, match="cannot be built on the meta device"):
        planner = Planner(job)
    assert planner.param_count == 64 * 10 + 10
    assert planner.layout("single", 1).params == 4 * (64 * 10 + 10)


def test_set_up_of_a_model_built_on_meta_by_hand() -> None:
    """The rank's parameters, plus one module's full values (the block's linear) while it
    is filled; FSDP1 materializes and flattens a whole unit before sharding it."""
    planner = Planner(load_job("recipes/digits_mlp.yaml", TINY))
    assert planner.whole_build_reason is None  # MLP has init_module
    single, fsdp2 = planner.layout("single", 1), planner.layout("fsdp2", 2)
    assert (single.setup, single.whole_build) == (4 * (PARAMS + BLOCK), 0)
    shard = 8 * 64 + 8 + 5 * 16 + 5
    assert fsdp2.moments["set-up"]["params"] == 4 * shard
    assert fsdp2.setup == 4 * (shard + BLOCK)
    ddp = planner.layout("ddp", 2)
    assert ddp.moments["set-up"]["comm"] == 4 * PARAMS  # its buckets, more than a module
    fsdp = planner.layout("fsdp", 2)  # block then root: 2 x the unit beside its shard
    block_shard, head_shard = (BLOCK + 1) // 2, HEAD // 2
    assert fsdp.setup == 4 * max(2 * BLOCK + block_shard, block_shard + 2 * HEAD + head_shard)
    assert not any("whole model" in note for note in plan_job(planner.job, planner=planner).notes)


def test_set_up_of_a_model_built_whole_says_so(
    tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory without init_module is built whole on every rank: sharded, its units are
    split in turn, each shard made before the unit is freed; the plan says so."""
    module = tmp_path / "whole_mlp.py"  # type: ignore[operator]
    module.write_text(
        "import torch\n"
        "def build(num_classes=10, in_channels=1, image_size=8):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16),\n"
        "                               torch.nn.ReLU(), torch.nn.Linear(16, 10))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    job = load_job("recipes/digits_mlp.yaml", ["model.name=whole_mlp:build", "model.kwargs={}"])
    planner = Planner(job)
    assert planner.whole_build_reason == "Sequential has no init_module(module)"
    assert planner.layout("single", 1).setup == 4 * PARAMS
    fsdp2 = planner.layout("fsdp2", 2)  # one unit (no blocks): whole, then its shard
    assert fsdp2.whole_build == 4 * PARAMS
    assert fsdp2.setup == 4 * (PARAMS + 8 * 64 + 8 + 5 * 16 + 5)
    notes = plan_job(job, world_sizes=[2], planner=planner).notes
    assert f"fsdp2, fsdp: every rank builds the whole model ({4 * PARAMS / 1024:.3g} KiB) " in (
        "\n".join(notes)
    )
