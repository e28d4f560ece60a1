"""``convoy plan --check``: the plan against torch's memory trackers on real strategy
wrappers, over a fake process group of 1, 2 and 4 ranks (one CPU process each time)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.plan import Planner, plan_job, quiet_warnings
from convoy.plan.check import check_layouts, format_check, tracked_peak

TINY_MLP = ["model.name=mlp", "model.kwargs={hidden: 64, depth: 2}", "data.batch_size=16"]
TINY_GPT = ["data.batch_size=8", "model.kwargs={dropout: 0.0, depth: 2}"]


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    yield
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [("recipes/digits_mlp.yaml", TINY_MLP), ("recipes/lm_tiny.yaml", TINY_GPT)],
)
def test_plan_matches_trackers(recipe: str, overrides: list[str]) -> None:
    job = load_job(recipe, overrides)
    with quiet_warnings():
        rows = check_layouts(job, ["single", "ddp", "fsdp2", "fsdp"], [1, 2, 4], Planner(job))
    report = format_check(rows)
    for row in rows:
        name = f"{row.layout.strategy} x {row.layout.world_size}"
        if row.layout.strategy == "fsdp":
            # FSDP1's optimizer steps views of the flat shard, without its alignment padding
            state = row.tracked.model_state
            assert (state["params"], state["grads"]) == (row.layout.params, row.layout.grads)
            assert state["optimizer"] == pytest.approx(row.layout.optimizer, rel=0.02)
            assert row.ratio is None and "not tracked" in row.tracked.note
            continue
        assert row.model_state_exact(), f"{name}: model state\n{report}"
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, f"{name}\n{report}"
        # the set-up: built on meta, laid out, each module filled in turn
        assert row.tracked.setup == pytest.approx(row.layout.setup, rel=0.1), report


def test_fsdp2_shards_what_it_tracks() -> None:
    job = load_job("recipes/digits_mlp.yaml", TINY_MLP)
    with quiet_warnings():
        two, four = tracked_peak(job, "fsdp2", 2), tracked_peak(job, "fsdp2", 4)
    assert four["Sharded Param"] < two["Sharded Param"]
    assert two["Total"] == sum(v for k, v in two.items() if k != "Total")


def test_bf16_and_accumulation_stay_within_ten_percent() -> None:
    job = load_job(
        "recipes/lm_tiny.yaml", [*TINY_GPT, "precision=bf16", "optim.grad_accum_steps=2"]
    )
    with quiet_warnings():
        rows = check_layouts(job, ["single", "fsdp2"], [1, 2], Planner(job))
    for row in rows:
        assert row.model_state_exact(), format_check(rows)
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, format_check(rows)


@pytest.mark.parametrize("mode", ["full", "every_n"])
def test_activation_checkpointing_is_planned_within_ten_percent(mode: str) -> None:
    """Checkpointed blocks keep their inputs only, and the peak moves late into backward
    (a block recomputed beside most gradients): the plan follows, and keeps less."""
    overrides = [
        "data.batch_size=8",
        "data.seq_len=128",
        "model.kwargs={dropout: 0.0, depth: 4, hidden: 64, heads: 2}",
    ]
    job = load_job(
        "recipes/lm_tiny.yaml", [*overrides, f"strategy.activation_checkpointing={mode}"]
    )
    plain = load_job("recipes/lm_tiny.yaml", overrides)
    with quiet_warnings():
        rows = check_layouts(job, ["single", "ddp", "fsdp2"], [1, 2], Planner(job))
        without = {(lay.strategy, lay.world_size): lay.peak for lay in plan_job(plain).layouts}
    for row in rows:
        assert row.model_state_exact(), format_check(rows)
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, format_check(rows)
        assert row.layout.peak < without[row.layout.strategy, row.layout.world_size]


def test_hsdp_is_planned_as_fsdp2_over_its_shard_group() -> None:
    """hsdp 2 x 2 holds what fsdp2 holds on 2 ranks (state sharded over the group of 2)
    with the micro-batch of 4 ranks; the trackers agree within 10%."""
    job = load_job(
        "recipes/lm_tiny.yaml",
        [*TINY_GPT, "strategy.name=hsdp", "strategy.shard_size=2", "scaling.num_workers=4"],
    )
    planner = Planner(job)
    with quiet_warnings():
        rows = check_layouts(job, ["hsdp"], [2, 4], planner)
    assert [row.layout.world_size for row in rows] == [4]  # 2 ranks would be one replica
    hybrid, pair = rows[0].layout, planner.layout("fsdp2", 2)
    assert (hybrid.params, hybrid.optimizer) == (pair.params, pair.optimizer)
    assert hybrid.micro_batch == pair.micro_batch // 2
    assert rows[0].model_state_exact(), format_check(rows)
    assert rows[0].ratio is not None and 0.9 <= rows[0].ratio <= 1.1, format_check(rows)
    notes = plan_job(load_job("recipes/lm_tiny.yaml", TINY_GPT), ["hsdp"]).notes
    assert any("strategy.shard_size=N" in note for note in notes)


def test_tensor_parallel_is_planned_as_one_ranks_share() -> None:
    """fsdp2 with tp 2 on 4 ranks: each rank holds half of every split linear and the whole
    rest, sharded over 2 data-parallel ranks, on their micro-batch of 2 ranks; hsdp 2 x 2
    with tp 2 on 8. The trackers, following the real DTensor layout, agree within 10%."""
    hybrid = ["strategy.name=hsdp", "strategy.shard_size=2", "scaling.num_workers=4"]
    job = load_job("recipes/lm_tiny.yaml", [*TINY_GPT, *hybrid])
    planner = Planner(job)
    with quiet_warnings():
        rows = check_layouts(job, ["fsdp2", "hsdp"], [4, 8], planner, [2])
    names = [f"{row.layout.name} x {row.layout.world_size}" for row in rows]
    # hsdp's shard group of 2 over 4 ranks with tp 2 is one replica: planned at 8 only.
    assert names == ["fsdp2+tp2 x 4", "fsdp2+tp2 x 8", "hsdp+tp2 x 8"], format_check(rows)
    for row in rows:
        assert row.model_state_exact(), format_check(rows)
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, format_check(rows)
    split, whole = rows[0].layout, planner.layout("fsdp2", 2)
    assert split.micro_batch == whole.micro_batch
    assert split.params < whole.params  # the split half of each block, the whole rest
    assert split.activations < whole.activations


def test_fsdp1_peak_is_refused_with_the_reason() -> None:
    job = load_job("recipes/digits_mlp.yaml", TINY_MLP)
    with pytest.raises(ConfigError, match="FSDP1"):
        tracked_peak(job, "fsdp", 2)


TRACKED = [("single", 1), *((s, n) for n in (1, 2, 4) for s in ("ddp", "fsdp2"))]


@pytest.mark.parametrize(
    ("recipe", "layouts"),
    [("recipes/diabetes_regression.yaml", TRACKED), ("recipes/user_module.yaml", TRACKED)],
)
def test_models_of_a_few_kib_within_ten_percent(
    recipe: str, layouts: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward transient is measured, not 2x the largest saved activation: a 32-wide
    MLP's hidden activations are not all live at once with their gradients. Under FSDP2 the
    one block has nothing to all-gather ahead in backward, and the peak is in forward, with
    the block's all-gather output kept beside its unsharded copy."""
    monkeypatch.syspath_prepend(".")  # user_module's model is examples/tumor_screening.py
    job = load_job(recipe, [])
    planner = Planner(job)
    for strategy, size in layouts:
        with quiet_warnings():
            rows = check_layouts(job, [strategy], [size], planner)
        ratio = rows[0].ratio
        assert ratio is not None and 0.9 <= ratio <= 1.1, f"{recipe}\n{format_check(rows)}"
        setup = rows[0].tracked.setup  # a user's model without init_module: built whole
        assert setup == pytest.approx(rows[0].layout.setup, rel=0.1), format_check(rows)


