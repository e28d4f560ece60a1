"""``language_modeling``: causal next-token prediction, the loss weighted by real tokens.

A batch is ``(input_ids, target_ids)``, both ``(N, T)``, where ``target_ids`` are the inputs
shifted by one and padding is ``ignore_index`` (-100) in the targets. The loss sums the
cross-entropy (nats) over real target tokens; its count is the number of real tokens, so a
mean is per token whatever the padding, the ranks or the accumulation.

Reported per split: ``loss`` (nats per token), ``ppl`` (exp of it), ``tokens`` and, when the
data says how many bytes each token id stands for (``meta["token_bytes"]``), ``bpb``: bits
per byte of the text the targets cover, comparable across tokenizers and with compressors.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from convoy.tasks.base import Mode, Task, inner_model, perplexity
from convoy.tasks.metrics import SumMetric

IGNORE_INDEX = -100
TOKENS_CHECKED = 100_000
"""Sequences whose token ids are checked against the vocabulary before training (all of a
packed text stream)."""


class LanguageModeling(Task):
    """Causal LM: logits ``(N, T, V)`` against next tokens ``(N, T)``, padding ignored."""

    name = "language_modeling"
    count_name = "tokens"
    fixed_count = False
    progress_metrics = ("ppl", "bpb")
    required_shape = ("vocab_size",)
    rank_modes: ClassVar[dict[str, Mode]] = {"loss": "min", "ppl": "min", "bpb": "min"}

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def forward_loss(self, model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor]:
        """A model that computes its own loss (``computes_loss``: ``gpt``) gets the targets
        and returns the loss sum, so it may fuse its head with the cross-entropy and never
        hold the batch's logits; the metrics then see no outputs (they read the targets)."""
        if self.model_computes_loss(model):
            return None, model(inputs, targets=targets, ignore_index=self.ignore_index)
        return super().forward_loss(model, inputs, targets)

    def model_computes_loss(self, model: nn.Module) -> bool:
        return bool(getattr(inner_model(model), "computes_loss", False))

    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            outputs.float().flatten(0, -2),
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        return (targets != self.ignore_index).sum()

    def metric_names(self, shape: dict[str, int], meta: dict[str, Any]) -> set[str]:
        return {"bytes"} if "token_bytes" in meta else set()

    def metrics(self, shape: dict[str, int], meta: dict[str, Any]) -> dict[str, SumMetric]:
        if "token_bytes" not in meta:
            return {}
        return {"bytes": TargetBytes(meta["token_bytes"], self.ignore_index)}

    def metric_inputs(self, outputs: Any, targets: Any) -> tuple[Any, Any]:
        # Only the targets are read: no logits held back for a batched update.
        return None, targets

    def derived(self, values: dict[str, float]) -> dict[str, float]:
        derived = {"ppl": perplexity(values["loss"])}
        if values.get("bytes"):
            nats = values["loss"] * values["tokens"]
            derived["bpb"] = nats / math.log(2) / values["bytes"]
        return derived

    def check_data(self, splits: Any) -> None:
        vocab = splits.shape["vocab_size"]
        for split in ("train", "val", "test"):
            dataset = getattr(splits, split)
            stream = getattr(dataset, "tokens", None)  # packed text: one token stream
            if isinstance(stream, torch.Tensor):
                largest = int(stream.max()) if len(stream) else -1
            else:
                items = [dataset[i] for i in range(min(len(dataset), TOKENS_CHECKED))]
                ids = [t.flatten() for item in items for t in item if isinstance(t, torch.Tensor)]
                real = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
                real = real[real != self.ignore_index]
                largest = int(real.max()) if len(real) else -1
            if largest >= vocab:
                raise ValueError(
                    f"the {split} split holds token id {largest}, but shape['vocab_size'] is "
                    f"{vocab}: ids must be below the vocabulary size"
                )

    def check_output(self, outputs: Any, targets: Any, shape: dict[str, int]) -> None:
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 3:
            got = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs)
            raise ValueError(f"language modeling needs logits (batch, tokens, vocab); got {got}")
        if outputs.shape[:2] != targets.shape:
            raise ValueError(
                f"the model returns logits for {tuple(outputs.shape[:2])} (batch, tokens) "
                f"positions but the targets are {tuple(targets.shape)}"
            )
        vocab = shape.get("vocab_size")
        if vocab is not None and outputs.shape[-1] < vocab:
            raise ValueError(
                f"the model's vocabulary ({outputs.shape[-1]}) is smaller than the tokenizer's "
                f"({vocab}); set model.kwargs.vocab_size={vocab} (or leave it unset: it "
                "defaults to the tokenizer's)"
            )


class TargetBytes(SumMetric):
    """UTF-8 bytes covered by the real target tokens, summed over every rank: what turns nats
    per token into bits per byte."""

    total: torch.Tensor
    token_bytes: torch.Tensor

    def __init__(self, token_bytes: list[int], ignore_index: int) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.token_bytes = torch.tensor(token_bytes, dtype=torch.long)  # moved by ``to``
        self.add_state("total", (), torch.long)

    def update(self, logits: torch.Tensor | None, targets: torch.Tensor) -> None:
        # A mask, not ``targets[mask]``: boolean indexing waits for the device (its size).
        real = targets != self.ignore_index
        self.total += (self.token_bytes[torch.where(real, targets, 0)] * real).sum()

    def compute(self) -> torch.Tensor:
        return self.total
