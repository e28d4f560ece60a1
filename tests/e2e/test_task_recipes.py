"""The shipped recipes beyond images: sensor activities and regression under Ray (ddp x 2)
reach their bars; the language model trains, exports, and evaluates to bits per byte."""

from __future__ import annotations

from pathlib import Path

import pytest

import convoy
from convoy.checkpoint import committed_checkpoints, read_meta
from convoy.config import load_job
from convoy.errors import ConvoyError
from convoy.export import evaluate_exported, export_checkpoint

pytestmark = pytest.mark.e2e
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe(name: str, storage: Path, *overrides: str):  # type: ignore[no-untyped-def]
    return load_job(
        RECIPES / name, [f"run.storage_dir={storage}", "run.progress=plain", *overrides]
    )


@pytest.mark.ray
def test_sensor_activities_over_ninety_percent(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("sktime", reason="the 'sensors' extra is not installed")
    job = recipe("sensor_basicmotions.yaml", tmp_path, "scaling.cpus_per_worker=0.5")
    metrics = convoy.train(job).summary["metrics"]
    assert metrics["test/samples"] == 40  # the official BasicMotions test file, every series once
    assert metrics["test/acc"] >= 0.9


@pytest.mark.ray
def test_diabetes_regression_explains_the_test_set(tmp_path: Path, ray_session) -> None:  # type: ignore[no-untyped-def]
    job = recipe("diabetes_regression.yaml", tmp_path, "scaling.cpus_per_worker=0.5")
    metrics = convoy.train(job).summary["metrics"]
    assert metrics["test/samples"] == 88
    # Ordinary least squares on the same split reaches R² 0.35 on test.
    assert metrics["test/r2"] > 0.3
    assert metrics["test/rmse"] ** 2 == pytest.approx(metrics["test/loss"], rel=1e-6)


def test_language_model_exports_and_evaluates_bits_per_byte(tmp_path: Path) -> None:
    """A short lm_tiny under torchrun: bits per byte and gzip's beside them, on val and test;
    the export evaluates to the recorded test metrics in one process."""
    pytest.importorskip("tokenizers", reason="the 'text' extra is not installed")
    job = recipe(
        "lm_tiny.yaml",
        tmp_path,
        "scaling.launcher=torchrun",
        "run.epochs=1",
        "run.max_steps=12",
        "checkpoint.every_epochs=1",
    )
    result = convoy.train(job)
    summary = result.summary
    metrics, references = summary["metrics"], summary["reference_metrics"]
    assert summary["tokens_per_second"] > 0
    assert set(references) == {"val/gzip_bpb", "test/gzip_bpb"}
    for split in ("val", "test"):
        assert 0 < metrics[f"{split}/bpb"] < 8
        assert metrics[f"{split}/ppl"] == pytest.approx(2.718281828 ** metrics[f"{split}/loss"])
    latest = committed_checkpoints(result.run_dir)[-1]
    recorded = read_meta(result.run_dir, latest)["metrics"]
    measured = evaluate_exported(export_checkpoint(result.run_dir, tmp_path / "export", latest))
    for key in ("test/loss", "test/bpb", "test/ppl", "test/tokens"):
        assert measured[key] == pytest.approx(recorded[key], rel=1e-5)
    assert measured["test/gzip_bpb"] == references["test/gzip_bpb"]
    # The export carries the trained tokenizer: text in, the model's token ids, text out.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tmp_path / "export" / "tokenizer.json"))
    sentence = "The for statement iterates over the items of any sequence."
    ids = tokenizer.encode(sentence).ids
    assert (
        len(ids) < len(sentence)
        and max(ids) < read_meta(result.run_dir, latest)["data_shape"]["vocab_size"]
    )
    assert tokenizer.decode(ids) == sentence
    # Other text would retrain the tokenizer: evaluating on it is refused, not silently off.
    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"Paragraph {i}: " + "other words here. " * 40 for i in range(30)))
    with pytest.raises(ConvoyError, match="different splits than the model was trained on"):
        evaluate_exported(tmp_path / "export", [f"data.path={other}"])
