"""Tensor-parallel plans of the built-in transformers (``gpt``, ``vit_*``).

A model states its plan as ``tensor_parallel_plan(tp_size)``: module paths (``*`` matches one
path component) -> a ``torch.distributed.tensor.parallel`` style, as ``parallelize_module``
takes them. The plan here is Megatron's, as TorchTitan writes it: in each block the q, k and v
projections and the MLP's first linear are split column-wise (each rank computes its own heads
and its own hidden units), the attention output and the MLP's second linear row-wise (their
partial sums are all-reduced into the residual stream). ``gpt`` adds sequence parallelism
(``sequence_parallel_block_plan``); ``vit_*`` keeps the blocks' norms whole on every rank
(``ReplicateParallel``: traceable inside a compiled, checkpointed block), since its 65 (or
17) tokens do not split. Everything outside the blocks (embeddings, the final norm, the
head) stays whole.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from convoy.models.attention import SelfAttention


def pre_norm_block_plan(blocks: nn.ModuleList, tp_size: int) -> dict[str, Any]:
    """The plan for ``blocks`` of pre-norm transformer blocks (``attn``: a ``SelfAttention``,
    ``mlp``: Linear, activation, Linear), under ``blocks.*``. Raises ``ValueError`` where
    ``tp_size`` does not divide the heads or the MLP's width."""
    # DTensor's modules take 1-2 s to import: only tensor parallelism pays them.
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


def sequence_parallel_block_plan(blocks: nn.ModuleList, tp_size: int) -> dict[str, Any]:
    """``pre_norm_block_plan`` with sequence parallelism, as TorchTitan's ``parallelize``:
    between the split layers the residual stream is cut along the sequence (dim 1), so each
    rank normalizes and keeps 1 / tp of the tokens; it is all-gathered into each attention
    and MLP, and the row-wise outputs are reduce-scattered back (the same bytes as the
    all-reduce they replace). The first block cuts the stream; the model's final ``norm``
    gathers it back. Needs sequences whose length ``tp_size`` divides."""
    # DTensor's modules take 1-2 s to import: only tensor parallelism pays them.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gathered(local: bool = False) -> PrepareModuleInput:
        """The sequence-cut stream all-gathered whole (into a split layer, or the end)."""
        return PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=local
        )

    plan = pre_norm_block_plan(blocks, tp_size)
    plan |= {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "blocks.*.norm1": SequenceParallel(),
        "blocks.*.attn": gathered(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.norm2": SequenceParallel(),
        "blocks.*.mlp": gathered(),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": gathered(local=True),
    }
    return plan
