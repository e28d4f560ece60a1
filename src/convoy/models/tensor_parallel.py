"""Tensor-parallel plans of the built-in transformers (``gpt``, ``vit_*``).

A model states its plan as ``tensor_parallel_plan(tp_size)``: module paths (``*`` matches one
path component) -> a ``torch.distributed.tensor.parallel`` style, as ``parallelize_module``
takes them. The plan here is Megatron's, as TorchTitan writes it: in each block the q, k and v
projections and the MLP's first linear are split column-wise (each rank computes its own heads
and its own hidden units), the attention output and the MLP's second linear row-wise (their
partial sums are all-reduced into the residual stream). The blocks' norms stay whole on every
rank (``ReplicateParallel``: traceable inside a compiled, checkpointed block), and so does
everything outside the blocks (embeddings, the final norm, the head).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from convoy.models.attention import SelfAttention


def pre_norm_block_plan(blocks: nn.ModuleList, tp_size: int) -> dict[str, Any]:
    """The plan for ``blocks`` of pre-norm transformer blocks (``attn``: a ``SelfAttention``,
    ``mlp``: Linear, activation, Linear), under ``blocks.*``. Raises ``ValueError`` where
    ``tp_size`` does not divide the heads or the MLP's width."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from convoy.strategies.tensor_parallel import ReplicateParallel

    first = blocks[0]
    attn, mlp = first.attn, first.mlp
    assert isinstance(attn, SelfAttention)
    if attn.heads % tp_size:
        raise ValueError(f"the model's {attn.heads} attention heads do not split over {tp_size}")
    assert isinstance(mlp, nn.Sequential) and isinstance(mlp[0], nn.Linear)
    width = mlp[0].out_features
    if width % tp_size:
        raise ValueError(f"the model's MLP width {width} does not split over {tp_size}")
    return {
        "blocks.*.norm1": ReplicateParallel(),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(),
        "blocks.*.norm2": ReplicateParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
    }
