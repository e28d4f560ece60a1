"""Tiny Hugging Face models and folders built offline: configs of a Llama- and a GPT-2-shaped
model, a model factory a recipe names by import path, a byte-level BPE tokenizer, a Llama
saved with it, and datasets saved with ``datasets``. Nothing is downloaded; each builder takes well under a
second once ``transformers`` (or ``datasets``) is imported.

Callers skip without the ``hf`` extra (``pytest.importorskip("transformers")``); the imports
of ``tokenizers``, ``transformers`` and ``datasets`` stay inside the builders for that reason.
"""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import torch

from convoy.models.huggingface import HuggingFaceModel, hf

LLAMA_TINY = {
    # Llama's shape at toy size: grouped-query attention (4 heads, 2 key/value heads), RMSNorm,
    # rotary positions, a SwiGLU MLP; the vocabulary comes from the data.
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
GPT2_TINY = {
    # GPT-2's shape: learned positions, LayerNorm, a fused qkv Conv1D, the head tied to the
    # token embedding. Dropout off: ranks draw other masks than one process does.
    "model_type": "gpt2",
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}


def hf_overrides(config: dict[str, object]) -> list[str]:
    """``-o`` overrides that make ``model`` the hf model of ``config``."""
    return ["model.name=hf", *(f"model.kwargs.config.{k}={v}" for k, v in config.items())]


BYTE_TEXT_LM = [
    # The hf tests' language-modelling job: the bundled text as bytes, short rows, a few
    # steps at a high rate (losses move visibly, and layouts must agree on them).
    "task.name=language_modeling",
    "data.name=text",
    "data.tokenizer=bytes",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batch_size=64",
    "data.train_size=64",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
]


def llama_without_units(vocab_size: int = 256) -> HuggingFaceModel:
    """A Llama whose class does not say which layers never split (``_no_split_modules``),
    as some models on the Hub do not."""
    model = hf(config=LLAMA_TINY, vocab_size=vocab_size).model
    model._no_split_modules = None
    return HuggingFaceModel(model, "causal_lm")


SPECIAL = "<|endoftext|>"
"""The tokenizer's one special token (id 0): its BOS, EOS and pad, as GPT-2's."""


def corpus(docs: int = 30) -> list[str]:
    """The first ``docs`` of CPython's pydoc topics (about 2 kB each): text every Python has."""
    return [topics[name] for name in sorted(topics)[:docs]]


def byte_level_bpe(vocab_size: int) -> Any:
    """A ``tokenizers.Tokenizer``: a GPT-2-style byte-level BPE of ``vocab_size`` tokens, the
    special token first, trained on ``corpus()`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[SPECIAL],
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer


def save_tokenizer(folder: Path, vocab_size: int = 320, added: tuple[str, ...] = ()) -> Path:
    """A tokenizer folder as ``save_pretrained`` writes it (``tokenizer.json``,
    ``tokenizer_config.json``), with ``added`` tokens after the BPE's ``vocab_size``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(vocab_size),
        bos_token=SPECIAL,
        eos_token=SPECIAL,
        pad_token=SPECIAL,
    )
    fast.add_tokens(list(added))
    fast.save_pretrained(str(folder))
    return folder


def saved_llama(
    folder: Path,
    vocab_size: int = 320,
    with_tokenizer: bool = True,
    tokenizer_vocab: int | None = None,
    max_positions: int = 128,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
) -> Path:
    """A tiny Llama (2 layers, hidden 32, ~30 k parameters) saved with ``save_pretrained``
    into ``folder``: config.json, model.safetensors and, ``with_tokenizer``, a byte-level BPE
    of ``tokenizer_vocab`` tokens (default: ``vocab_size``, the model's). Its pad, BOS and EOS
    are the tokenizer's special token, id 0. Seeded: the same weights every time. ``dtype``:
    the weights' dtype on disk; ``max_shard_size``: split into shards of at most that (with
    ``model.safetensors.index.json``), as the Hub ships large models."""
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" is noise here
    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(dtype)
        sharding = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(str(folder), **sharding)
    if with_tokenizer:
        save_tokenizer(folder, tokenizer_vocab or vocab_size)
    return folder


def saved_text_dataset(
    folder: Path, splits: tuple[str, ...] = ("train", "validation", "test")
) -> Path:
    """``corpus()`` as a ``DatasetDict`` with a ``text`` column, saved with ``save_to_disk``:
    18 train documents, 6 per other split (only the ``splits`` named)."""
    import datasets

    datasets.disable_progress_bars()
    docs = corpus()
    parts = {"train": docs[:18], "validation": docs[18:24], "test": docs[24:30]}
    saved = datasets.DatasetDict(
        {name: datasets.Dataset.from_dict({"text": parts[name]}) for name in splits}
    )
    saved.save_to_disk(str(folder))
    return folder


def labelled_rows(rows: int = 120, seed: int = 0) -> dict[str, list[Any]]:
    """Rows a model can learn from: four numeric features (one a list of two), a class that
    is the sign of their sum (names ``neg``/``pos``), a float target (their weighted sum), and
    a short text that says the class in words."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=generator)
    value = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    label = (x.sum(dim=1) > 0).long()
    words = ["cold grey quiet night", "bright warm sunny day"]
    return {
        "a": x[:, 0].tolist(),
        "b": x[:, 1].tolist(),
        "pair": x[:, 2:].tolist(),
        "label": label.tolist(),
        "score": value.tolist(),
        "text": [f"{words[int(y)]} number {i}" for i, y in enumerate(label)],
    }


def saved_labelled_dataset(folder: Path, with_splits: bool = False) -> Path:
    """``labelled_rows`` saved with ``save_to_disk``, ``label`` a ClassLabel (neg, pos): one
    Dataset, or a DatasetDict with train and test (val held out by Convoy)."""
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features(
        {
            "a": datasets.Value("float32"),
            "b": datasets.Value("float32"),
            "pair": datasets.List(datasets.Value("float32")),
            "label": datasets.ClassLabel(names=["neg", "pos"]),
            "score": datasets.Value("float32"),
            "text": datasets.Value("string"),
        }
    )
    if not with_splits:
        datasets.Dataset.from_dict(labelled_rows(), features=features).save_to_disk(str(folder))
        return folder
    parts = {"train": labelled_rows(120, seed=0), "test": labelled_rows(40, seed=1)}
    saved = datasets.DatasetDict(
        {name: datasets.Dataset.from_dict(rows, features=features) for name, rows in parts.items()}
    )
    saved.save_to_disk(str(folder))
    return folder
