"""Multi-head self-attention shared by the ``gpt`` and ``vit_*`` models.

The query, key and value projections are three ``nn.Linear`` (``q``, ``k``, ``v``) rather than
one fused matrix, so tensor parallelism can split each column-wise and every rank holds whole
heads (a fused matrix split by rows would hand a rank some queries and some keys). The
forward infers the number of heads from its input (``-1``): under tensor parallelism a rank
computes its own heads with the same code.

Nothing else changes against a fused projection:

- each of q, k and v is marked ``init_role = "qkv"`` with the fused matrix's rows
  (``fused_out_features``), so Xavier's fan (``xavier_uniform_fused_``) is a fused
  projection's; the output projection is marked ``"out"``. Models initialize module by
  module (``init_module``, ``convoy.models.init``) and read these marks;
- a state dict with a fused ``qkv.weight`` / ``qkv.bias`` (``nn.MultiheadAttention``'s
  ``in_proj`` layout: queries, keys, values) loads, split into the three.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from convoy.models.init import mark

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
        for linear in self.qkv_projections():
            mark(linear, init_role="qkv", fused_out_features=3 * hidden)
        mark(self.proj, init_role="out")
        self.register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: a boolean ``(B, 1, T, T)`` mask (True: may attend), for packed samples
        (``convoy.models.packing``); None: causal or full, as built."""
        batch, tokens, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallelism.
        q, k, v = (
            linear(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)
            for linear in (self.q, self.k, self.v)
        )  # each: batch, heads, tokens, head_dim
        dropout = self.dropout if self.training else 0.0
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, -1))

    def qkv_projections(self) -> list[nn.Linear]:
        return [self.q, self.k, self.v]


def init_role(module: nn.Module) -> str | None:
    """The role a model marked a layer with at construction (``qkv``, ``out``, ...), which its
    ``init_module`` reads; None for an unmarked one."""
    return getattr(module, "init_role", None)


@torch.no_grad()
def xavier_uniform_fused_(linear: nn.Linear) -> None:
    """Xavier-uniform over ``linear``'s weight with the fan of the fused projection it is a
    part of (``fused_out_features`` rows; ``nn.MultiheadAttention``'s ``in_proj``): a smaller
    bound than Xavier over the part alone."""
    fan_out = getattr(linear, "fused_out_features", linear.out_features)
    bound = math.sqrt(6.0 / (linear.in_features + fan_out))
    nn.init.uniform_(linear.weight, -bound, bound)


def _split_fused_qkv(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load a fused ``qkv`` projection (the layout before the split) as ``q``, ``k``, ``v``."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is not None:
            for name, part in zip(PROJECTIONS, fused.chunk(3), strict=True):
                state_dict[f"{prefix}{name}.{kind}"] = part
