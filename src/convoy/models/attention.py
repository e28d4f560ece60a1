"""Multi-head self-attention shared by the ``gpt`` and ``vit_*`` models.

The query, key and value projections are three ``nn.Linear`` (``q``, ``k``, ``v``) rather than
one fused matrix, so tensor parallelism can split each column-wise and every rank holds whole
heads (a fused matrix split by rows would hand a rank some queries and some keys). The
forward infers the number of heads from its input (``-1``): under tensor parallelism a rank
computes its own heads with the same code.

Nothing else changes against a fused projection:

- ``init_qkv_`` draws q, k and v as one (3 x hidden, hidden) matrix and splits it, so seeded
  initial weights (and Xavier's fan) are a fused projection's, bit for bit;
- a state dict with a fused ``qkv.weight`` / ``qkv.bias`` (``nn.MultiheadAttention``'s
  ``in_proj`` layout: queries, keys, values) loads, split into the three.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PROJECTIONS = ("q", "k", "v")


class SelfAttention(nn.Module):
    """``x`` (batch, tokens, hidden) -> (batch, tokens, hidden) over ``heads`` heads, with
    ``F.scaled_dot_product_attention`` (a fused kernel where PyTorch has one)."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0, causal: bool = False) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.causal = causal
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q, k, v = (
            linear(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            for linear in (self.q, self.k, self.v)
        )  # each: batch, heads, tokens, head_dim
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, -1))

    def qkv_projections(self) -> list[nn.Linear]:
        return [self.q, self.k, self.v]

    @torch.no_grad()
    def init_qkv_(self, init: Callable[[torch.Tensor], Any]) -> None:
        """Initialise the q, k and v weights as one fused matrix with ``init`` (an
        ``nn.init`` function), split in three; zero their biases."""
        fused = torch.empty(3 * self.q.out_features, self.q.in_features)
        init(fused)
        for linear, part in zip(self.qkv_projections(), fused.chunk(3), strict=True):
            linear.weight.copy_(part)
            nn.init.zeros_(linear.bias)


def _split_fused_qkv(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load a fused ``qkv`` projection (the layout before the split) as ``q``, ``k``, ``v``."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip(PROJECTIONS, fused.chunk(3), strict=True):
                state_dict[f"{prefix}{name}.{kind}"] = part
