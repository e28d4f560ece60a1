"""The ``text`` source streamed from parquet shards: a corpus larger than memory::

    <path>/train/*.parquet   <path>/val/*.parquet   <path>/test/*.parquet (optional: val)

``data.path`` is a folder or ``s3://bucket/prefix``; ``data.text_column`` holds one document
per row (null and whitespace-only rows are skipped, as in memory). A split's documents in
shard and row order, joined by ``"\\n"``, are its token stream: the stream the in-memory
source builds from the same documents.

Counting. Before training, one pass over each split tokenizes every row group and keeps only
its token count (plus, for eval splits, the gzip reference size and a digest of the text). The
counts make every sequence count known up front, which the steps per epoch, the
once-per-epoch rule and the exact resume of the streamed loaders rest on. They are kept in a
cache file on each machine (``CONVOY_CACHE_DIR``, default ``~/.cache/convoy``), keyed on the
shards' paths, sizes and times and on the tokenizer, and written under a lock: the ranks of
a machine count once, and a resume does not count again.

Packing, the in-memory rule (sequence ``i`` is tokens ``[iT, iT + T + 1)``, ``T =
data.seq_len``; the tail is padded):

- eval splits: over the whole stream, across row-group and shard boundaries. A row group holds
  the sequences that start in it, and reading it reads the following groups as far as its
  last sequence reaches. Bits per byte equal the in-memory source's on the same documents
  with the same tokenizer (bytes, or a BPE whose train split fits in its sample).
- train: over each row group's own stream, led by the separator that joins it to the previous
  group, so every token of every document is a target exactly once; only the separators at
  row-group boundaries are not (predicting one needs the previous group's last token). Row
  groups stay independent units that ranks and Ray Data tasks read, shuffle and deal without
  their neighbours (reading across boundaries would read every group twice). The cost, per row
  group: one separator that is not a target, one padded sequence and no context from the
  previous group.

Tokenizer. ``bpe`` is trained on the first ``TOKENIZER_SAMPLE_CHARS`` characters of the train
stream (bounded, the same in every process, and cached like the counts); ``bytes`` needs
nothing; ``model`` reads the model folder's tokenizer (``convoy.data.tokenizer``).
"""

from __future__ import annotations

import hashlib
import math
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convoy.config import DataConfig
from convoy.data.base import Splits
from convoy.data.cache import cached
from convoy.data.shards import (
    RowGroup,
    ShardedSplit,
    list_shards,
    scan_splits,
    shard_identity,
)
from convoy.data.text import IGNORE_INDEX, check_text_column, check_text_path, load_text
from convoy.data.tokenizer import (
    PAD_ID,
    BPETokenizer,
    ByteTokenizer,
    ModelTokenizer,
    TextTokenizer,
    check_model_tokenizer,
    tokenizer_json,
)
from convoy.errors import ConfigError
from convoy.storage import is_remote

SPLITS = ("train", "val", "test")
TOKENIZER_SAMPLE_CHARS = 16_000_000
"""Characters of the train stream (from its start) that a ``bpe`` tokenizer is trained on."""
EXPECTED = (
    "a streamed text corpus is <path>/train/*.parquet and <path>/val/*.parquet (a folder or "
    "s3://bucket/prefix) with one document per row in data.text_column"
)


def is_sharded_corpus(path: str) -> bool:
    """Whether ``data.path`` names a pre-split shard layout (always so for ``s3://``)."""
    return is_remote(path) or (Path(path).expanduser() / "train").is_dir()


def check_corpus_path(path: str | None) -> None:
    """``data.path`` of the ``text`` source: a shard layout (streamed) or what
    ``check_text_path`` takes (read whole)."""
    if path and is_sharded_corpus(path):
        check_text_shards(path)
    else:
        check_text_path(path)


def load_corpus(cfg: DataConfig) -> Splits:
    """The ``text`` source: streamed from a shard layout, else read whole."""
    if cfg.path and is_sharded_corpus(cfg.path):
        return load_text_shards(cfg)
    return load_text(cfg)


def check_text_shards(path: str) -> None:
    for split in ("train", "val"):
        if not list_shards(path, split):
            raise ConfigError("data.path", path, f"no parquet shards in {split}/; {EXPECTED}")


# --- reading and packing ----------------------------------------------------------------------


