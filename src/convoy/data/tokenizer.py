"""Tokenizers of text data (``data.tokenizer``): raw bytes, a BPE trained here, or a model's own.

Every tokenizer gives one thing the packing needs, ``encode_each`` (a document's token ids, no
special tokens added), and three facts: ``token_bytes`` (the UTF-8 bytes each id stands for,
for bits per byte; its length is the vocabulary size), ``newline`` (the one id that joins
documents into a stream, standing for ``"\\n"``) and ``pad_id`` (what pads a sequence's inputs).

- ``bytes``: the 256 UTF-8 byte values.
- ``bpe``: a byte-level BPE trained with HuggingFace ``tokenizers`` (the ``text`` extra) on the
  train split; deterministic, so every rank builds the same vocabulary without communicating.
- ``model``: the tokenizer saved in a pretrained model's folder (``data.tokenizer_path``).
  ``tokenizer.json`` is read with ``tokenizers`` itself: it is the whole pipeline as saved
  (normalizer, pre-tokenizer, vocabulary, added and special tokens, decoder), the file the
  fast tokenizers of ``transformers`` wrap. A folder with only the files ``transformers``
  converts (``tokenizer.model``, ``vocab.json`` + ``merges.txt``, ``vocab.txt``) is loaded
  with ``AutoTokenizer`` (the ``hf`` extra), offline. Documents are joined by the newline
  token, as for the other tokenizers, not by BOS/EOS: a ``.txt`` file's chunks are cut from
  one text, not separate documents, and bits per byte and gzip's reference are measured on
  the ``"\\n"``-joined text, so the separator must stand for that byte.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from convoy.config import DataConfig
from convoy.errors import ConfigError, ConvoyError, DataError
from convoy.imports import describe, missing_extra

PAD_ID = 0
"""What pads a sequence's inputs where the tokenizer names no pad token."""
ENCODE_BATCH_DOCS = 1024
"""Documents per ``encode_batch`` call: bounds the memory of the tokenizer's outputs."""
MODEL_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json + merges.txt",
    "vocab.txt",
)
"""What ``data.tokenizer: model`` looks for in the folder, in this order."""


class TextTokenizer(Protocol):
    token_bytes: list[int]
    """The UTF-8 bytes each token id stands for; its length is the vocabulary size."""
    newline: int
    """The id of the separator that joins documents."""
    pad_id: int
    """The id that pads a sequence's inputs (targets are padded with the ignore index)."""

    def encode_each(self, docs: list[str]) -> list[np.ndarray]:
        """Each document's int32 token ids, no special tokens added."""

    def encode(self, docs: list[str]) -> torch.Tensor:
        """One int32 token stream of the documents joined by a newline."""


def join_documents(ids: list[np.ndarray], newline: int) -> torch.Tensor:
    """Documents' token ids as one int32 stream, a ``newline`` between each two."""
    if not ids:
        return torch.zeros(0, dtype=torch.int32)
    separator = np.array([newline], dtype=np.int32)
    parts = [part for doc in ids for part in (separator, doc.astype(np.int32, copy=False))]
    return torch.from_numpy(np.concatenate(parts[1:]))


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256)."""

    token_bytes = [1] * 256
    newline = ord("\n")
    pad_id = PAD_ID

    def encode_each(self, docs: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int32) for doc in docs]

    def encode(self, docs: list[str]) -> torch.Tensor:
        data = np.frombuffer("\n".join(docs).encode("utf-8"), dtype=np.uint8)
        return torch.from_numpy(data.astype(np.int32))


def tokenizers_module(what: str = "data.tokenizer 'bpe'", extra: str = "text") -> Any:
    """HuggingFace ``tokenizers``, or a ``ConvoyError`` with the install line."""
    try:
        import tokenizers  # the text extra (and a dependency of the hf extra's transformers)
    except ImportError:
        raise ConvoyError(
            missing_extra(what, "tokenizers", extra) + ", or use data.tokenizer: bytes"
        ) from None
    return tokenizers


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` that encodes documents with no special tokens added."""

    tokenizer: Any
    """The ``tokenizers.Tokenizer``."""
    newline: int

    def to_json(self) -> str:
        """The tokenizer as ``tokenizers``' JSON (``Tokenizer.from_str`` reads it)."""
        return str(self.tokenizer.to_str())

    def encode_each(self, docs: list[str]) -> list[np.ndarray]:
        ids: list[np.ndarray] = []
        for start in range(0, len(docs), ENCODE_BATCH_DOCS):
            batch = docs[start : start + ENCODE_BATCH_DOCS]
            encodings = self.tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            ids += [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]
        return ids

    def encode(self, docs: list[str]) -> torch.Tensor:
        return join_documents(self.encode_each(docs), self.newline)


