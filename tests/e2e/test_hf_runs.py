"""``convoy train`` on Hugging Face folders, a few steps each on the local launcher: a model
folder's own tokenizer (trained, exported and evaluated; a vocabulary too large for the model
refused in one line), and datasets saved with ``datasets`` for each built-in task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from convoy.checkpoint import committed_checkpoints, read_meta
from convoy.cli import main
from convoy.export import evaluate_exported, export_checkpoint
from convoy.outputs import CONFIG_FILE, TOKENIZER_FILE, read_summary
from hf_fixtures import corpus, saved_labelled_dataset, saved_llama, saved_text_dataset

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
pytest.importorskip("datasets", reason="the 'hf' extra is not installed")

LLAMA_RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "lm_llama_hf.yaml")
SHORT = [
    "scaling.launcher=local",
    "scaling.num_workers=1",
    "strategy={name: single}",
    "run.epochs=1",
    "run.max_steps=3",
    "run.progress=off",
    "data.batch_size=8",
    "data.eval_batch_size=64",
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-runs")
    (root / "corpus.txt").write_text("\n\n".join(corpus(12)))
    return {
        "llama": saved_llama(root / "llama"),
        "corpus": root / "corpus.txt",
        "text": saved_text_dataset(root / "text"),
        "rows": saved_labelled_dataset(root / "rows"),
    }


def train(recipe: str | None, storage: Path, name: str, *overrides: str) -> int:
    """``convoy train`` in this process; its exit code."""
    settings = [*SHORT, f"run.storage_dir={storage}", f"run.name={name}", *overrides]
    return main(["train", *([recipe] if recipe else []), *(w for o in settings for w in ("-o", o))])


def same_json(a: str, b: str) -> bool:
    return bool(json.loads(a) == json.loads(b))


def test_a_model_folders_tokenizer_trains_exports_and_evaluates(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """The text source with the Llama folder's tokenizer: the data's vocabulary is the
    tokenizer's, the run saves that tokenizer and says where it came from, and the export
    carries it and evaluates to the recorded metrics."""
    from tokenizers import Tokenizer

    llama = folders["llama"]
    code = train(
        LLAMA_RECIPE,
        tmp_path,
        "lm",
        f"model.kwargs={{path: {llama}}}",
        "data.tokenizer=model",
        f"data.path={folders['corpus']}",
        "data.seq_len=32",
        "checkpoint.every_epochs=1",
    )
    assert code == 0
    run = tmp_path / "lm"
    folder_tokenizer = (llama / "tokenizer.json").read_text()
    latest = committed_checkpoints(run)[-1]
    meta = read_meta(run, latest)
    size = Tokenizer.from_file(str(llama / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert meta["data_shape"]["vocab_size"] == size == 320
    assert same_json((run / TOKENIZER_FILE).read_text(), folder_tokenizer)
    recorded = yaml.safe_load((run / CONFIG_FILE).read_text())["data"]
    assert (recorded["tokenizer"], recorded["tokenizer_path"]) == ("model", str(llama))
    assert 0 < read_summary(run)["metrics"]["val/bpb"] < 16
    export = export_checkpoint(run, tmp_path / "export", latest)
    assert same_json((export / TOKENIZER_FILE).read_text(), folder_tokenizer)
    measured = evaluate_exported(export)
    assert measured["test/loss"] == pytest.approx(meta["metrics"]["test/loss"], rel=1e-5)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = saved_llama(tmp_path / "small", vocab_size=280, tokenizer_vocab=320)
    code = train(
        LLAMA_RECIPE,
        tmp_path,
        "too-big",
        f"model.kwargs={{path: {small}}}",
        "data.tokenizer=model",
        f"data.path={folders['corpus']}",
        "data.seq_len=32",
    )
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        f"convoy: error: model.kwargs.path: got '{small}'; the model's vocabulary has 280 "
        "tokens and the data's tokenizer 320"
    )
    assert not (tmp_path / "too-big").exists()  # refused before any worker


@pytest.mark.parametrize(
    ("name", "overrides", "metric"),
    [
        ("text", ["task.name=language_modeling", "data.seq_len=32"], "test/bpb"),
        (
            "classes-from-features",
            ["task.name=classification", "model.name=tabular_mlp",
             "data.feature_columns=[a, b, pair]"],
            "test/acc",
        ),
        (
            "values-from-features",
            ["task.name=regression", "model.name=tabular_mlp", "data.label_column=score",
             "data.feature_columns=[a, b, pair]"],
            "test/r2",
        ),
        ("classes-from-text", ["task.name=classification", "data.seq_len=16"], "test/acc"),
    ],
)  # fmt: skip
def test_a_saved_dataset_trains_each_task(
    folders: dict[str, Path], tmp_path: Path, name: str, overrides: list[str], metric: str
) -> None:
    """Text through the Llama folder (its tokenizer, a causal LM or a sequence-classification
    head), numeric features through ``tabular_mlp``."""
    dataset = folders["text"] if name == "text" else folders["rows"]
    llama = [
        "model.name=hf",
        f"model.kwargs={{path: {folders['llama']}}}",
        "data.tokenizer=model",
    ]
    settings = [
        *(llama if "features" not in name else []),
        "data.name=hf_dataset",
        f"data.path={dataset}",
        *overrides,
    ]
    assert train(None, tmp_path, name, *settings) == 0
    summary = read_summary(tmp_path / name)
    assert metric in summary["metrics"]
    samples = summary["metrics"].get("test/samples")
    assert name == "text" or samples == 24  # 120 rows, test_fraction 0.2
