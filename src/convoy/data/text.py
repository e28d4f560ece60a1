"""The ``text`` source: a corpus of documents, tokenized and packed for language modeling.

Reading. ``data.path`` is a ``.txt`` file (cut into chunks of 2-4k characters at blank lines),
a folder of ``.txt`` files (recursively, in sorted order; one document per file), or a parquet
file or folder whose ``data.text_column`` holds one document per row. Without a path the corpus
is CPython's own ``pydoc_data.topics`` (79 help topics, ~465k characters), which ships with
every Python, so a language model trains with no download.

Splitting. Documents are shuffled with ``DATA_SEED`` and cut into test, val and train by
their share of the characters (``data.test_fraction``, ``data.val_fraction``); every split
gets at least one whole document, so no document is seen by two splits.

Tokenizing (``convoy.data.tokenizer``). ``bpe`` trains a byte-level BPE (HuggingFace
``tokenizers``, the ``text`` extra) on the train split only, with ``data.vocab_size``. Training
is deterministic (the same merges in every process and at any thread count), so every rank
builds the same vocabulary without communicating, and nothing is cached on disk. ``bytes``
uses the 256 UTF-8 byte values. ``model`` uses the tokenizer in a pretrained model's folder
(``data.tokenizer_path``): its whole vocabulary, added tokens included.

Packing. A split's documents, joined by ``"\\n"``, form one token stream. Sequence ``i`` is
tokens ``[i*T, i*T + T + 1)`` (``T = data.seq_len``): its first ``T`` are the inputs and its
last ``T`` the targets, so every token after the first is a target exactly once. The last
sequence is padded: inputs with 0, targets with -100 (the ignore index).

``Splits.meta`` carries ``token_bytes`` (the UTF-8 bytes each token id stands for, to turn a
loss in nats per token into bits per byte) and ``reference_metrics``: gzip -9's bits per byte
of each eval split's text, a baseline any useful model should beat.
"""

from __future__ import annotations

import gzip
import hashlib
import math
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from convoy.config import DataConfig
from convoy.data.base import Collated, Splits
from convoy.data.sources import DATA_SEED
from convoy.data.tokenizer import PAD_ID, build_tokenizer, tokenizer_json
from convoy.errors import ConfigError, DataError

IGNORE_INDEX = -100
CHUNK_CHARS = (2000, 4000)
"""A single .txt file is cut into documents of this many characters (at a blank line if any)."""
EXPECTED = (
    "text reads a .txt file, a folder of .txt files, or a parquet file or folder with a "
    "data.text_column; with no data.path it uses the embedded pydoc topics corpus"
)


# --- reading ----------------------------------------------------------------------------------


def check_text_path(path: str | None) -> Path | None:
    """The corpus location (None: the embedded corpus), or a ``ConfigError`` on data.path."""
    if not path:
        return None
    root = Path(path).expanduser()
    if root.is_file():
        if root.suffix not in (".txt", ".parquet"):
            raise ConfigError("data.path", path, f"not a .txt or .parquet file; {EXPECTED}")
        return root
    if not root.is_dir():
        raise ConfigError("data.path", path, f"no such file or folder; {EXPECTED}")
    if not _corpus_files(root):
        raise ConfigError("data.path", path, f"no .txt or .parquet files in it; {EXPECTED}")
    return root


def _corpus_files(root: Path) -> list[Path]:
    """A folder's .txt files, or (if it has none) its .parquet files; sorted, hidden ones left
    out."""
    for suffix in (".txt", ".parquet"):
        files = sorted(
            p
            for p in root.rglob(f"*{suffix}")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        )
        if files:
            return files
    return []


def read_documents(cfg: DataConfig) -> list[str]:
    """The corpus as documents in a fixed order, whitespace-only ones dropped."""
    root = check_text_path(cfg.path)
    if root is None:
        docs = _pydoc_topics()
    elif root.is_file() and root.suffix == ".txt":
        docs = chunk_text(_read_txt(root))
    elif root.is_file():
        docs = _read_parquet(root, cfg.text_column)
    else:
        files = _corpus_files(root)
        if files[0].suffix == ".txt":
            docs = [_read_txt(f) for f in files]
        else:
            docs = [doc for f in files for doc in _read_parquet(f, cfg.text_column)]
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        raise ConfigError("data.path", cfg.path, f"the corpus holds no text; {EXPECTED}")
    return docs


