"""Hugging Face data: ``data.tokenizer: model`` (a model folder's tokenizer, its whole
vocabulary and the bytes each token stands for) and ``data.name: hf_dataset`` (datasets saved
with ``datasets``: text, classes, values), with the one-line errors of bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from convoy.cli import main
from convoy.config import DataConfig, load_job
from convoy.data.hf_datasets import load_hf_dataset
from convoy.data.registry import check_dataset, load_splits
from convoy.data.tokenizer import ByteTokenizer, ModelTokenizer
from convoy.errors import ConfigError
from hf_fixtures import (
    SPECIAL,
    corpus,
    labelled_rows,
    save_tokenizer,
    saved_labelled_dataset,
    saved_llama,
    saved_text_dataset,
)
from task_data_helpers import write_text_shards

pytest.importorskip("transformers", reason="the 'hf' extra is not installed")
pytest.importorskip("datasets", reason="the 'hf' extra is not installed")

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "lm_llama_hf.yaml")
FEATURES = ["a", "b", "pair"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama folder with its tokenizer, one without, a tokenizer with an added token, a
    corpus file, and saved datasets."""
    root = tmp_path_factory.mktemp("hf")
    (root / "corpus.txt").write_text("\n\n".join(corpus()))
    return {
        "llama": saved_llama(root / "llama"),
        "bare": saved_llama(root / "bare", with_tokenizer=False),
        "added": save_tokenizer(root / "added", 300, added=("<extra_0>",)),
        "corpus": root / "corpus.txt",
        "text": saved_text_dataset(root / "text"),
        "text_train_only": saved_text_dataset(root / "text_train_only", splits=("train",)),
        "rows": saved_labelled_dataset(root / "rows"),
        "rows_split": saved_labelled_dataset(root / "rows_split", with_splits=True),
    }


def model_cfg(folder: Path, **kwargs: Any) -> DataConfig:
    return DataConfig(tokenizer="model", tokenizer_path=str(folder), **kwargs)


def same_tokenizer(saved: str, folder: Path) -> bool:
    """Whether ``saved`` is the folder's ``tokenizer.json`` (compared as JSON: not as laid out)."""
    return bool(json.loads(saved) == json.loads((folder / "tokenizer.json").read_text()))


# --- the model's tokenizer --------------------------------------------------------------------


def test_the_vocabulary_is_the_tokenizers_whole_and_ids_match_transformers(
    folders: dict[str, Path],
) -> None:
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(
        str(folders["added"]), local_files_only=True
    )
    tokenizer = ModelTokenizer(folders["added"])
    assert len(tokenizer.token_bytes) == len(reference) == 301  # the added token included
    docs = [*corpus(3), "a <extra_0> and " + SPECIAL]
    expected = reference(docs, add_special_tokens=False)["input_ids"]
    assert [ids.tolist() for ids in tokenizer.encode_each(docs)] == expected


def test_token_bytes_of_a_byte_level_bpe_are_the_texts_bytes(folders: dict[str, Path]) -> None:
    tokenizer = ModelTokenizer(folders["added"])
    docs = [*corpus(4), "Grüße, 東京 ✓"]
    for doc, ids in zip(docs, tokenizer.encode_each(docs), strict=True):
        assert sum(tokenizer.token_bytes[i] for i in ids) == len(doc.encode("utf-8"))
    added = tokenizer.tokenizer.token_to_id("<extra_0>")
    assert tokenizer.token_bytes[added] == len("<extra_0>")
    assert tokenizer.token_bytes[0] == len(SPECIAL)  # matched in text, it stands for its text
    assert tokenizer.tokenizer.decode([tokenizer.newline]) == "\n"
    assert tokenizer.pad_id == 0


