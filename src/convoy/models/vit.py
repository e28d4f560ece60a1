"""Vision Transformer on plain ``torch.nn`` with ``scaled_dot_product_attention``.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), a class
token and learned position embeddings. ``blocks`` is an ``nn.ModuleList`` of ``ViTBlock`` so
sharding strategies can wrap each block (FSDP1 auto-wrap, FSDP2 ``fully_shard``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each: batch, heads, tokens, head_dim
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, tokens, hidden))


class ViTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Linear(mlp, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        in_channels: int = 3,
        num_classes: int = 10,
        depth: int = 12,
        heads: int = 8,
        hidden: int = 384,
        mlp: int = 768,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be divisible by patch_size ({patch_size})"
            )
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, hidden, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, hidden))
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


# Registered presets: ``functools.partial`` keeps ViT's signature, so the registry can check a
# recipe's kwargs against it and every preset value stays overridable.
vit_course = functools.partial(
    ViT, image_size=32, patch_size=4, depth=12, heads=8, hidden=384, mlp=768
)
"""The reference course ViT: image 32, patch 4, 12 layers, 8 heads, hidden 384, MLP 768."""

vit_tiny = functools.partial(ViT, image_size=8, patch_size=2, depth=4, heads=4, hidden=64, mlp=128)
"""A small ViT for 8x8 digits and fast tests: patch 2, 4 layers, 4 heads, hidden 64."""
