"""LoRA through PEFT (``model.lora``) under every data-parallel strategy (gloo, fp32).

A Llama-shaped ``hf`` model built from a config gets adapters on ``q_proj`` and ``v_proj``,
the rest frozen before any strategy lays it out. ``single`` on the global batch ==
``ddp`` / ``fsdp2`` on 2 ranks == ``hsdp`` 2 x 2 (1e-5). What trains is what PEFT's own
``get_peft_model`` trains; checkpoints hold the adapters and their optimizer state only; a run
stopped and resumed gives bitwise the losses of one that was not.

And on Convoy's own ``gpt``, by its module names (``q``, ``v``): ``convoy export --format peft``
writes the adapters as for ``hf`` (tests/e2e/test_lora_export.py), with no ``task_type`` and no
folder. PEFT's ``PeftModel.from_pretrained`` takes any torch module as its base, and a gpt
run's base is Convoy's model of the job in its seeded init (``build_initial``, rebuilt at every
start): loaded over it, the export gives Convoy's own logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.multiprocessing.spawn import ProcessException

from convoy.checkpoint import committed_checkpoints
from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.errors import ConfigError
from convoy.outputs import read_metrics
from convoy.testing import parity_overrides, run_on_gloo, train_on_rank
from hf_fixtures import BYTE_TEXT_LM, LLAMA_TINY, hf_overrides

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
            *BYTE_TEXT_LM,
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


# --- a gpt run's adapters, exported for PEFT --------------------------------------------------

GPT_DEPTH = 2
IDS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 31]])


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run of three steps on a small gpt and a few KB of text; its run directory."""
    tmp = tmp_path_factory.mktemp("gpt_lora")
    text = tmp / "text.txt"
    text.write_text((Path(__file__).read_text() * 8)[:16000])  # 4 chunks, one of val, test
    job = load_job(
        None,
        [
            "model.name=gpt",
            f"model.kwargs={{depth: {GPT_DEPTH}, hidden: 32, heads: 2, context_length: 32}}",
            "model.lora={r: 4, alpha: 8, target_modules: [q, v]}",
            "task.name=language_modeling",
            "data.name=text",
            f"data.path={text}",
            "data.tokenizer=bytes",
            "data.seq_len=32",
            "data.batch_size=8",
            "data.val_fraction=0.2",
            "data.test_fraction=0.2",
            "optim.lr=1e-2",
            *parity_overrides(tmp, "single", 1, 3, 3, "run"),
            "checkpoint.every_steps=3",
        ],
    )
    train(job, WorkerContext())
    return Path(job.run_dir)


def test_a_gpt_runs_adapters_load_with_peft_over_its_base_to_convoys_logits(
    gpt_run: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    import peft
    from safetensors.torch import load_file

    from convoy.cli import main
    from convoy.export.adapters import adapted_model
    from convoy.export.consolidate import read_checkpoint
    from convoy.models.registry import build_initial

    out = tmp_path / "adapters"
    assert main(["export", str(gpt_run), "--format", "peft", "--out", str(out)]) == 0
    assert f"adapters to {out} for PEFT" in capfd.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q", "v"])
    assert config["task_type"] is None and config["base_model_name_or_path"] is None

    saved = read_checkpoint(gpt_run)
    ours = adapted_model(saved)
    expected = {
        "base_model.model." + name.replace(".default.", "."): tensor
        for name, tensor in ours.state_dict().items()
        if ".lora_A." in name or ".lora_B." in name
    }
    exported = load_file(str(out / "adapter_model.safetensors"))
    assert set(exported) == set(expected) and len(exported) == GPT_DEPTH * 2 * 2
    assert "base_model.model.blocks.0.attn.q.lora_A.weight" in exported
    for name, tensor in exported.items():
        assert tensor.shape == expected[name].shape and torch.equal(tensor, expected[name])

    job = saved.job
    base = build_initial(job.model.name, job.model.kwargs, saved.meta["data_shape"], job.run.seed)
    with torch.no_grad():
        untrained = base.eval()(IDS)
    loaded = peft.PeftModel.from_pretrained(base, out).eval()  # adapts base in place
    assert set(peft.get_peft_model_state_dict(loaded)) == set(exported)
    with torch.no_grad():
        theirs, mine = loaded(IDS), ours(IDS)
    assert not torch.allclose(theirs, untrained, atol=1e-4)  # the adapters trained
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
