"""Which tokenizer an ``hf`` export carries: the one that made the run's token ids."""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

import pytest

from convoy.config import load_job
from convoy.data.tokenizer import BPETokenizer
from convoy.export.consolidate import SavedCheckpoint
from convoy.export.to_hf import write_tokenizer
from convoy.outputs import TOKENIZER_FILE

transformers = pytest.importorskip("transformers", reason="the 'hf' extra is not installed")

DOCS = [topics[name] for name in sorted(topics)[:8]]
TEXT = "for x in range(3):\n    print(x)\n"


def saved(run: Path, model_folder: Path, data_shape: dict[str, int]) -> SavedCheckpoint:
    """A checkpoint's facts for an ``hf`` model from ``model_folder`` (no weights are read)."""
    job = load_job(None, ["model.name=hf", f"model.kwargs={{path: {model_folder}}}"])
    return SavedCheckpoint(run, "step_00000001", {"data_shape": data_shape}, job)


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A ``save_pretrained`` folder with its own tokenizer (a BPE of 300 tokens)."""
    folder = tmp_path / "model"
    tokenizer = BPETokenizer(DOCS, vocab_size=300).tokenizer
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return folder


def test_the_runs_own_bpe_wins_over_the_model_folders(tmp_path: Path, model_folder: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    bpe = BPETokenizer(DOCS[:4], vocab_size=260)
    (run / TOKENIZER_FILE).write_text(bpe.to_json())
    out.mkdir()
    assert write_tokenizer(saved(run, model_folder, {"vocab_size": 260}), out) == "bpe"
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded(TEXT)["input_ids"] == bpe.encode([TEXT]).tolist()


def test_a_run_without_its_own_tokenizer_carries_the_model_folders(
    tmp_path: Path, model_folder: Path
) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    out.mkdir()
    assert write_tokenizer(saved(run, model_folder, {"num_classes": 2}), out) == "model"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in model_folder.iterdir())
    ids = transformers.AutoTokenizer.from_pretrained(model_folder)(TEXT)["input_ids"]
    assert transformers.AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"] == ids


def test_no_tokenizer_anywhere_writes_none(tmp_path: Path) -> None:
    run, out, bare = tmp_path / "run", tmp_path / "out", tmp_path / "bare"
    for folder in (run, out, bare):
        folder.mkdir()
    assert write_tokenizer(saved(run, bare, {"num_classes": 2}), out) is None
    assert list(out.iterdir()) == []
