"""Export round trip: safetensors from a (sharded) checkpoint reproduce the recorded metrics,
in one file or split over --max-shard-size; export and evaluate take a ranking run's best
checkpoint, else its latest, and say which and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import convoy
from convoy.checkpoint import CHECKPOINT_DIR, META_FILE, committed_checkpoints, read_meta
from convoy.cli import main
from convoy.config import load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
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
    (chosen,) = committed_checkpoints(job.run_dir)
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"convoy: exporting {chosen}, the only one; the run does not rank its checkpoints "
        "(checkpoint.keep_best: 0)",
        f"exported {chosen} to {out}",
    ]
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


def convoy_out(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """``convoy ARGS`` in this process; the lines it printed (it must succeed)."""
    capsys.readouterr()
    assert main(list(args)) == 0
    return capsys.readouterr().out.splitlines()


def measured_acc(lines: list[str]) -> float:
    """``test/acc`` as ``convoy evaluate`` printed it measured."""
    return float(next(line.split()[1] for line in lines if line.startswith("test/acc ")))


def test_export_and_evaluate_take_the_best_checkpoint_of_a_ranking_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three epochs, a checkpoint after each, ranked by val/loss with max first: val/loss
    falls as the MLP learns, so the best by that ranking is the first, not the latest (a
    real ranking whose best is not the latest, without waiting for a run to overfit). Then
    the run goes on one epoch without ranking, and the latest is taken again."""
    overrides = [
        "strategy.name=single",
        "data.batch_size=128",  # 10 steps an epoch
        "run.name=ranked",
        "run.epochs=3",
        "run.progress=off",
        f"run.storage_dir={tmp_path}",
        "checkpoint.every_epochs=1",
        "checkpoint.keep_latest=1",
        "checkpoint.keep_best=3",
        "checkpoint.best_metric=val/loss",
        "checkpoint.best_mode=max",
    ]
    job = load_job(RECIPE, overrides)
    train(job, WorkerContext())
    run = str(job.run_dir)
    found = committed_checkpoints(run)
    losses = {name: read_meta(run, name)["metrics"]["val/loss"] for name in found}
    best, latest = max(losses, key=losses.__getitem__), found[-1]
    assert len(found) == 3 and best == found[0] != latest
    why = f"the best of 3 by val/loss ({losses[best]:.4g}, highest); latest is {latest}"

    out = tmp_path / "best"
    lines = convoy_out(capsys, "export", run, "--out", str(out))
    assert lines[:2] == [f"convoy: exporting {best}, {why}", f"exported {best} to {out}"]
    described = json.loads((out / MODEL_FILE).read_text())
    assert described["checkpoint"].endswith(f"/{best}")
    assert described["metrics"]["val/loss"] == losses[best]
    lines = convoy_out(capsys, "evaluate", run)
    assert lines[0] == f"convoy: evaluating {best}, {why}"
    assert measured_acc(lines) == pytest.approx(evaluate_exported(out)["test/acc"])

    lines = convoy_out(capsys, "export", run, "--checkpoint", latest, "--out", str(tmp_path / "l"))
    assert lines[0] == f"convoy: exporting {latest}, as --checkpoint asked; latest is {latest}"

    unranked = job.model_copy(
        update={
            "run": job.run.model_copy(update={"epochs": 4}),
            "checkpoint": job.checkpoint.model_copy(update={"keep_best": 0, "keep_latest": 4}),
        }
    )
    train(unranked, WorkerContext())  # resumes: one more epoch, a fourth checkpoint
    found = committed_checkpoints(run)
    lines = convoy_out(capsys, "evaluate", run)
    assert lines[0] == (
        f"convoy: evaluating {found[-1]}, the latest of {len(found)}; the run does not rank "
        "its checkpoints (checkpoint.keep_best: 0)"
    )