class BPETokenizer(HFTokenizer):
    """A byte-level BPE trained with HuggingFace ``tokenizers`` (no special tokens)."""

    pad_id = PAD_ID

    def __init__(self, train_docs: list[str], vocab_size: int) -> None:
        """Train on ``train_docs`` (deterministic: the same merges in every process)."""
        tokenizers = tokenizers_module()
        pre_tokenizers = tokenizers.pre_tokenizers
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()  # a saved tokenizer decodes to text
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            initial_alphabet=alphabet,
        )
        tokenizer.train_from_iterator(train_docs, trainer=trainer)
        if set(byte_level_chars()) != set(alphabet):  # a release that changed the alphabet
            raise DataError("tokenizers' ByteLevel alphabet is not GPT-2's byte-to-unicode map")
        self._use(tokenizer)

    @classmethod
    def from_json(cls, text: str) -> BPETokenizer:
        """A tokenizer saved with ``to_json``."""
        self = cls.__new__(cls)
        self._use(tokenizers_module().Tokenizer.from_str(text))
        return self

    def _use(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        to_byte = byte_level_chars()
        vocab = tokenizer.get_vocab()
        self.token_strings = [b""] * len(vocab)
        for token, index in vocab.items():
            self.token_strings[index] = bytes(to_byte[c] for c in token)
        self.token_bytes = [len(s) for s in self.token_strings]
        self.newline = vocab[next(c for c, b in to_byte.items() if b == ord("\n"))]


def byte_level_chars() -> dict[str, int]:
    """The byte each character of a ByteLevel token stands for: GPT-2's byte-to-unicode map
    (printable Latin-1 bytes map to themselves, the other 68 to U+0100 onward)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + extra)
    return {c: b for b, c in chars.items()}


# --- the model's own tokenizer ----------------------------------------------------------------


def check_model_tokenizer(path: str | None) -> Path:
    """The folder of ``data.tokenizer: model``, with one of ``MODEL_TOKENIZER_FILES`` in it;
    else a ``ConfigError`` that names the folder and the files looked for."""
    if not path:
        raise ConfigError(
            "data.tokenizer",
            "model",
            "needs a folder with the tokenizer: data.tokenizer_path, or model.name: hf with "
            "model.kwargs.path",
        )
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError("data.tokenizer_path", path, "no such folder")
    if not _tokenizer_files_in(folder):
        raise ConfigError(
            "data.tokenizer_path",
            path,
            f"no tokenizer in this folder: looked for {', '.join(MODEL_TOKENIZER_FILES)} (a "
            "folder as save_pretrained writes it); use data.tokenizer: bpe or bytes otherwise",
        )
    return folder


def _tokenizer_files_in(folder: Path) -> bool:
    has = {name: (folder / name).is_file() for name in ("vocab.json", "merges.txt")}
    single = ("tokenizer.json", "tokenizer.model", "vocab.txt")
    return any((folder / name).is_file() for name in single) or all(has.values())


class ModelTokenizer(HFTokenizer):
    """The tokenizer in a pretrained model's folder (see the module docstring). Its vocabulary
    is the tokenizer's whole: every id, added tokens included (``len(tokenizer)`` in
    ``transformers``), so the model's embedding must hold them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tokenizer = load_backend(folder)
        # Padding or truncation saved with the tokenizer would cut or pad each document.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.token_strings = model_token_strings(self.tokenizer)
        self.token_bytes = [len(s) for s in self.token_strings]
        self.newline = self._newline()
        roles = _special_roles(folder)
        pad = roles.get("pad_token")
        self.pad_id = self._id_of(pad) if pad is not None else PAD_ID

    def _id_of(self, token: str) -> int:
        index = self.tokenizer.token_to_id(token)
        return PAD_ID if index is None else int(index)

    def _newline(self) -> int:
        """The id that joins documents: ``"\\n"`` encoded alone if that is one token, else the
        vocabulary's token for that byte (sentencepiece's ``<0x0A>``), else the EOS token."""
        ids = self.tokenizer.encode("\n", add_special_tokens=False).ids
        if len(ids) == 1:
            return int(ids[0])
        exact = [i for i, s in enumerate(self.token_strings) if s == b"\n"]
        if exact:
            return exact[0]
        eos = _special_roles(self.folder).get("eos_token")
        if eos is not None and self.tokenizer.token_to_id(eos) is not None:
            return int(self.tokenizer.token_to_id(eos))
        raise ConfigError(
            "data.tokenizer_path",
            str(self.folder),
            "its tokenizer has no token for a newline and no eos_token to join documents with",
        )