def test_a_hugging_face_model_is_planned_and_checked() -> None:
    """A Llama-shaped ``hf`` model: its decoder layers are fsdp2's units and its plan is
    ``transformers``' own; the trackers agree within 10%, state exactly."""
    pytest.importorskip("transformers")
    from hf_fixtures import LLAMA_TINY, hf_overrides

    job = load_job(
        "recipes/lm_llama_hf.yaml",
        ["model.kwargs={}", *hf_overrides(LLAMA_TINY), "data.batch_size=16", "data.seq_len=64"],
    )
    with quiet_warnings():
        rows = check_layouts(job, ["ddp", "fsdp2"], [2, 4], Planner(job), [1, 2])
    names = {f"{row.layout.name} x {row.layout.world_size}" for row in rows}
    assert {"ddp x 2", "fsdp2 x 2", "fsdp2+tp2 x 4"} <= names, format_check(rows)
    for row in rows:
        assert row.model_state_exact(), format_check(rows)
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, format_check(rows)


def test_a_lora_job_is_planned_and_checked() -> None:
    """LoRA on a Llama-shaped ``hf`` model: every parameter is held (sharded under fsdp2),
    gradients, optimizer state and DDP's buckets are the adapters' only; the trackers agree
    within 10%, state exactly."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from hf_fixtures import LLAMA_TINY, hf_overrides

    base = ["model.kwargs={}", *hf_overrides(LLAMA_TINY), "data.batch_size=8", "data.seq_len=32"]
    lora = "model.lora={r: 4, target_modules: [q_proj, v_proj]}"
    job = load_job("recipes/lm_llama_hf.yaml", [*base, lora])
    planner = Planner(job)
    with quiet_warnings():
        rows = check_layouts(job, ["ddp", "fsdp2"], [2], planner)
        plain = plan_job(load_job("recipes/lm_llama_hf.yaml", base), ["ddp", "fsdp2"], [2])
    full = {lay.strategy: lay for lay in plain.layouts}
    # per layer, rank 4: q_proj's A 4 x 32 and B 32 x 4, v_proj's A 4 x 32 and B 16 x 4
    assert planner.trainable_count == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    for row in rows:
        assert row.model_state_exact(), format_check(rows)
        assert row.ratio is not None and 0.9 <= row.ratio <= 1.1, format_check(rows)
        assert row.tracked.setup == pytest.approx(row.layout.setup, rel=0.1), format_check(rows)
        whole = full[row.layout.strategy]
        assert row.layout.params >= whole.params  # the base, frozen, plus the adapters
        assert row.layout.optimizer < whole.optimizer / 50
        assert row.layout.grads < whole.grads / 50
