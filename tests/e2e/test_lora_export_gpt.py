"""``convoy export --format peft`` of a LoRA run on Convoy's own ``gpt`` (``model.lora`` by
gpt's module names: ``q`` and ``v`` of each block's attention).

It works as for an ``hf`` model: the adapters under PEFT's names (``base_model.model.`` +
Convoy's name, no adapter name), ``task_type`` and ``base_model_name_or_path`` empty (no
transformers class, no folder). PEFT's ``PeftModel.from_pretrained`` takes any torch module as
its base, not only a transformers one, and a gpt run's base is Convoy's model of the job in its
seeded init (``build_initial``: what the run rebuilds at every start). So the check is the one
``tests/e2e/test_lora_export.py`` makes for ``hf``, over that base: the export's keys, shapes
and values are the checkpoint's adapters, and ``from_pretrained`` gives Convoy's own logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convoy.cli import main
from convoy.config import load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.export.adapters import adapted_model
from convoy.export.consolidate import read_checkpoint
from convoy.models.registry import build_initial
from convoy.testing import parity_overrides

pytestmark = pytest.mark.e2e
peft = pytest.importorskip("peft", reason="the 'lora' extra is not installed")

DEPTH = 2
IDS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 31]])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA run of three steps on a small gpt and a few KB of text; its run directory."""
    tmp = tmp_path_factory.mktemp("gpt_lora")
    text = tmp / "text.txt"
    text.write_text((Path(__file__).read_text() * 8)[:16000])  # 4 chunks, one of val, test
    job = load_job(
        None,
        [
            "model.name=gpt",
            f"model.kwargs={{depth: {DEPTH}, hidden: 32, heads: 2, context_length: 32}}",
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
    run: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 0
    assert f"adapters to {out} for PEFT" in capfd.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q", "v"])
    assert config["task_type"] is None and config["base_model_name_or_path"] is None

    saved = read_checkpoint(run)
    ours = adapted_model(saved)
    expected = {
        "base_model.model." + name.replace(".default.", "."): tensor
        for name, tensor in ours.state_dict().items()
        if ".lora_A." in name or ".lora_B." in name
    }
    exported = load_file(str(out / "adapter_model.safetensors"))
    assert set(exported) == set(expected) and len(exported) == DEPTH * 2 * 2
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
