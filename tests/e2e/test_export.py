"""Export round trip: safetensors from a (sharded) checkpoint reproduce the recorded metrics,
in one file or split over --max-shard-size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import convoy
from convoy.checkpoint import CHECKPOINT_DIR, META_FILE
from convoy.cli import main
from convoy.config import load_job
from convoy.errors import ConfigError
from convoy.export import (
    MODEL_FILE,
    WEIGHTS_FILE,
    evaluate_exported,
    load_exported,
    read_weights,
    weight_files,
)
from convoy.outputs import CONFIG_FILE
from convoy.testing import run_on_gloo, train_on_rank

pytestmark = pytest.mark.e2e
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "digits_mlp.yaml"


def test_fsdp2_checkpoint_exports_and_reproduces_test_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = load_job(
        RECIPE,
        [
            "strategy.name=fsdp2",
            "scaling.launcher=torchrun",
            "scaling.num_workers=2",
            "run.epochs=1",  # the end of training saves: one epoch is a sharded checkpoint
            "run.name=exp",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    summary = run_on_gloo(train_on_rank, 2, job)[0]
    out = tmp_path / "exported"
    assert main(["export", str(job.run_dir), "--format", "safetensors", "--out", str(out)]) == 0
    assert (out / WEIGHTS_FILE).is_file()
    recorded = json.loads((out / MODEL_FILE).read_text())["metrics"]
    assert recorded["test/acc"] == summary["metrics"]["test/acc"]

    model, _ = load_exported(out)  # plain module, one device, no process group
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    measured = evaluate_exported(out)
    assert measured["test/acc"] == recorded["test/acc"]
    assert measured["test/samples"] == 359
    assert measured["test/loss"] == pytest.approx(recorded["test/loss"], rel=1e-6)

    # Over --max-shard-size: shards and their index, the same tensors, the same metrics.
    sharded = tmp_path / "sharded"
    export = ["export", str(job.run_dir), "--out", str(sharded), "--max-shard-size", "40KB"]
    assert main(export) == 0
    assert capsys.readouterr().out.endswith(f"to {sharded} (3 shards and their index)\n")
    assert len(weight_files(sharded)) == 3 and not (sharded / WEIGHTS_FILE).exists()
    whole, shards = load_file(out / WEIGHTS_FILE), read_weights(sharded)
    assert whole.keys() == shards.keys()
    assert all(torch.equal(whole[key], shards[key]) for key in whole)
    assert evaluate_exported(sharded) == measured

    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 0
    assert "test/acc" in capsys.readouterr().out


def test_export_of_a_run_without_checkpoints_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "nothing-here")]) == 2
    assert "has no committed checkpoints" in capsys.readouterr().err


def _as_saved_before_torch_defaults(job: dict[str, object]) -> dict[str, object]:
    """``job`` as Convoy wrote it before the optimizer fields followed torch's: adamw with
    momentum and betas both written out."""
    optim = dict(job["optim"])  # type: ignore[call-overload]
    optim.update(weight_decay=0.05, momentum=0.9, betas=[0.9, 0.999])
    return {**job, "optim": optim}


def test_a_run_saved_before_torch_defaults_exports_and_evaluates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its config.yaml, checkpoint meta.json and model.json hold momentum under adamw, which the
    optimizer never read: export and evaluate load them, and leave the saved files as they were."""
    job = load_job(
        RECIPE,
        [
            "strategy.name=single",
            "optim.weight_decay=0.05",
            "run.epochs=1",
            "run.name=old",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    test_acc = convoy.train(job).summary["metrics"]["test/acc"]
    config = job.run_dir / CONFIG_FILE
    old = _as_saved_before_torch_defaults(yaml.safe_load(config.read_text()))
    config.write_text(yaml.safe_dump(old, sort_keys=False))
    (meta_file,) = (job.run_dir / CHECKPOINT_DIR).glob(f"*/{META_FILE}")
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "job": _as_saved_before_torch_defaults(meta["job"])}))
    saved = {path: path.read_bytes() for path in (config, meta_file)}
    with pytest.raises(ConfigError, match=r"^optim\.momentum: got 0\.9; set but optim\.name is"):
        load_job(config)  # as a recipe it is still refused

    out = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export", str(job.run_dir), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("exported step_")
    optim = json.loads((out / MODEL_FILE).read_text())["job"]["optim"]
    assert (optim["momentum"], optim["betas"], optim["weight_decay"]) == (None, [0.9, 0.999], 0.05)
    assert {path: path.read_bytes() for path in saved} == saved

    description = json.loads((out / MODEL_FILE).read_text())  # an export written before
    description["job"] = _as_saved_before_torch_defaults(description["job"])
    (out / MODEL_FILE).write_text(json.dumps(description))
    assert main(["evaluate", str(out), "-o", "data.eval_batch_size=128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    acc = next(line.split() for line in lines if line.startswith("test/acc "))
    assert float(acc[1]) == pytest.approx(test_acc) and float(acc[2]) == pytest.approx(test_acc)