def documents(table: Any, column: str) -> list[str]:
    """A row group's documents: its non-null rows with some non-whitespace text."""
    return [doc for doc in table.column(column).to_pylist() if doc and doc.strip()]


def pack(tokens: np.ndarray, seq_len: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` sequences from the start of ``tokens``: inputs and next-token targets,
    padded past the end."""
    size = count * seq_len
    window = torch.from_numpy(tokens[: size + 1].astype(np.int64))
    real = max(0, len(window) - 1)
    inputs = torch.full((size,), PAD_ID, dtype=torch.long)
    targets = torch.full((size,), IGNORE_INDEX, dtype=torch.long)
    inputs[:real], targets[:real] = window[:real], window[1 : real + 1]
    return inputs.view(count, seq_len), targets.view(count, seq_len)


class PackedTextSplit(ShardedSplit):
    """A split of documents in parquet row groups as packed sequences; a "row" is a sequence.
    ``across``: pack over the whole stream (eval), else within each row group (train)."""

    def __init__(
        self,
        location: str,
        raw_groups: list[RowGroup],
        column: str,
        tokenizer: TextTokenizer,
        seq_len: int,
        tokens: list[int],
        across: bool,
    ) -> None:
        self.raw_groups = raw_groups
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.tokens = tokens
        self.across = across
        self.offsets = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64).tolist()
        counts = [self._first_and_count(p)[1] for p in range(len(raw_groups))]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()
        groups = [
            RowGroup(g.shard, g.index, rows, start)
            for g, rows, start in zip(raw_groups, counts, starts, strict=False)
        ]
        super().__init__(location, groups, [column], _no_decoder, column)

    def _first_and_count(self, position: int) -> tuple[int, int]:
        """(index of the first sequence in the group's stream, sequences the group holds)."""
        size, length = self.seq_len, self.tokens[position]
        if not self.across:
            return 0, max(0, math.ceil((length - 1) / size))
        total = max(0, math.ceil((self.offsets[-1] - 1) / size))
        begin = self.offsets[position]
        first = math.ceil(begin / size)
        return first, max(0, min(math.ceil((begin + length) / size), total) - first)

    def group_tokens(self, position: int) -> np.ndarray:
        """The group's part of the stream: its documents, led by the joining separator unless
        no document comes before them."""
        docs = documents(self.read_table(position), self.target_column)
        body = self.tokenizer.encode(docs).numpy() if docs else np.zeros(0, dtype=np.int32)
        if docs and self.offsets[position] > 0:
            return np.concatenate([np.array([self.tokenizer.newline], dtype=np.int32), body])
        return body.astype(np.int32)

    def read(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        first, count = self._first_and_count(position)
        tokens = self.group_tokens(position)
        if self.across:  # the sequences reach into the following groups
            skip = first * self.seq_len - self.offsets[position]
            need = skip + count * self.seq_len + 1
            parts, have, following = [tokens], len(tokens), position + 1
            while have < need and following < len(self.raw_groups):
                parts.append(self.group_tokens(following))
                have += len(parts[-1])
                following += 1
            tokens = np.concatenate(parts)[skip:]
        return pack(tokens, self.seq_len, count) if count else _empty(self.seq_len)

    def targets_head(self, limit: int) -> torch.Tensor:
        raise TypeError("a packed text split has no target column")


def _empty(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((0, seq_len), dtype=torch.long), torch.zeros((0, seq_len), dtype=torch.long)


def _no_decoder(table: Any, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("a packed text split reads through PackedTextSplit.read")


# --- the counting pass and its cache ----------------------------------------------------------


def count_split(split: ShardedSplit, tokenizer: TextTokenizer) -> dict[str, Any]:
    """Tokens per row group (with the joining separator), and of the split's text: UTF-8
    bytes, gzip -9's size (the reference bits per byte) and a digest."""
    tokens: list[int] = []
    text_bytes, seen = 0, 0
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip's format, as gzip.compress(data, 9)
    gzip_bytes = 0
    digest = hashlib.sha256()
    for position in range(len(split.groups)):
        docs = documents(split.read_table(position), split.target_column)
        count = len(tokenizer.encode(docs)) if docs else 0
        if docs and seen:
            count += 1
        text = ("\n" if seen and docs else "") + "\n".join(docs)
        data = text.encode("utf-8")
        gzip_bytes += len(packer.compress(data))
        digest.update(data)
        text_bytes += len(data)
        seen += len(docs)
        tokens.append(count)
    gzip_bytes += len(packer.flush())
    return {
        "tokens": tokens,
        "text_bytes": text_bytes,
        "gzip_bytes": gzip_bytes,
        "digest": digest.hexdigest(),
    }


def train_sample(split: ShardedSplit, chars: int) -> list[str]:
    """The train stream's first documents, about ``chars`` characters of them."""
    docs: list[str] = []
    total = 0
    for position in range(len(split.groups)):
        for doc in documents(split.read_table(position), split.target_column):
            docs.append(doc)
            total += len(doc)
            if total >= chars:
                return docs
    return docs


def build_stream_tokenizer(cfg: DataConfig, train: ShardedSplit, identity: Any) -> TextTokenizer:
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.tokenizer == "model":  # read from its folder: nothing to train or cache
        return ModelTokenizer(check_model_tokenizer(cfg.tokenizer_path))

    def train_bpe() -> str:
        sample = train_sample(train, TOKENIZER_SAMPLE_CHARS)
        return BPETokenizer(sample, cfg.vocab_size).to_json()

    key = [identity, cfg.text_column, cfg.vocab_size, TOKENIZER_SAMPLE_CHARS]
    return BPETokenizer.from_json(cached("tokenizers", key, train_bpe))


def load_text_shards(cfg: DataConfig) -> Splits:
    """The three streamed splits of packed sequences (see the module docstring)."""
    if cfg.train_size is not None:  # before any read: nothing to cap in a stream
        raise ConfigError(
            "data.train_size", cfg.train_size, "a streamed corpus trains whole splits; remove it"
        )
    location = str(cfg.path)
    check_text_shards(location)
    scanned = scan_splits(location, SPLITS)
    check_text_column(scanned["train"][1], cfg.text_column, location)
    raw = {
        split: ShardedSplit(location, groups, [cfg.text_column], _no_decoder, cfg.text_column)
        for split, (groups, _) in scanned.items()
    }
    identity = {split: shard_identity(location, s.groups) for split, s in raw.items()}
    tokenizer = build_stream_tokenizer(cfg, raw["train"], identity["train"])
    tokenizer_id = tokenizer_json(tokenizer) or "bytes"
    tokenizer_digest = hashlib.sha256(tokenizer_id.encode()).hexdigest()
    counts = {
        split: cached(
            "token-counts",
            [identity[split], cfg.text_column, tokenizer_digest],
            partial(count_split, sharded, tokenizer),
        )
        for split, sharded in raw.items()
    }
    packed = {
        split: PackedTextSplit(
            location,
            sharded.groups,
            cfg.text_column,
            tokenizer,
            cfg.seq_len,
            counts[split]["tokens"],
            across=split != "train",
        )
        for split, sharded in raw.items()
    }
    for split, dataset in packed.items():
        if len(dataset) == 0:
            raise ConfigError(
                "data.path", location, f"the {split} split has fewer than 2 tokens; give more text"
            )
    test = "test" if "test" in packed else "val"
    meta = _corpus_meta(cfg, tokenizer, tokenizer_digest, counts, test)
    shape = {"vocab_size": len(tokenizer.token_bytes), "seq_len": cfg.seq_len}
    return Splits(packed["train"], packed["val"], packed[test], shape, meta=meta)


def _corpus_meta(
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    tokenizer_digest: str,
    counts: dict[str, dict[str, Any]],
    test: str,
) -> dict[str, Any]:
    """The corpus's facts for the task and the summary: a fingerprint of the tokenized splits,
    the tokenizer, and each eval split's gzip bits per byte (a reference to beat)."""
    fingerprint = hashlib.sha256(
        f"{cfg.tokenizer}/{cfg.vocab_size}/{cfg.seq_len}/{tokenizer_digest}".encode()
    )
    for split in ("train", "val", test):
        fingerprint.update(counts[split]["digest"].encode())
    return {
        "fingerprint": fingerprint.hexdigest()[:16],
        "token_bytes": list(tokenizer.token_bytes),
        "tokenizer_json": tokenizer_json(tokenizer),
        "reference_metrics": {
            f"{name}/gzip_bpb": 8 * counts[split]["gzip_bytes"] / counts[split]["text_bytes"]
            for name, split in (("val", "val"), ("test", test))
        },
        "streamed": True,
    }
