"""Tiny Hugging Face model configs for the tests (built offline by ``transformers``)."""

from __future__ import annotations

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