def _pydoc_topics() -> list[str]:
    return [topics[name] for name in sorted(topics)]


def _read_txt(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data.path: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def check_text_column(schema: Any, column: str, where: str | Path) -> None:
    """Refuse, naming ``data.text_column``, a parquet schema without that column or where it
    is not text."""
    import pyarrow as pa  # 0.3 s to import: only where parquet is read

    if column not in schema.names:
        raise ConfigError(
            "data.text_column",
            column,
            f"{where} has no such column; it has {', '.join(schema.names)}",
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(
            "data.text_column", column, f"{where}: the column is {kind}, not text (strings)"
        )


def _read_parquet(path: Path, column: str) -> list[str]:
    import pyarrow.parquet as pq  # 0.3 s to import: only where parquet is read

    check_text_column(pq.read_schema(path), column, path)
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    if any(not isinstance(v, str) for v in values if v is not None):
        raise ConfigError("data.text_column", column, f"{path}: the column must hold strings")
    return [v for v in values if v]


def chunk_text(text: str, sizes: tuple[int, int] = CHUNK_CHARS) -> list[str]:
    """Cut one long text into documents of ``sizes[0]`` to ``sizes[1]`` characters: at the last
    blank line in that window, else the last line break, else the last space."""
    low, high = sizes
    chunks, start = [], 0
    while len(text) - start > high:
        window = text[start + low : start + high]
        for sep in ("\n\n", "\n", " "):
            at = window.rfind(sep)
            if at >= 0:
                cut = start + low + at + len(sep)
                break
        else:
            cut = start + high
        chunks.append(text[start:cut].strip())
        start = cut
    chunks.append(text[start:].strip())
    return [c for c in chunks if c]


# --- splitting --------------------------------------------------------------------------------


def split_documents(
    docs: list[str], test_fraction: float, val_fraction: float, path: str | None = None
) -> tuple[list[str], list[str], list[str]]:
    """Test, val and train documents: a seeded shuffle cut by share of characters, each split
    at least one document (a document goes where most of its characters fall)."""
    if len(docs) < 3:
        raise ConfigError(
            "data.path",
            path,
            f"the corpus has {len(docs)} document(s), but test, val and train need at least one "
            "each; give more text (a single .txt file is cut into chunks of "
            f"{CHUNK_CHARS[0]}-{CHUNK_CHARS[1]} characters)",
        )
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(DATA_SEED)).tolist()
    shuffled = [docs[i] for i in order]
    lengths = np.array([len(d) for d in shuffled], dtype=np.float64)
    total = lengths.sum()
    n_test = _docs_for_share(lengths, test_fraction * total, len(docs) - 2)
    n_val = _docs_for_share(lengths[n_test:], val_fraction * total, len(docs) - n_test - 1)
    val_end = n_test + n_val
    return shuffled[:n_test], shuffled[n_test:val_end], shuffled[val_end:]


def _docs_for_share(lengths: np.ndarray, chars: float, most: int) -> int:
    """How many leading documents hold about ``chars`` characters: those whose middle character
    lies before it; at least 1, at most ``most``."""
    middles = np.cumsum(lengths) - lengths / 2
    return min(max(1, int((middles < chars).sum())), most)


# --- packing ----------------------------------------------------------------------------------


class PackedSequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A token stream as overlapping windows of ``seq_len + 1``: (inputs, targets shifted by
    one); every token but the first is a target once; the tail is padded (targets -100)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, math.ceil((len(self.tokens) - 1) / self.seq_len))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"sequence {index} of {size}")
        start = (index % size) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        real = len(window) - 1
        inputs = torch.full((self.seq_len,), PAD_ID, dtype=torch.long)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        inputs[:real], targets[:real] = window[:-1], window[1:]
        return inputs, targets

    def __getitems__(self, indices: list[int]) -> Collated:
        """The sequences at ``indices`` as one batch, without a per-sample collate."""
        size = len(self)
        index = torch.as_tensor(indices, dtype=torch.long)
        if len(index) and not bool(((index >= -size) & (index < size)).all()):
            raise IndexError(f"a sequence of {indices} is outside 0..{size - 1}")
        positions = (index % size)[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        windows = self.tokens[positions.clamp_max(len(self.tokens) - 1)].long()
        # Position j is a real (input, target) pair when its target, token j + 1, exists.
        real = positions[:, 1:] < len(self.tokens)
        inputs = torch.where(real, windows[:, :-1], PAD_ID)
        targets = torch.where(real, windows[:, 1:], IGNORE_INDEX)
        return Collated((inputs, targets))


def gzip_bits_per_byte(data: bytes) -> float:
    """gzip -9's compressed size in bits per byte of ``data``: a reference for a model's bpb."""
    return 8 * len(gzip.compress(data, compresslevel=9)) / len(data)


# --- the source -------------------------------------------------------------------------------


def corpus_fingerprint(
    cfg: DataConfig, splits: tuple[list[str], ...], tokenizer_id: str | None = None
) -> str:
    """A digest of the split texts and the tokenizer settings: the tokenizer is trained from
    them, so an export evaluated on other text would be scored with another vocabulary. A
    model's tokenizer is not trained here: its JSON (``tokenizer_id``) goes in instead."""
    digest = hashlib.sha256(f"{cfg.tokenizer}/{cfg.vocab_size}/{cfg.seq_len}".encode())
    if cfg.tokenizer == "model" and tokenizer_id is not None:
        digest.update(tokenizer_id.encode())
    for split in splits:
        for doc in split:
            digest.update(doc.encode("utf-8"))
            digest.update(b"\0")
        digest.update(b"\1")
    return digest.hexdigest()[:16]


def load_text(cfg: DataConfig) -> Splits:
    """A text corpus as packed next-token sequences; see the module docstring."""
    docs = read_documents(cfg)
    test_docs, val_docs, train_docs = split_documents(
        docs, cfg.test_fraction, cfg.val_fraction, cfg.path
    )
    return packed_splits(cfg, train_docs, val_docs, test_docs)


def packed_splits(
    cfg: DataConfig, train_docs: list[str], val_docs: list[str], test_docs: list[str]
) -> Splits:
    """Documents already split, tokenized (``data.tokenizer``, a BPE trained on
    ``train_docs``) and packed into next-token sequences; the meta of the module docstring."""
    tokenizer = build_tokenizer(cfg, train_docs)
    train_tokens = tokenizer.encode(train_docs)
    if cfg.train_size is not None:  # a cap on training sequences
        train_tokens = train_tokens[: cfg.train_size * cfg.seq_len + 1]
    datasets = {
        name: PackedSequences(tokens, cfg.seq_len)
        for name, tokens in (
            ("train", train_tokens),
            ("val", tokenizer.encode(val_docs)),
            ("test", tokenizer.encode(test_docs)),
        )
    }
    for name, dataset in datasets.items():
        if len(dataset) == 0:
            raise ConfigError(
                "data.path", cfg.path, f"the {name} split has fewer than 2 tokens; give more text"
            )
    saved = tokenizer_json(tokenizer)
    meta: dict[str, Any] = {
        "fingerprint": corpus_fingerprint(cfg, (train_docs, val_docs, test_docs), saved),
        "token_bytes": list(tokenizer.token_bytes),
        # The trained BPE or the model's tokenizer, saved beside the run and its exports (None
        # for raw bytes).
        "tokenizer_json": saved,
        "reference_metrics": {
            f"{name}/gzip_bpb": gzip_bits_per_byte("\n".join(split).encode("utf-8"))
            for name, split in (("val", val_docs), ("test", test_docs))
        },
    }
    shape = {"vocab_size": len(tokenizer.token_bytes), "seq_len": cfg.seq_len}
    return Splits(datasets["train"], datasets["val"], datasets["test"], shape, meta=meta)
