"""Small data and tasks for the task tests, importable by spawned ranks.

``tests/`` is on ``sys.path`` (the rootdir conftest), and spawned ranks inherit it, so a job can
name ``data.name=task_data_helpers:ragged_lm`` or ``task.name=task_data_helpers:PerRankMeanLM``.

``ragged_lm`` is a language-modeling set whose sequences have random numbers of real tokens
(1 to ``seq_len``), the rest padding (inputs 0, targets -100): two ranks holding halves of a
global batch hold different numbers of tokens, so only a mean over the global count is exact.
The tokens follow a rule (``next = 5 * token + 3 mod vocab``, with some noise), so a tiny
model learns and the step losses move.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from convoy.tasks import LanguageModeling

IGNORE_INDEX = -100
PAD_ID = 0
VOCAB = 64
SEQ_LEN = 32
GPT_TINY_OVERRIDES = (
    "model.name=gpt_tiny",
    "model.kwargs.depth=2",
    "model.kwargs.hidden=32",
    "model.kwargs.heads=2",
    "model.kwargs.context_length=64",
)
GPT_TINY_KWARGS = {"depth": 2, "hidden": 32, "heads": 2, "context_length": 64}


def token_bytes(vocab: int = VOCAB) -> list[int]:
    """A made-up byte length per token id (1 to 3), so bits per byte differ from per token."""
    return [1 + i % 3 for i in range(vocab)]


def ragged_sequences(
    count: int, seq_len: int, vocab: int, generator: torch.Generator
) -> TensorDataset:
    """``count`` (input_ids, target_ids) pairs of ``seq_len``, each with 1..seq_len real targets."""
    columns = [torch.randint(0, vocab, (count,), generator=generator)]
    for _ in range(seq_len):
        columns.append((5 * columns[-1] + 3) % vocab)
    stream = torch.stack(columns, dim=1)
    noise = torch.rand(count, seq_len + 1, generator=generator) < 0.1
    stream = torch.where(noise, torch.randint_like(stream, vocab, generator=generator), stream)
    lengths = torch.randint(1, seq_len + 1, (count, 1), generator=generator)
    real = torch.arange(seq_len) < lengths
    inputs = torch.where(real, stream[:, :-1], PAD_ID)
    targets = torch.where(real, stream[:, 1:], IGNORE_INDEX)
    return TensorDataset(inputs, targets)


def ragged_lm(
    train: int = 96, val: int = 37, test: int = 41, seq_len: int = SEQ_LEN, seed: int = 0
) -> dict[str, Any]:
    """A user data factory: ragged LM splits (odd val / test by default), vocab ``VOCAB``."""
    generator = torch.Generator().manual_seed(seed)
    splits = {
        name: ragged_sequences(size, seq_len, VOCAB, generator)
        for name, size in (("train", train), ("val", val), ("test", test))
    }
    return {
        **splits,
        "shape": {"vocab_size": VOCAB},
        "meta": {"token_bytes": token_bytes()},
    }


def real_tokens(dataset: TensorDataset) -> torch.Tensor:
    """Real target tokens per sequence of a ``ragged_lm`` split."""
    return (dataset.tensors[1] != IGNORE_INDEX).sum(dim=1)


class PerRankMeanLM(LanguageModeling):
    """The naive distributed LM loss, for controls: each rank's own token mean.

    ``count`` is the batch's positions (real or not), the same on every rank, and ``loss_sum``
    is the rank's token mean times it; the engine divides by the positions of the global batch,
    so each rank's gradient is of its own mean and DDP averages the means. On one process
    this is the exact token mean (the same gradient as ``LanguageModeling``).
    """

    fixed_count = True

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        real = super().count(targets).clamp_min(1)
        return super().loss_sum(outputs, targets) / real * targets.numel()

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(targets.numel(), device=targets.device)


class ResidualMLPBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class PlannedMLP(torch.nn.Module):
    """A user's model with its own tensor-parallel plan: each block's ``up`` split by
    columns, ``down`` by rows; the blocks' norms, the stem and the head left to Convoy."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(in_channels * image_size * image_size, 32)
        self.blocks = torch.nn.ModuleList(ResidualMLPBlock(32) for _ in range(2))
        self.head = torch.nn.Linear(32, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def tensor_parallel_plan(self, tp_size: int) -> dict[str, Any]:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}


def tuple_inputs(rows: int = 8) -> dict[str, Any]:
    """A user data factory whose inputs are tuples of tensors (for loaders that need a tensor,
    or a dict of them)."""
    items = [
        ((torch.full((3,), float(i)), torch.zeros(2)), torch.tensor(i % 2)) for i in range(rows)
    ]
    return {"train": items, "val": items, "test": items, "shape": {"num_classes": 2}}


def write_text_shards(
    root: Path, splits: dict[str, list[str | None]], rows_per_group: int = 5, shards: int = 2
) -> Path:
    """A streamed text corpus: ``root/<split>/part-N.parquet`` with a ``text`` column, each
    split's documents cut into ``shards`` files of ``rows_per_group``-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, docs in splits.items():
        folder = root / split
        folder.mkdir(parents=True)
        per_shard = -(-len(docs) // shards)
        for n in range(shards):
            part = docs[n * per_shard : (n + 1) * per_shard]
            table = pa.table({"text": pa.array(part, type=pa.string())})
            pq.write_table(table, folder / f"part-{n}.parquet", row_group_size=rows_per_group)
    return root
