"""``convoy export`` of a LoRA run: the adapters as PEFT saves them, and the merged model.

A tiny Llama saved in a folder is fine-tuned with LoRA adapters (``model.lora`` on
``q_proj`` and ``v_proj``) for a few steps in this process (``single``); its checkpoint holds
the adapters only. ``--format peft`` (the command a user types, through ``cli.main``) writes
``adapter_config.json`` + ``adapter_model.safetensors`` under PEFT's names, which
``PeftModel.from_pretrained`` loads over the folder's model; ``--format hf --merge`` writes
the merged model, which ``AutoModelForCausalLM.from_pretrained`` loads. Both give the logits
of Convoy's own model (the folder's base, the checkpoint's adapters) to 1e-5. The flags that
do not fit a run are refused in one line each.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from convoy.cli import main
from convoy.config import Job, load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.errors import ConvoyError
from convoy.export import export_hf, export_peft
from convoy.export.adapters import adapted_model
from convoy.export.consolidate import read_checkpoint
from convoy.testing import parity_overrides
from hf_fixtures import BYTE_TEXT_LM, saved_llama

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
peft = pytest.importorskip("peft", reason="the 'lora' extra is not installed")

LORA = "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"
IDS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250, 11, 64, 128, 31]])


def lora_job(tmp: Path, folder: Path, *extra: str, name: str = "run") -> Job:
    """The data and job of ``tests/distributed/test_lora.py``, the model a saved folder."""
    return load_job(
        None,
        [
            "model.name=hf",
            f"model.kwargs.path={folder}",
            *BYTE_TEXT_LM,
            *parity_overrides(tmp, "single", 1, 3, 3, name),
            "checkpoint.every_steps=3",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_llama(tmp_path_factory.mktemp("llama") / "llama")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, folder: Path) -> Path:
    """A LoRA run of three steps on the folder's Llama; its run directory."""
    job = lora_job(tmp_path_factory.mktemp("lora"), folder, LORA)
    train(job, WorkerContext())
    return Path(job.run_dir)


@pytest.fixture(scope="module")
def ours(run: Path) -> torch.Tensor:
    """The logits of Convoy's own model: the folder's base, the checkpoint's adapters."""
    model = adapted_model(read_checkpoint(run))
    with torch.no_grad():
        logits: torch.Tensor = model(IDS)
    return logits


def test_the_adapters_load_with_peft_to_convoys_logits(
    run: Path, folder: Path, ours: torch.Tensor, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--format", "peft", "--out", str(out)]) == 0
    assert f"adapters to {out} for PEFT" in capfd.readouterr().out
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(folder)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    names = set(load_file(str(out / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert len(names) == 8 and not any(".default." in n for n in names)

    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        untrained = base(input_ids=IDS).logits
    loaded = peft.PeftModel.from_pretrained(base, out).eval()  # adapts base in place
    assert set(peft.get_peft_model_state_dict(loaded)) == names
    with torch.no_grad():
        theirs = loaded(input_ids=IDS).logits
    assert not torch.allclose(theirs, untrained, atol=1e-4)  # the adapters trained
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_merged_model_loads_with_transformers_to_convoys_logits(
    run: Path, ours: torch.Tensor, tmp_path: Path
) -> None:
    out = export_hf(run, tmp_path / "merged", merge=True)
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        theirs = merged(input_ids=IDS).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_flags_that_do_not_fit_the_run_are_one_line(
    run: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConvoyError, match="add --merge") as caught:
        export_hf(run, tmp_path / "unmerged")
    assert "--format peft" in str(caught.value) and "\n" not in str(caught.value)
    plain = without_lora(run, tmp_path / "plain")
    with pytest.raises(ConvoyError, match=r"^--format: got 'peft'; run .* has no model\.lora"):
        export_peft(plain, tmp_path / "none")
    with pytest.raises(ConvoyError, match=r"^--merge: run .* has no model\.lora adapters"):
        export_hf(plain, tmp_path / "none", merge=True)
    capfd.readouterr()
    assert main(["export", str(run), "--format", "peft", "--merge"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("convoy: error: --merge: ") and err.count("\n") == 1


def without_lora(run: Path, to: Path) -> Path:
    """A copy of the LoRA run whose checkpoints' meta say its job had no ``model.lora``: a run
    without adapters, as far as an export reads before it refuses."""
    shutil.copytree(run, to)
    for meta in to.glob("checkpoints/*/meta.json"):
        saved = json.loads(meta.read_text())
        saved["job"]["model"]["lora"] = None
        meta.write_text(json.dumps(saved))
    return to
