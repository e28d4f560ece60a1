"""The ``sft`` source: supervised fine-tuning rows, the loss on the tokens they train.

Reading. ``data.path`` is a ``.jsonl`` file (one row a line), a folder of ``.jsonl`` files
named by split (``train.jsonl``, ``validation.jsonl`` or ``val``/``dev``, ``test.jsonl``;
``train-00001.jsonl`` too: the name's first word; other names are train), a folder written by
``datasets``' ``save_to_disk``, or parquet as ``hf_dataset`` reads it. A split the data lacks
is held out of train by rows (``data.val_fraction``, ``data.test_fraction``, seeded);
``data.train_size`` caps the training rows.

Rows are shaped as TRL shapes them (``messages``, ``prompt`` + ``completion``, ``text``) and
encoded by ``convoy.data.chat`` with the tokenizer of the model's folder
(``data.tokenizer_path``, filled from an ``hf`` model's ``model.kwargs.path``) and its chat
template, or ``data.chat_template``; ``data.train_on`` says which tokens are trained. Each
row becomes one sample: its tokens, and targets that are the next token where that one is
trained, else -100 (its last token's too). Samples are laid out in rows of ``data.seq_len``
tokens by ``convoy.data.packing`` (``data.packing``: packed with positions restarting per
sample, or one a row).

Counted and reported, per split (``meta["sft"]``, one line from the driver, and the run's
``summary.json`` as ``sft_rows``): a sample longer than ``seq_len`` is cut to it or left out
(``data.long_rows``); a row with no trained token (no assistant turn, or none left after the
cut) is left out. Rows left out are ``Splits.skipped``, with the reason, so the run's log and
summary name them. A split left with no row stops the run before any worker
(``check_sft_splits``, in the driver's checks).

Every rank encodes the same rows to the same samples; the ranks of a machine encode them once
(``cached_arrays``, keyed on the rows, the tokenizer's files, the template and the settings).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from convoy.config import DataConfig
from convoy.data.base import Splits, given_path, hold_out
from convoy.data.cache import cached_arrays
from convoy.data.chat import ChatEncoder, read_chat_template
from convoy.data.hf_datasets import SPLIT_NAMES, is_saved, read_tables
from convoy.data.packing import (
    IGNORE_INDEX,
    Samples,
    join_samples,
    sample_targets,
    token_rows,
)
from convoy.data.sources import DATA_SEED
from convoy.data.tokenizer import check_model_tokenizer
from convoy.errors import ConfigError

EXPECTED = (
    "sft reads a .jsonl file, a folder of .jsonl files named by split (train, validation, "
    "test), a folder written by datasets' save_to_disk, or parquet"
)
SPLITS = ("train", "val", "test")
Row = tuple[str, dict[str, Any]]
"""A row and where it is (``chat.jsonl line 4``, ``train row 3``), for messages."""


@dataclass
class SplitNotes:
    """What encoding a split did to its rows: kept, cut, left out; tokens and trained ones."""

    rows: int = 0
    samples: int = 0
    cut: int = 0
    too_long: int = 0
    """Left out: longer than ``seq_len`` under ``data.long_rows: skip``."""
    untrained: int = 0
    """Left out: no trained token."""
    tokens: int = 0
    trained: int = 0
    rows_of_tokens: int = 0
    """The rows of ``seq_len`` tokens the samples fill."""


# --- reading ----------------------------------------------------------------------------------


def check_sft_path(path: str | None) -> Path:
    """``data.path`` of ``sft`` (looked at, not read), or a ``ConfigError``."""
    root = given_path(path, EXPECTED)
    if root.is_file():
        if root.suffix not in (".jsonl", ".parquet"):
            raise ConfigError("data.path", path, f"not a .jsonl or .parquet file; {EXPECTED}")
        return root
    if not root.is_dir():
        raise ConfigError("data.path", path, f"no such file or folder; {EXPECTED}")
    if not (_jsonl_files(root) or is_saved(root) or any(root.rglob("*.parquet"))):
        raise ConfigError(
            "data.path", path, f"no .jsonl, save_to_disk or .parquet files in it; {EXPECTED}"
        )
    return root


def _jsonl_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.jsonl") if not p.name.startswith("."))


def read_rows(cfg: DataConfig) -> dict[str, list[Row]]:
    """The rows of each split the data has (train at least), under Convoy's split names."""
    root = check_sft_path(cfg.path)
    if root.suffix == ".jsonl":
        return {"train": _read_jsonl(root, cfg.path)}
    files = _jsonl_files(root) if root.is_dir() else []
    if not files:
        tables = read_tables(cfg)
        return {
            split: [(f"{split} row {i}", row) for i, row in enumerate(table.to_pylist())]
            for split, table in tables.items()
        }
    rows: dict[str, list[Row]] = {}
    for file in files:
        rows.setdefault(_split_of(file), []).extend(_read_jsonl(file, cfg.path))
    if "train" not in rows:
        raise ConfigError(
            "data.path",
            cfg.path,
            f"no train rows: each .jsonl file names another split; {EXPECTED}",
        )
    return rows


