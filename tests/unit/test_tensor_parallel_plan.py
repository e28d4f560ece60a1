"""A model's tensor-parallel plan, read without a process group: which modules its paths name,
what is refused, and one rank's share of the model that the planner measures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from convoy.errors import ConfigError
from convoy.models.gpt import GPT
from convoy.plan.model import tensor_parallel_share
from convoy.strategies.tensor_parallel import model_plan, planned_modules


def small_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(vocab_size=64, context_length=32, depth=3, heads=4, hidden=32)


def test_a_star_matches_one_path_component() -> None:
    model = small_gpt()
    assert list(planned_modules(model, "blocks.*.attn.q")) == [
        "blocks.0.attn.q",
        "blocks.1.attn.q",
        "blocks.2.attn.q",
    ]
    assert list(planned_modules(model, "blocks.0")) == ["blocks.0"]
    assert planned_modules(model, "*.q") == {}  # not blocks.0.attn.q: one component per star


def test_a_plan_naming_no_module_is_refused() -> None:
    model = small_gpt()
    model.tensor_parallel_plan = lambda tp_size: {"blocks.*.attention.q": None}  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"names 'blocks\.\*\.attention\.q', which is no module"):
        model_plan(model, 2)


def test_one_ranks_share_has_its_heads_and_hidden_units() -> None:
    share = tensor_parallel_share(small_gpt(), 2)
    block = share.blocks[0]
    assert isinstance(block.attn.q, nn.Linear) and block.attn.q.out_features == 16
    assert block.attn.proj.in_features == 16 and block.attn.proj.out_features == 32
    assert block.mlp[0].out_features == 64 and block.mlp[2].in_features == 64
    assert share.token_embed.weight.shape == (64, 32)  # left whole
    # Sequence parallelism by sizes: the stream is cut to half the tokens in the blocks and
    # gathered whole before the final norm, so the logits cover every token.
    with torch.device("meta"):
        logits = share(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert logits.shape == (2, 8, 64)
