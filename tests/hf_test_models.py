"""Model factories for the hf tests that a recipe names by import path."""

from __future__ import annotations

from convoy.models.huggingface import HuggingFaceModel, hf
from hf_helpers import LLAMA_TINY


def llama_without_units(vocab_size: int = 256) -> HuggingFaceModel:
    """A Llama whose class does not say which layers never split (``_no_split_modules``),
    as some models on the Hub do not."""
    model = hf(config=LLAMA_TINY, vocab_size=vocab_size).model
    model._no_split_modules = None
    return HuggingFaceModel(model, "causal_lm")