def _split_of(file: Path) -> str:
    """The split a file's name says (its first word), train where it says none."""
    first = re.split(r"[-_.]", file.stem, maxsplit=1)[0].lower()
    return SPLIT_NAMES.get(first, "train")


def _read_jsonl(file: Path, path: str | None) -> list[Row]:
    rows: list[Row] = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{file.name} line {number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError("data.path", path, f"{where} is not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ConfigError(
                    "data.path", path, f"{where} is a {type(row).__name__}, not an object"
                )
            rows.append((where, row))
    return rows


def split_rows(cfg: DataConfig, rows: dict[str, list[Row]]) -> dict[str, list[Row]]:
    """Train, val and test rows: a split the data lacks held out of train (seeded), the
    training rows capped at ``data.train_size``."""
    out = {name: list(rows[name]) for name in SPLITS if name in rows}
    missing = [name for name in ("test", "val") if name not in out]
    if missing:
        train = out["train"]
        fractions = {"test": cfg.test_fraction, "val": cfg.val_fraction}
        try:
            *held, rest = hold_out(len(train), tuple(fractions[m] for m in missing), DATA_SEED)
        except ValueError as exc:
            raise ConfigError("data.path", cfg.path, f"its train rows: {exc}") from None
        for name, indices in zip(missing, held, strict=True):
            out[name] = [train[i] for i in sorted(indices.tolist())]
        out["train"] = [train[i] for i in sorted(rest.tolist())]
    if cfg.train_size is not None:
        out["train"] = out["train"][: cfg.train_size]
    return out


# --- encoding ---------------------------------------------------------------------------------


def encode_split(
    encoder: ChatEncoder, rows: list[Row], cfg: DataConfig
) -> tuple[Samples, SplitNotes, list[str]]:
    """The split's samples (cut to ``seq_len``, or left out, by ``data.long_rows``), what
    was counted, and the rows left out with the reason."""
    ids: list[list[int]] = []
    targets: list[list[int]] = []
    notes, left_out = SplitNotes(rows=len(rows)), []
    for where, row in rows:
        encoded = encoder.encode(row, where)
        sample, trained = encoded.ids, encoded.trained
        cut = len(sample) > cfg.seq_len
        if cut and cfg.long_rows == "skip":
            notes.too_long += 1
            left_out.append(f"{where}: {len(sample)} tokens, over data.seq_len {cfg.seq_len}")
            continue
        sample, trained = sample[: cfg.seq_len], trained[: cfg.seq_len]
        sample_target = sample_targets(sample, trained)
        count = sum(target != IGNORE_INDEX for target in sample_target)
        if not count:
            notes.untrained += 1
            after = f" left after the cut to data.seq_len {cfg.seq_len}" if cut else ""
            left_out.append(f"{where}: no trained token{after}")
            continue
        notes.cut += cut
        notes.samples += 1
        notes.tokens += len(sample)
        notes.trained += count
        ids.append(sample)
        targets.append(sample_target)
    return join_samples(ids, targets), notes, left_out


def encode_splits(
    encoder: ChatEncoder, rows: dict[str, list[Row]], cfg: DataConfig
) -> dict[str, np.ndarray]:
    """Every split encoded, as the named arrays the cache keeps: ``<split>.ids``,
    ``.targets``, ``.starts``, ``.notes`` (``SplitNotes``' fields in order) and ``.left_out``."""
    arrays: dict[str, np.ndarray] = {}
    for name in SPLITS:
        samples, notes, left_out = encode_split(encoder, rows[name], cfg)
        arrays |= {
            f"{name}.ids": samples.ids,
            f"{name}.targets": samples.targets,
            f"{name}.starts": samples.starts,
            f"{name}.notes": np.asarray(list(asdict(notes).values()), dtype=np.int64),
            f"{name}.left_out": np.asarray(left_out, dtype=str),
        }
    return arrays


def encoding_key(cfg: DataConfig, encoder: ChatEncoder, rows: dict[str, list[Row]]) -> str:
    """A digest of what the samples depend on: the rows, the tokenizer's files, the template,
    the settings and the ``transformers`` release."""
    digest = hashlib.sha256(
        json.dumps(
            [cfg.seq_len, cfg.train_on, cfg.long_rows, encoder.template, version("transformers")]
        ).encode()
    )
    for file in sorted(encoder.folder.iterdir()):
        if file.is_file() and file.suffix in (".json", ".jinja", ".model", ".txt"):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    for name in SPLITS:
        digest.update(f"\1{name}".encode())
        for _, row in rows[name]:
            digest.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\0")
    return digest.hexdigest()[:24]


# --- the source -------------------------------------------------------------------------------


def load_sft(cfg: DataConfig) -> Splits:
    """The splits as rows of token ids and targets; see the module docstring."""
    folder = check_model_tokenizer(cfg.tokenizer_path)
    encoder = ChatEncoder(folder, read_chat_template(cfg.chat_template), cfg.train_on, cfg.path)
    rows = split_rows(cfg, read_rows(cfg))
    key = encoding_key(cfg, encoder, rows)
    arrays = cached_arrays("sft", {"samples": key}, lambda: encode_splits(encoder, rows, cfg))
    datasets, notes, left_out = {}, {}, []
    for name in SPLITS:
        samples = Samples(*(arrays[f"{name}.{part}"] for part in ("ids", "targets", "starts")))
        datasets[name] = token_rows(samples, cfg.seq_len, encoder.pad_id, cfg.packing)
        counts = SplitNotes(*(int(n) for n in arrays[f"{name}.notes"]))
        counts.rows_of_tokens = len(datasets[name])
        notes[name] = asdict(counts)
        left_out += [f"sft {name}: {why}" for why in arrays[f"{name}.left_out"].tolist()]
    backend = getattr(encoder.tokenizer, "backend_tokenizer", None)
    meta = {
        "sft": notes,
        "fingerprint": key[:16],
        "tokenizer_json": backend.to_str() if backend is not None else None,
        "pad_id": encoder.pad_id,
    }
    shape = {"vocab_size": _vocab_size(encoder), "seq_len": cfg.seq_len}
    return Splits(
        datasets["train"], datasets["val"], datasets["test"], shape, tuple(left_out), meta
    )


def _vocab_size(encoder: ChatEncoder) -> int:
    """Every id the tokenizer gives, added tokens included (``len(tokenizer)``)."""
    vocab = encoder.tokenizer.get_vocab()
    return max(len(encoder.tokenizer), max(vocab.values(), default=-1) + 1)


# --- the driver's check -----------------------------------------------------------------------


def check_sft_splits(cfg: DataConfig, splits: Splits) -> None:
    """Stop where a split has no sample left (every row untrained or too long), in one line;
    else say in one line (stderr) what each split counted."""
    notes = {name: SplitNotes(**counts) for name, counts in splits.meta["sft"].items()}
    for name, counts in notes.items():
        if counts.samples:
            continue
        field, value = (
            ("data.train_on", cfg.train_on)
            if counts.untrained >= counts.too_long
            else ("data.seq_len", cfg.seq_len)
        )
        raise ConfigError(
            field,
            value,
            f"no row of the {name} split of {cfg.path} is left to train on: "
            f"{describe_split(counts, cfg)}; rows need a trained token "
            "(an assistant turn under train_on assistant) within data.seq_len tokens",
        )
    said = "; ".join(f"{name} {describe_split(c, cfg)}" for name, c in notes.items())
    print(f"convoy: data sft: {said}", file=sys.stderr)


def describe_split(notes: SplitNotes, cfg: DataConfig) -> str:
    """``118 of 120 rows (2 with no trained token left out, 3 cut to seq_len 64) in 40
    packed rows, 5,120 of 9,800 tokens trained``."""
    what = [
        f"{notes.untrained} with no trained token left out" if notes.untrained else "",
        f"{notes.too_long} over seq_len {cfg.seq_len} left out" if notes.too_long else "",
        f"{notes.cut} cut to seq_len {cfg.seq_len}" if notes.cut else "",
    ]
    counted = ", ".join(w for w in what if w)
    layout = "packed rows" if cfg.packing else "padded rows"
    return (
        f"{notes.samples} of {notes.rows} rows{f' ({counted})' if counted else ''} in "
        f"{notes.rows_of_tokens} {layout}, {notes.trained:,} of {notes.tokens:,} tokens trained"
    )
