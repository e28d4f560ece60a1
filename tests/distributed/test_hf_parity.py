"""Hugging Face models under every strategy: the same losses as one process (gloo, fp32).

A Llama-shaped model (grouped-query attention, RMSNorm, rotary) and a GPT-2-shaped one (tied
head, fused qkv), both built by ``transformers`` from a config, train on the bundled text
(byte tokens). ``single`` on the global batch == ``ddp`` / ``fsdp2`` on 2 ranks (Llama:
``fsdp`` too) == ``hsdp`` 2 x 2 == ``fsdp2`` + tensor parallel 2 (Llama: ``transformers``' own
plan; GPT-2 has none and is refused in one line, see tests/unit/test_hf_model.py). Activation checkpointing and
``run.compile`` per block leave the losses unchanged, and resume is bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.multiprocessing.spawn import ProcessException

from convoy.checkpoint import committed_checkpoints
from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.outputs import read_metrics
from convoy.testing import parity_overrides, run_on_gloo, train_on_rank
from hf_fixtures import BYTE_TEXT_LM, GPT2_TINY, LLAMA_TINY, hf_overrides

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed
STEPS = 6
MODELS = {"llama": LLAMA_TINY, "gpt2": GPT2_TINY}


def hf_job(tmp_path: Path, model: str, strategy: str, workers: int, *extra: str) -> Job:
    return load_job(
        None,
        [
            *hf_overrides(MODELS[model]),
            *BYTE_TEXT_LM,
            "optim.grad_clip_norm=1.0",
            *parity_overrides(tmp_path, strategy, workers, STEPS, 3, f"{model}-{strategy}"),
            *extra,
        ],
    )


def step_losses(job: Job) -> list[float]:
    return [r["train/loss"] for r in read_metrics(job.run_dir) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Each model's step losses in one process."""
    losses = {}
    for model in MODELS:
        job = hf_job(tmp_path_factory.mktemp(model), model, "single", 1)
        train(job, WorkerContext())
        losses[model] = step_losses(job)
        assert len(losses[model]) == STEPS and losses[model][0] > losses[model][-1]
    return losses


@pytest.mark.parametrize(
    ("model", "strategy", "workers", "extra"),
    [
        ("llama", "ddp", 2, ()),
        # ("llama", "fsdp2", 2): test_llama_fsdp2_losses_match_single, on the shared run
        ("llama", "fsdp", 2, ()),
        ("llama", "hsdp", 4, ("strategy.shard_size=2",)),
        ("llama", "fsdp2", 4, ("strategy.tp_size=2",)),
        ("gpt2", "ddp", 2, ()),
        ("gpt2", "fsdp2", 2, ()),
        ("gpt2", "hsdp", 4, ("strategy.shard_size=2",)),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, tuple) else str(value),
)
def test_losses_match_single(
    model: str,
    strategy: str,
    workers: int,
    extra: tuple[str, ...],
    single: dict[str, list[float]],
    tmp_path: Path,
) -> None:
    job = hf_job(tmp_path, model, strategy, workers, *extra)
    summaries = run_on_gloo(train_on_rank, workers, job)
    assert step_losses(job) == pytest.approx(single[model], rel=1e-5)
    assert all(summary["metrics"] == summaries[0]["metrics"] for summary in summaries)


SAVING = ("checkpoint.every_steps=3", "run.collective_timeout_s=60")


@pytest.fixture(scope="module")
def llama_fsdp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, list[dict]]:
    """llama under fsdp2 x 2, saving every 3 steps, once for the module: its job and each
    rank's summary. The parity test compares its losses with the single process's, the
    resume test its losses with a resumed run's (saving changes no loss)."""
    job = hf_job(tmp_path_factory.mktemp("straight"), "llama", "fsdp2", 2, *SAVING)
    return job, run_on_gloo(train_on_rank, 2, job)


def test_llama_fsdp2_losses_match_single(
    llama_fsdp2: tuple[Job, list[dict]], single: dict[str, list[float]]
) -> None:
    job, summaries = llama_fsdp2
    assert step_losses(job) == pytest.approx(single["llama"], rel=1e-5)
    assert all(summary["metrics"] == summaries[0]["metrics"] for summary in summaries)


def test_fsdp2_units_are_the_decoder_layers(tmp_path: Path) -> None:
    """FSDP2 shards each LlamaDecoderLayer as its own unit (found from _no_split_modules)."""
    from convoy.models.registry import build_model

    model = build_model("hf", {"config": LLAMA_TINY}, {"vocab_size": 256})
    assert [type(block).__name__ for block in model.blocks] == ["LlamaDecoderLayer"] * 2
    # Not registered twice: the checkpoint's keys are the Hub's, under ``model.``.
    assert all(
        key.startswith("model.model.") or key.startswith("model.lm_head")
        for key in model.state_dict()
    )


def test_checkpointed_and_compiled_blocks_keep_the_losses(
    single: dict[str, list[float]], tmp_path: Path
) -> None:
    """Each decoder layer compiled (one graph) and checkpointed, under fsdp2 x 2."""
    blocks = ("run.compile=true", "strategy.activation_checkpointing=full")
    job = hf_job(tmp_path, "llama", "fsdp2", 2, *blocks)
    summaries = run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job) == pytest.approx(single["llama"], rel=1e-5)
    assert summaries[0]["compile_seconds"] > 0


def test_resume_is_bitwise(llama_fsdp2: tuple[Job, list[dict]], tmp_path: Path) -> None:
    """fsdp2 x 2: a run that fails after step 4 and resumes from its step-3 checkpoint gives
    the straight run's losses from step 4 on, exactly."""
    expected = step_losses(llama_fsdp2[0])
    faulty = ("fault.kind=raise", "fault.at_step=4", "fault.rank=1")
    stopped = hf_job(tmp_path / "stopped", "llama", "fsdp2", 2, *SAVING, *faulty)
    with pytest.raises(ProcessException):
        run_on_gloo(train_on_rank, 2, stopped)
    assert committed_checkpoints(stopped.run_dir) == ["step_00000003"]
    summary = run_on_gloo(train_on_rank, 2, stopped)[0]
    assert summary["resumed_from"].endswith("step_00000003")
    records = [r for r in read_metrics(stopped.run_dir) if r["kind"] == "step"]
    resumed = {r["step"]: r["train/loss"] for r in records[4:]}  # the second attempt's
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[step] == expected[step - 1] for step in resumed), (resumed, expected)
