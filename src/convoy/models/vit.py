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

from convoy.models.attention import SelfAttention, init_role, xavier_uniform_fused_
from convoy.models.init import init_in_place, mark
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


class ViT(nn.Module):
    """Images (B, in_channels, image_size, image_size) -> class logits (B, num_classes).

    ``init`` picks the initialisation (see the module docstring); ``norm_eps`` is every
    LayerNorm's epsilon (torchvision uses 1e-6, ``nn.LayerNorm``'s default is 1e-5).
    """

    init_unit = "module"
    """``init_module`` sets a module's own parameters only (``convoy.models.init``)."""

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
        mark(self.head, init_role="head")
        self.init_scheme = init
        init_in_place(self)

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        """The ``init`` scheme's values for one module (after its ``reset_parameters``);
        Convoy calls it module by module (``convoy.models.init``)."""
        if self.init_scheme == "torchvision":
            _init_torchvision(module)
        else:
            _init_trunc_normal(module)

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


def _init_torchvision(module: nn.Module) -> None:
    """``torchvision.models.VisionTransformer``'s initialisation, with no pre-logits layer; in
    the blocks, ``nn.MultiheadAttention``'s own init (Xavier over the fused in_proj, out_proj
    keeping nn.Linear's default weight, zero biases) and the MLP Xavier with ~zero biases."""
    role = init_role(module)
    if isinstance(module, ViT):
        nn.init.zeros_(module.cls_token)
        nn.init.normal_(module.pos_embed, std=0.02)  # BERT's, not truncated
    elif isinstance(module, nn.Conv2d):  # the patch embedding
        fan_in = module.in_channels * math.prod(module.kernel_size)
        nn.init.trunc_normal_(module.weight, std=math.sqrt(1 / fan_in))
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear) and role == "qkv":
        xavier_uniform_fused_(module)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear) and role == "out":
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear) and role == "head":
        # A zero head: every class starts at the same logit, and the first steps train the
        # head on features the encoder already has instead of undoing a random readout.
        nn.init.zeros_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Linear):  # the MLP's
        nn.init.xavier_uniform_(module.weight)
        nn.init.normal_(module.bias, std=1e-6)


def _init_trunc_normal(module: nn.Module) -> None:
    """Truncated N(0, 0.02) for every linear weight, the class token and the position
    embedding, zero linear biases; the patch embedding and norms keep their defaults."""
    if isinstance(module, ViT):
        nn.init.trunc_normal_(module.pos_embed, std=0.02)
        nn.init.trunc_normal_(module.cls_token, std=0.02)
    elif isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
