"""Packed sequences: several samples in one row, attending only within themselves.

Fine-tuning data packs short samples into rows of ``seq_len`` tokens (``convoy.data``). A
batch's inputs are then ``{"input_ids": (B, T), "position_ids": (B, T)}``, with positions
that restart at each sample's first token. A sample starts wherever a position is not the one
before it plus one (the rule ``transformers`` uses to find packed sequences,
``masking_utils.find_packed_sequence_indices``), so Convoy's ``gpt`` and ``hf`` models draw
the same boundaries. The attention mask is block-causal: a token sees the earlier tokens of
its own sample only, so a sample's logits are the same packed or alone (on CPU too: a boolean
mask for ``scaled_dot_product_attention``, no FlashAttention varlen kernel needed).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def token_inputs(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, position_ids)`` of a batch's inputs: a tensor of token ids (positions
    None: one sample a row from position 0), or a mapping with both."""
    if isinstance(inputs, Mapping):
        return inputs["input_ids"], inputs.get("position_ids")
    return inputs, None


def sample_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sample within its row, ``(B, T)``: 0 for the first, counting up at each
    token whose position is not the previous one's plus one."""
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    return starts.cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """``(B, 1, T, T)`` boolean mask (True: may attend) that is causal within each sample and
    closed across samples; None where every row is a single sample (plain causal attention,
    the fused kernel's ``is_causal`` path)."""
    samples = sample_ids(position_ids)
    if bool((samples[:, -1] == 0).all()):
        return None
    tokens = position_ids.shape[1]
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=position_ids.device).tril()
    same = samples.unsqueeze(-1) == samples.unsqueeze(-2)
    return (same & causal).unsqueeze(1)
