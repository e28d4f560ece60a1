"""LoRA through PEFT (``model.lora``) under every data-parallel strategy (gloo, fp32).

A Llama-shaped ``hf`` model built from a config gets adapters on ``q_proj`` and ``v_proj``,
the rest frozen before any strategy lays it out. ``single`` on the global batch ==
``ddp`` / ``fsdp2`` on 2 ranks == ``hsdp`` 2 x 2 (1e-5). What trains is what PEFT's own
``get_peft_model`` trains; checkpoints hold the adapters and their optimizer state only; a run
stopped and resumed gives bitwise the losses of one that was not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.multiprocessing.spawn import ProcessException

from convoy.checkpoint import committed_checkpoints
from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.errors import ConfigError
from convoy.outputs import read_metrics
from convoy.testing import parity_overrides, run_on_gloo, train_on_rank
from hf_fixtures import LLAMA_TINY, hf_overrides

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.distributed
STEPS = 6
LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"


def lora_job(tmp: Path, strategy: str, workers: int, *extra: str, name: str = "run") -> Job:
    return load_job(
        None,
        [
            *hf_overrides(LLAMA_TINY),
            LORA,
            "task.name=language_modeling",
            "data.name=text",
            "data.tokenizer=bytes",
            "data.seq_len=32",
            "data.batch_size=8",
            "data.eval_batch_size=64",
            "data.train_size=64",
            "optim.lr=1e-2",
            "optim.warmup_steps=1",
            *parity_overrides(tmp, strategy, workers, STEPS, 3, name),
            "checkpoint.every_steps=3",
            *extra,
        ],
    )


def step_losses(job: Job) -> list[float]:
    return [r["train/loss"] for r in read_metrics(job.run_dir) if r["kind"] == "step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Job:
    job = lora_job(tmp_path_factory.mktemp("single"), "single", 1)
    train(job, WorkerContext())
    losses = step_losses(job)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return job


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """fsdp2 x 2, straight through: its parity with single, and the reference of resume."""
    job = lora_job(tmp_path_factory.mktemp("fsdp2"), "fsdp2", 2)
    run_on_gloo(train_on_rank, 2, job)
    return job


def test_fsdp2_losses_match_single(fsdp2: Job, single: Job) -> None:
    assert step_losses(fsdp2) == pytest.approx(step_losses(single), rel=1e-5)


@pytest.mark.parametrize(
    ("strategy", "workers", "extra"),
    [("ddp", 2, ()), ("hsdp", 4, ("strategy.shard_size=2",))],
    ids=["ddp", "hsdp"],
)
def test_losses_match_single(
    strategy: str, workers: int, extra: tuple[str, ...], single: Job, tmp_path: Path
) -> None:
    job = lora_job(tmp_path, strategy, workers, *extra)
    run_on_gloo(train_on_rank, workers, job)
    assert step_losses(job) == pytest.approx(step_losses(single), rel=1e-5)


def test_what_trains_is_what_peft_trains(single: Job) -> None:
    import peft
    import transformers

    config = transformers.AutoConfig.for_model(**{**LLAMA_TINY, "vocab_size": 256})
    reference = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_config(config),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainable, total = reference.get_nb_trainable_parameters()
    from convoy.models.lora import trainable_counts
    from convoy.models.registry import build_initial

    ours = build_initial("hf", {"config": LLAMA_TINY}, {"vocab_size": 256}, 0, single.model.lora)
    assert trainable_counts(ours) == (trainable, total)


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(single: Job) -> None:
    name = committed_checkpoints(single.run_dir)[-1]
    metadata = dcp.FileSystemReader(str(single.run_dir / "checkpoints" / name)).read_metadata()
    saved = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    optim = {k for k in metadata.state_dict_metadata if k.startswith("optim.state.")}
    assert optim and all(".lora_" in k for k in optim)
    adapters = sum(m.size.numel() for k, m in metadata.state_dict_metadata.items() if k in saved)
    # two layers: q 32 -> 32 (A 4 x 32, B 32 x 4), v 32 -> 16 (GQA: A 4 x 32, B 16 x 4)
    assert adapters == 2 * (4 * 32 + 32 * 4) + 2 * (4 * 32 + 16 * 4)


def test_a_killed_run_resumes_bitwise(fsdp2: Job, tmp_path: Path) -> None:
    """fsdp2 x 2 failing after step 4 (step 3 its last checkpoint), then run again: steps
    4-6 are the straight run's, bit for bit (the frozen base rebuilt from the seed, the
    adapters and Adam's state read back)."""
    faults = ("fault.kind=raise", "fault.at_step=4", "fault.rank=1")  # the first attempt's
    job = lora_job(tmp_path, "fsdp2", 2, *faults)
    with pytest.raises(ProcessException):
        run_on_gloo(train_on_rank, 2, job)
    assert committed_checkpoints(job.run_dir) == ["step_00000003"]
    run_on_gloo(train_on_rank, 2, job)
    assert step_losses(job)[-3:] == step_losses(fsdp2)[-3:]


def test_bad_lora_settings_are_one_line_before_any_worker(tmp_path: Path) -> None:
    from convoy.preflight import preflight

    nothing = lora_job(tmp_path, "single", 1, "model.lora.target_modules=[qproj]")
    with pytest.raises(ConfigError, match="q_proj") as caught:
        preflight(nothing)
    assert "model.lora.target_modules" in str(caught.value) and "\n" not in str(caught.value)
    split = lora_job(tmp_path, "fsdp2", 4, "strategy.tp_size=2")
    with pytest.raises(ConfigError, match=r"strategy\.tp_size"):
        preflight(split)
