"""A GPT-style causal language model on plain ``torch.nn``.

Token and learned position embeddings, pre-norm decoder blocks (LayerNorm -> causal
self-attention -> residual, LayerNorm -> GELU MLP -> residual), a final LayerNorm and an output
head whose weight is the token embedding's (tied, as in GPT-2). Attention is
``F.scaled_dot_product_attention(is_causal=True)``, so PyTorch picks a fused kernel where one
exists. ``blocks`` is an ``nn.ModuleList`` of ``GPTBlock``: the FSDP strategies shard per block.

The context length is a property of the model (the size of its position table), not of the
data: a dataset's ``seq_len`` is not accepted, and a longer input is an error.

Given ``targets``, ``forward`` returns the training loss sum instead of the logits, by the
path ``head_loss`` names (``convoy.models.head_loss``): with ``auto``, the full logits for a
small batch and the head fused with the cross-entropy for a large one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from convoy.models.attention import SelfAttention
from convoy.models.head_loss import check_head_loss, head_loss_sum, resolve_head_loss
from convoy.models.init import init_in_place, mark
from convoy.models.packing import block_causal_mask, token_inputs
from convoy.models.tensor_parallel import sequence_parallel_block_plan

INIT_STD = 0.02
"""GPT-2's standard deviation for every weight matrix and embedding."""


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        mlp = round(hidden * mlp_ratio)
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, dropout, causal=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Linear(mlp, hidden))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: packed samples' block-causal mask (``convoy.models.packing``)."""
        # By keyword: tensor parallelism's input hooks lay out the positional stream only.
        x = x + self.drop(self.attn(self.norm1(x), mask=mask))
        return x + self.drop(self.mlp(self.norm2(x)))

    def residual_projections(self) -> list[nn.Linear]:
        """The two linears that write into the residual stream (scaled at init)."""
        out = self.mlp[-1]
        assert isinstance(out, nn.Linear)
        return [self.attn.proj, out]


class GPT(nn.Module):
    """A decoder-only transformer: ``input_ids`` (B, T) -> next-token logits (B, T, vocab_size).

    Initialised as GPT-2 / nanoGPT (``init_module``): every linear weight and embedding ~ N(0,
    0.02), the two residual projections of each block (attention output, MLP output) ~ N(0,
    0.02 / sqrt(2 * depth)) so the residual stream's variance does not grow with depth, every
    bias zero, LayerNorms at weight 1 and bias 0. The output head shares the token embedding's
    weight. Built by Convoy, it starts on the meta device and each module is filled from its
    own seed, whatever the layout (``convoy.models.init``).
    """

    init_unit = "module"
    """``init_module`` sets a module's own parameters only (``convoy.models.init``)."""

    def __init__(
        self,
        vocab_size: int = 256,
        context_length: int = 256,
        depth: int = 4,
        heads: int = 4,
        hidden: int = 128,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        head_loss: str = "auto",
    ) -> None:
        super().__init__()
        check_head_loss(head_loss)
        self.head_loss = head_loss
        self.context_length = context_length
        self.token_embed = nn.Embedding(vocab_size, hidden)
        self.pos_embed = nn.Embedding(context_length, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(hidden, heads, mlp_ratio, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab_size, bias=False)
        self.head.weight = self.token_embed.weight  # tied: one Parameter, counted once
        residual_std = INIT_STD / math.sqrt(2 * depth)
        for block in self.blocks:
            assert isinstance(block, GPTBlock)
            for linear in block.residual_projections():
                mark(linear, residual_std=residual_std)
        init_in_place(self)

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        """GPT-2's init of one module (after its ``reset_parameters``): linear weights and
        embeddings ~ N(0, 0.02), the residual projections (marked ``residual_std`` at
        construction) ~ N(0, 0.02 / sqrt(2 * depth)), biases zero; LayerNorms keep their
        defaults (weight 1, bias 0). Convoy calls it module by module (``convoy.models.init``)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(module, "residual_std", INIT_STD))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=INIT_STD)

    computes_loss = True
    """``forward(input_ids, targets=...)`` returns the loss sum (the language-modeling task
    asks for it in training)."""

    def forward(
        self, input_ids: Any, targets: torch.Tensor | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        """Next-token logits ``(B, T, vocab)``; with ``targets``, the cross-entropy *sum* over
        the targets that are not ``ignore_index`` (the head and the loss as one step where
        that pays, see ``head_loss``). ``input_ids``: token ids ``(B, T)``, or packed samples
        ``{"input_ids", "position_ids"}`` (``convoy.models.packing``)."""
        tokens, positions = token_inputs(input_ids)
        hidden = self.norm(self.hidden_states(tokens, positions))
        if targets is None:
            return self.head(hidden)
        rows, vocab = targets.numel(), self.head.weight.shape[0]
        path = resolve_head_loss(self.head_loss, rows, vocab, hidden.device, self.head.weight)
        if path == "logits":  # through the module: a tensor-parallel plan hooks its call
            logits = self.head(hidden).float().flatten(0, -2)
            return F.cross_entropy(
                logits, targets.flatten(), ignore_index=ignore_index, reduction="sum"
            )
        return head_loss_sum(hidden, self.head.weight, targets, ignore_index, path)

    def hidden_states(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last block's output, before the final norm and the head. ``position_ids``:
        packed samples' positions, restarting per sample; each attends within itself."""
        tokens = input_ids.shape[1]
        if tokens > self.context_length:
            raise ValueError(
                f"sequence length {tokens} is longer than the model's context_length "
                f"{self.context_length}"
            )
        mask = None
        if position_ids is None:
            positions = torch.arange(tokens, device=input_ids.device)
        else:
            positions, mask = position_ids, block_causal_mask(position_ids)
        x = self.drop(self.token_embed(input_ids) + self.pos_embed(positions))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask=mask)
        return x

    def tensor_parallel_plan(self, tp_size: int) -> dict[str, Any]:
        """Megatron's split of each block over ``tp_size`` ranks, with sequence-parallel
        norms (``convoy.models.tensor_parallel``)."""
        return sequence_parallel_block_plan(self.blocks, tp_size)


# Registered presets: ``functools.partial`` keeps GPT's signature, so the registry can check a
# recipe's kwargs against it and every preset value stays overridable. Parameter counts are
# measured by building on the meta device (tied head counted once).
gpt_tiny = functools.partial(GPT, context_length=256, depth=4, heads=4, hidden=128)
"""A CPU-sized GPT: hidden 128, 4 layers, 4 heads, context 256. 0.86 M parameters with the
byte vocabulary (256), 1.09 M with a 2,048-token BPE vocabulary."""

gpt_small = functools.partial(GPT, context_length=1024, depth=12, heads=12, hidden=768)
"""GPT-2 small's shape: hidden 768, 12 layers, 12 heads, context 1024. 124.5 M parameters with
GPT-2's padded vocabulary (50,304), 87.4 M with a 2,048-token vocabulary."""

gpt_1b = functools.partial(GPT, context_length=2048, depth=20, heads=16, hidden=2048)
"""A ~1.1 B model for multi-GPU FSDP: hidden 2048, 20 layers, 16 heads (head size 128),
context 2048. 1.11 B parameters with a 50,304-token vocabulary, 1.02 B with 2,048 tokens."""