def test_sentencepiece_style_tokens_count_as_their_decoder_reads_them(tmp_path: Path) -> None:
    """``▁`` is a space, ``<0x0A>`` one byte, and "\\n" (two tokens alone, after the word
    mark) joins documents through its byte-fallback token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["\u2581", "t", "h", "e", "th", "\u2581th", "\u2581the"]
    vocab = {token: i for i, token in enumerate(["<unk>", "<s>", "</s>", *byte_tokens, *pieces])}
    merges = [("t", "h"), ("\u2581", "th"), ("\u2581th", "e")]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.enable_truncation(2)  # saved with the tokenizer: must not cut documents
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    loaded = ModelTokenizer(tmp_path)
    assert loaded.token_bytes[vocab["\u2581the"]] == 4
    assert loaded.token_bytes[vocab["<0x0A>"]] == 1
    assert loaded.token_bytes[vocab["<0xE2>"]] == 1
    assert loaded.newline == vocab["<0x0A>"]
    assert len(loaded.encode_each(["the the the"])[0]) == 3  # not truncated to 2


def test_the_text_source_tokenizes_with_the_model_folder(folders: dict[str, Path]) -> None:
    cfg = model_cfg(folders["llama"], name="text", path=str(folders["corpus"]), seq_len=32)
    check_dataset(cfg)
    splits = load_splits(cfg)
    tokenizer = ModelTokenizer(folders["llama"])
    assert splits.shape == {"vocab_size": 320, "seq_len": 32}
    assert splits.meta["token_bytes"] == tokenizer.token_bytes
    assert same_tokenizer(splits.meta["tokenizer_json"], folders["llama"])
    # Bits per byte count the corpus's bytes: the val stream's tokens stand for its text.
    val = splits.val.tokens  # type: ignore[attr-defined]
    total = sum(tokenizer.token_bytes[i] for i in val.tolist())
    assert total == len(tokenizer.tokenizer.decode(val.tolist()).encode("utf-8"))
    bpe = load_splits(DataConfig(name="text", path=str(folders["corpus"]), seq_len=32))
    assert bpe.meta["fingerprint"] != splits.meta["fingerprint"]


def test_a_streamed_corpus_tokenizes_with_the_model_folder(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    docs = corpus()
    root = write_text_shards(tmp_path, {"train": docs[:20], "val": docs[20:25]}, rows_per_group=2)
    splits = load_splits(model_cfg(folders["llama"], name="text", path=str(root), seq_len=32))
    assert splits.shape["vocab_size"] == 320 and splits.meta["streamed"]
    assert same_tokenizer(splits.meta["tokenizer_json"], folders["llama"])


# --- config: where the folder comes from ------------------------------------------------------


def test_the_folder_comes_from_the_hf_models_path(folders: dict[str, Path]) -> None:
    job = load_job(RECIPE, [f"model.kwargs={{path: {folders['llama']}}}", "data.tokenizer=model"])
    assert job.data.tokenizer_path == str(folders["llama"])
    own = load_job(None, ["model.name=gpt_tiny", "data.name=text", "data.tokenizer=model",
                          f"data.tokenizer_path={folders['llama']}"])  # fmt: skip
    assert own.data.tokenizer_path == str(folders["llama"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.tokenizer=model"], "the hf model is given by model.kwargs.config, with no folder"),
        (["model={name: gpt_tiny}", "data.tokenizer=model"], "model.name is 'gpt_tiny'"),
    ],
)
def test_a_model_tokenizer_without_a_folder_is_one_line(
    overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", RECIPE, *(f for o in overrides for f in ("-o", o))]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("convoy: error: data.tokenizer: got 'model'; ")
    assert expected in lines[0]


def test_a_tokenizer_path_without_the_model_tokenizer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.tokenizer_path: got '/x'; read only with"):
        DataConfig(tokenizer_path="/x")


def test_a_folder_without_tokenizer_files_names_it_and_the_files(folders: dict[str, Path]) -> None:
    cfg = model_cfg(folders["bare"], name="text")
    with pytest.raises(ConfigError) as raised:
        check_dataset(cfg)
    message = str(raised.value)
    assert message.startswith(f"data.tokenizer_path: got '{folders['bare']}'; no tokenizer")
    assert "tokenizer.json, tokenizer.model, vocab.json + merges.txt, vocab.txt" in message


# --- hf_dataset: text -------------------------------------------------------------------------


def test_a_saved_dataset_dict_packs_its_splits_as_the_text_source(folders: dict[str, Path]) -> None:
    cfg = DataConfig(
        name="hf_dataset", path=str(folders["text"]), target="next_token", tokenizer="bytes",
        seq_len=64,
    )  # fmt: skip
    check_dataset(cfg)
    splits = load_splits(cfg)
    docs = corpus()
    assert splits.shape == {"vocab_size": 256, "seq_len": 64}
    for split, part in ((splits.val, docs[18:24]), (splits.test, docs[24:30])):
        assert torch.equal(split.tokens, ByteTokenizer().encode(part))  # type: ignore[attr-defined]
    assert set(splits.meta["reference_metrics"]) == {"val/gzip_bpb", "test/gzip_bpb"}


def test_missing_splits_are_held_out_of_train_by_rows(folders: dict[str, Path]) -> None:
    cfg = DataConfig(
        name="hf_dataset", path=str(folders["text_train_only"]), target="next_token",
        tokenizer="bytes", val_fraction=0.2, test_fraction=0.2,
    )  # fmt: skip
    splits = load_splits(cfg)
    texts = {
        name: bytes(getattr(splits, name).tokens.tolist()).decode()
        for name in ("train", "val", "test")
    }
    held = {name: [doc for doc in corpus()[:18] if doc in text] for name, text in texts.items()}
    assert [len(held[name]) for name in ("train", "val", "test")] == [10, 4, 4]  # 0.2 x 18 -> 4
    assert sorted(doc for docs in held.values() for doc in docs) == sorted(corpus()[:18])


def test_parquet_files_named_by_split_and_a_single_file(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    import datasets

    rows = labelled_rows()
    (tmp_path / "data").mkdir()
    for split, part in (("train", slice(0, 80)), ("validation", slice(80, 100))):
        piece = {key: values[part] for key, values in rows.items()}
        datasets.Dataset.from_dict(piece).to_parquet(
            str(tmp_path / "data" / f"{split}-00000-of-00001.parquet")
        )
    cfg = DataConfig(name="hf_dataset", path=str(tmp_path), target="value", label_column="score",
                     feature_columns=["a", "b"], test_fraction=0.25)  # fmt: skip
    splits = load_splits(cfg)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (60, 20, 20)
    single = tmp_path / "data" / "train-00000-of-00001.parquet"
    one = load_splits(cfg.model_copy(update={"path": str(single)}))
    assert len(one.train) + len(one.val) + len(one.test) == 80


# --- hf_dataset: classes and values -----------------------------------------------------------


def test_classes_from_feature_columns(folders: dict[str, Path]) -> None:
    cfg = DataConfig(name="hf_dataset", path=str(folders["rows_split"]), target="class",
                     feature_columns=FEATURES)  # fmt: skip
    splits = load_splits(cfg)
    assert splits.shape == {"num_features": 4, "num_classes": 2, "num_outputs": 2}
    assert splits.meta["classes"] == ["neg", "pos"]
    assert (len(splits.train), len(splits.val), len(splits.test)) == (108, 12, 40)
    x, y = splits.train.tensors  # type: ignore[attr-defined]
    assert torch.allclose(x.mean(dim=0), torch.zeros(4), atol=1e-5)  # standardized on train
    raw = labelled_rows(40, seed=1)
    _, y_test = splits.test.tensors  # type: ignore[attr-defined]
    assert y_test.tolist() == raw["label"] and y.dtype == torch.long


def test_classes_from_text_tokenized_by_the_model(folders: dict[str, Path]) -> None:
    cfg = model_cfg(folders["llama"], name="hf_dataset", path=str(folders["rows"]),
                    target="class", seq_len=12)  # fmt: skip
    splits = load_splits(cfg)
    shape = {"vocab_size": 320, "seq_len": 12, "num_classes": 2, "pad_token_id": 0}
    assert splits.shape == shape
    tokenizer = ModelTokenizer(folders["llama"])
    rows = labelled_rows()
    inputs, labels = splits.train[0]
    index = rows["label"].index(int(labels))  # any row of that class starts the same way
    expected = tokenizer.encode_each([rows["text"][index]])[0][:12].tolist()
    assert inputs.shape == (12,) and inputs[:3].tolist() == expected[:3]
    assert splits.meta["pad_id"] == 0 and splits.meta["tokenizer_json"]


def test_string_classes_are_sorted_over_every_split(tmp_path: Path) -> None:
    import datasets

    rows = {"text": ["x", "y", "z", "w", "v", "u"], "label": ["b", "a", "c", "a", "b", "c"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path))
    cfg = DataConfig(name="hf_dataset", path=str(tmp_path), target="class", tokenizer="bytes",
                     seq_len=4, val_fraction=0.2, test_fraction=0.2)  # fmt: skip
    splits = load_splits(cfg)
    assert splits.meta["classes"] == ["a", "b", "c"]
    inputs, _ = splits.train[0]
    assert inputs.tolist()[1:] == [0, 0, 0]  # one byte of text, then padding


def test_values_are_standardized_with_train_statistics(folders: dict[str, Path]) -> None:
    cfg = DataConfig(name="hf_dataset", path=str(folders["rows"]), target="value",
                     label_column="score", feature_columns=FEATURES)  # fmt: skip
    splits = load_splits(cfg)
    assert splits.shape == {"num_features": 4, "num_outputs": 1}
    _, y = splits.train.tensors  # type: ignore[attr-defined]
    assert y.shape == (len(splits.train),)
    assert abs(float(y.mean())) < 1e-5 and float(y.std(correction=0)) == pytest.approx(1, rel=1e-4)
    assert splits.meta["target_std"] > 1


# --- hf_dataset: bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "settings", "expected"),
    [
        ("rows", {"target": "class", "label_column": "kind"},
         "data.label_column: got 'kind'; {path} has no such column; it has a, b, pair, label, "
         "score, text"),
        ("rows", {"target": "class", "text_column": "body"},
         "data.text_column: got 'body'; {path} (or set data.feature_columns) has no such column"),
        ("rows", {"target": "class", "feature_columns": ["a", "text"]},
         "data.feature_columns: got 'text'; {path}: the column is string; it must hold numbers"),
        ("rows", {"target": "class", "label_column": "score", "feature_columns": ["a"]},
         "data.label_column: got 'score'; {path}: the column is float; classes are integers"),
        ("text", {"target": "next_token", "text_column": "body"},
         "data.text_column: got 'body'; {path} has no such column; it has text"),
        ("text", {}, "data.target: got None; hf_dataset needs to know what a row's target is"),
    ],
)  # fmt: skip
def test_bad_columns_name_the_field_and_the_columns_present(
    folders: dict[str, Path], dataset: str, settings: dict[str, Any], expected: str
) -> None:
    path = folders[dataset]
    with pytest.raises(ConfigError) as raised:
        load_hf_dataset(DataConfig(name="hf_dataset", path=str(path), **settings))
    assert str(raised.value).startswith(expected.format(path=path))


def test_a_folder_that_is_no_dataset_is_one_line(
    folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "-o", "data.name=hf_dataset", "-o", f"data.path={folders['bare']}",
            "-o", "task.name=regression", "-o", "model.name=tabular_mlp",
            "-o", "scaling.launcher=local", "-o", "scaling.num_workers=1"]  # fmt: skip
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"convoy: error: data.path: got '{folders['bare']}'; neither dataset_info.json + "
        "state.json or dataset_dict.json nor .parquet files in it; hf_dataset reads a folder "
        "written by save_to_disk (a Dataset or DatasetDict), a .parquet file, or a folder of "
        "parquet files named by split (train, validation, test)"
    ]


def test_the_task_fills_the_target(folders: dict[str, Path]) -> None:
    for task, target in (("language_modeling", "next_token"), ("regression", "value")):
        job = load_job(None, [f"task.name={task}", "data.name=hf_dataset",
                              f"data.path={folders['text']}"])  # fmt: skip
        assert job.data.target == target
    default = load_job(None, [])
    assert default.data.target is None  # other sources leave it unset