def load_backend(folder: Path) -> Any:
    """The folder's tokenizer as a ``tokenizers.Tokenizer``: ``tokenizer.json`` as saved,
    else what ``transformers`` converts the other files to."""
    if (folder / "tokenizer.json").is_file():
        tokenizers = tokenizers_module("data.tokenizer 'model'", "hf")
        try:
            return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # a malformed or newer-format file
            raise ConfigError(
                "data.tokenizer_path", str(folder), f"tokenizer.json unreadable: {describe(exc)}"
            ) from None
    try:
        import transformers  # the hf extra: converts sentencepiece and vocab files
    except ImportError:
        raise ConvoyError(missing_extra("data.tokenizer 'model'", "transformers", "hf")) from None
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # a missing converter (sentencepiece, protobuf) among others
        raise ConfigError(
            "data.tokenizer_path", str(folder), f"transformers could not load it: {describe(exc)}"
        ) from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            "data.tokenizer_path",
            str(folder),
            f"transformers loaded a {type(loaded).__name__}, which has no tokenizers backend; "
            "save it as tokenizer.json (a fast tokenizer)",
        )
    return backend


def _special_roles(folder: Path) -> dict[str, str]:
    """``pad_token``, ``eos_token``... as ``tokenizer_config.json`` names them (a string, or
    a dict with ``content``); empty where the file is absent."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return {}
    roles: dict[str, str] = {}
    for role in ("pad_token", "eos_token"):
        value = config.get(role)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            roles[role] = value
    return roles


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"  # sentencepiece's word-start mark, "▁"


def model_token_strings(tokenizer: Any) -> list[bytes]:
    """The bytes each id stands for in decoded text, for bits per byte.

    Added tokens (special ones too: ``tokenizers`` matches them in the text itself) stand for
    their content. A byte-level BPE's tokens (GPT-2, Llama 3, Qwen: a ``ByteLevel`` decoder)
    map back to bytes exactly through GPT-2's byte-to-unicode table. Other tokenizers
    (sentencepiece, WordPiece) are counted as their decoders read them: a byte-fallback token
    ``<0xHH>`` is one byte, sentencepiece's ``▁`` is a space, WordPiece's continuation prefix
    (``##``) is nothing, anything else its UTF-8. A space a tokenizer adds at the start of a
    document counts as a byte although the text has none: a slight overcount of bytes, so
    bits per byte err low by at most one byte per document.
    """
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    strings = [b""] * size  # ids no token holds (a gap in the vocabulary) stand for nothing
    spec = json.loads(tokenizer.to_str())
    byte_level = _has_type(spec.get("decoder"), "ByteLevel")
    prefix = (spec.get("model") or {}).get("continuing_subword_prefix") or ""
    to_byte = byte_level_chars()
    added = {int(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    for token, index in vocab.items():
        if index in added:
            strings[index] = added[index].encode("utf-8")
        elif byte_level and all(c in to_byte for c in token):
            strings[index] = bytes(to_byte[c] for c in token)
        else:
            strings[index] = _piece_bytes(token, prefix)
    return strings


def _piece_bytes(token: str, prefix: str) -> bytes:
    fallback = BYTE_FALLBACK.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    if prefix and token.startswith(prefix):
        token = token[len(prefix) :]
    return token.replace(METASPACE, " ").encode("utf-8")


def _has_type(node: Any, kind: str) -> bool:
    """Whether a ``tokenizers`` JSON component (or one inside a ``Sequence``) is ``kind``."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == kind:
        return True
    return any(_has_type(child, kind) for child in node.get("decoders") or [])


def tokenizer_json(tokenizer: TextTokenizer) -> str | None:
    """What a run saves as its ``tokenizer.json``: the BPE it trained or the model's
    tokenizer (``tokenizers`` JSON); None for raw bytes."""
    return tokenizer.to_json() if isinstance(tokenizer, HFTokenizer) else None


def build_tokenizer(cfg: DataConfig, train_docs: list[str]) -> TextTokenizer:
    """The configured tokenizer; ``bpe`` is trained on ``train_docs``."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer()
    if cfg.tokenizer == "model":
        return ModelTokenizer(check_model_tokenizer(cfg.tokenizer_path))
    return BPETokenizer(train_docs, cfg.vocab_size)
