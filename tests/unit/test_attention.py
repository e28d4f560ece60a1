"""The shared self-attention: separate q, k, v projections that behave as one fused matrix."""

from __future__ import annotations

import torch
from torch import nn

from convoy.models.attention import SelfAttention, init_role, xavier_uniform_fused_


def test_qkv_xavier_has_the_fan_of_one_fused_matrix() -> None:
    """Each of q, k, v is a third of a fused (3 x hidden, hidden) projection: Xavier's bound is
    the fused matrix's (nn.MultiheadAttention's in_proj), smaller than the part's own."""
    attn = SelfAttention(hidden=32, heads=4)
    assert [init_role(linear) for linear in attn.qkv_projections()] == ["qkv"] * 3
    assert init_role(attn.proj) == "out"
    torch.manual_seed(0)
    xavier_uniform_fused_(attn.q)
    torch.manual_seed(0)
    fused = nn.init.xavier_uniform_(torch.empty(96, 32))  # the fan of a (96, 32) matrix
    # The same draw over the part's shape, within the same bound.
    assert torch.equal(attn.q.weight, fused.flatten()[: 32 * 32].view(32, 32))
    assert attn.q.weight.abs().max() <= (6 / (32 + 96)) ** 0.5 < (6 / (32 + 32)) ** 0.5


def test_a_fused_qkv_state_dict_loads_split() -> None:
    attn = SelfAttention(hidden=32, heads=4)
    fused = {
        "qkv.weight": torch.randn(96, 32),
        "qkv.bias": torch.randn(96),
        "proj.weight": torch.randn(32, 32),
        "proj.bias": torch.randn(32),
    }
    attn.load_state_dict(fused)
    assert torch.equal(attn.k.weight, fused["qkv.weight"][32:64])
    assert torch.equal(attn.v.bias, fused["qkv.bias"][64:])
    assert set(attn.state_dict()) == {
        f"{name}.{kind}" for name in ("q", "k", "v", "proj") for kind in ("weight", "bias")
    }


def test_heads_follow_the_projections_width() -> None:
    """A rank holding half the heads' columns (tensor parallelism) attends over its own."""
    full = SelfAttention(hidden=32, heads=4, causal=True)
    x = torch.randn(2, 5, 32)
    half = SelfAttention(hidden=32, heads=4, causal=True)
    with torch.no_grad():
        for name in ("q", "k", "v"):
            source, target = getattr(full, name), getattr(half, name)
            target.weight = nn.Parameter(source.weight[:16])
            target.bias = nn.Parameter(source.bias[:16])
        half.proj.weight = nn.Parameter(full.proj.weight[:, :16])
        nn.init.zeros_(half.proj.bias)
        rest = SelfAttention(hidden=32, heads=4, causal=True)
        for name in ("q", "k", "v"):
            source, target = getattr(full, name), getattr(rest, name)
            target.weight = nn.Parameter(source.weight[16:])
            target.bias = nn.Parameter(source.bias[16:])
        rest.proj.weight = nn.Parameter(full.proj.weight[:, 16:])
        rest.proj.bias = full.proj.bias
        torch.testing.assert_close(half(x) + rest(x), full(x), atol=1e-6, rtol=1e-5)
