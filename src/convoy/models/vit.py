"""Vision Transformer on plain ``torch.nn`` with ``scaled_dot_product_attention``.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), a class
token and learned position embeddings. ``blocks`` is an ``nn.ModuleList`` of ``ViTBlock`` so
sharding strategies can wrap each block (FSDP1 auto-wrap, FSDP2 ``fully_shard``).

The architecture is torchvision's ``VisionTransformer`` (``nn.MultiheadAttention``'s fused
``in_proj`` loads as the ``q``, ``k``, ``v`` projections, ``convoy.models.attention``), and two initialisations are
offered. Initialisation matters early on: with the same optimizer and data, the course ViT
reaches far higher validation accuracy in its first tens of steps with torchvision's scheme
(zero-initialised head, LayerNorm eps 1e-6) than with the truncated-normal one; see
``benchmarks/vit_course_early_cpu_2026-11-22.md``.

- ``torchvision`` (``vit_course``): exactly ``torchvision.models.VisionTransformer``'s.
- ``trunc_normal`` (``vit_tiny``): every linear weight, the class token and the position
  embedding ~ truncated N(0, 0.02), zero linear biases (the scheme ``vit_tiny``'s digits recipe
  was tuned with; kept so its numerics do not move).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import torch
from torch import nn

from convoy.models.attention import SelfAttention
from convoy.models.tensor_parallel import pre_norm_block_plan

InitScheme = Literal["torchvision", "trunc_normal"]
INIT_SCHEMES: tuple[InitScheme, ...] = ("torchvision", "trunc_normal")
TORCHVISION_NORM_EPS = 1e-6


class ViTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=norm_eps)
        self.attn = SelfAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden, eps=norm_eps)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Linear(mlp, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def init_torchvision(self) -> None:
        """torchvision's ``EncoderBlock``: ``nn.MultiheadAttention``'s own init, which
        torchvision leaves as it is, and the MLP Xavier with ~zero biases."""
        # Xavier over the fused (3 x hidden, hidden) in_proj, as MultiheadAttention draws it: a
        # smaller bound than Xavier on each of q, k and v separately.
        self.attn.init_qkv_(nn.init.xavier_uniform_)
        self.attn.proj.reset_parameters()  # out_proj keeps nn.Linear's default weight init
        nn.init.zeros_(self.attn.proj.bias)
        for module in self.mlp:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)


class ViT(nn.Module):
    """Images (B, in_channels, image_size, image_size) -> class logits (B, num_classes).

    ``init`` picks the initialisation (see the module docstring); ``norm_eps`` is every
    LayerNorm's epsilon (torchvision uses 1e-6, ``nn.LayerNorm``'s default is 1e-5).
    """

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
        init: InitScheme = "torchvision",
        norm_eps: float = TORCHVISION_NORM_EPS,
    ) -> None:
        super().__init__()
        if init not in INIT_SCHEMES:
            raise ValueError(f"init must be one of {INIT_SCHEMES}, got {init!r}")
        if image_size % patch_size:
            raise ValueError(
                f"image_size ({image_size}) must be divisible by patch_size ({patch_size})"
            )
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, hidden, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, hidden))
        self.blocks = nn.ModuleList(ViTBlock(hidden, heads, mlp, norm_eps) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden, eps=norm_eps)
        self.head = nn.Linear(hidden, num_classes)
        if init == "torchvision":
            self._init_torchvision()
        else:
            self._init_trunc_normal()

    def _init_torchvision(self) -> None:
        """``torchvision.models.VisionTransformer``'s initialisation, with no pre-logits layer."""
        fan_in = self.patch_embed.in_channels * math.prod(self.patch_embed.kernel_size)
        nn.init.trunc_normal_(self.patch_embed.weight, std=math.sqrt(1 / fan_in))
        if self.patch_embed.bias is not None:
            nn.init.zeros_(self.patch_embed.bias)
        nn.init.zeros_(self.cls_token)
        nn.init.normal_(self.pos_embed, std=0.02)  # BERT's, not truncated
        for module in self.modules():
            if isinstance(module, ViTBlock):
                module.init_torchvision()
        # A zero head: every class starts at the same logit, and the first steps train the
        # head on features the encoder already has instead of undoing a random readout.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def _init_trunc_normal(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        fused: set[nn.Module] = set()
        for module in self.modules():
            if isinstance(module, SelfAttention):
                module.init_qkv_(functools.partial(nn.init.trunc_normal_, std=0.02))
                fused.update(module.qkv_projections())
            elif isinstance(module, nn.Linear) and module not in fused:
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))

    def tensor_parallel_plan(self, tp_size: int) -> dict[str, Any]:
        """Megatron's split of each block over ``tp_size`` ranks
        (``convoy.models.tensor_parallel``)."""
        return pre_norm_block_plan(self.blocks, tp_size)


# Registered presets: ``functools.partial`` keeps ViT's signature, so the registry can check a
# recipe's kwargs against it and every preset value stays overridable.
vit_course = functools.partial(
    ViT,
    image_size=32,
    patch_size=4,
    depth=12,
    heads=8,
    hidden=384,
    mlp=768,
    init="torchvision",
    norm_eps=TORCHVISION_NORM_EPS,
)
"""The course's model: torchvision's ``VisionTransformer(image_size=32, patch_size=4,
num_layers=12, num_heads=8, hidden_dim=384, mlp_dim=768)`` with its initialisation and its
LayerNorm eps 1e-6, no dropout. 14.3 M parameters with 10 classes."""

vit_tiny = functools.partial(
    ViT,
    image_size=8,
    patch_size=2,
    depth=4,
    heads=4,
    hidden=64,
    mlp=128,
    init="trunc_normal",
    norm_eps=1e-5,
)
"""A small ViT for 8x8 digits and fast tests: patch 2, 4 layers, 4 heads, hidden 64; the
truncated-normal init and LayerNorm eps 1e-5 it has always had."""
