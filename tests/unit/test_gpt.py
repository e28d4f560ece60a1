"""The GPT causal language model: shapes, causality, tied head, context limit, size, sharding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from convoy.errors import ConfigError
from convoy.models import build_model, count_parameters
from convoy.models.gpt import GPT
from convoy.models.registry import check_model
from convoy.strategies.base import transformer_blocks


def small_gpt(depth: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=50, context_length=16, depth=depth, heads=2, hidden=32)


@torch.no_grad()
def test_forward_gives_float_logits_per_position() -> None:
    model = small_gpt()
    logits = model(torch.randint(0, 50, (3, 10)))
    assert logits.shape == (3, 10, 50)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_changing_a_token_leaves_earlier_logits_unchanged() -> None:
    model = small_gpt().eval()
    tokens = torch.randint(0, 50, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (tokens[0, 7] + 1) % 50
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :7], after[:, :7])
    assert not torch.allclose(before[:, 7:], after[:, 7:])  # the change is seen from t on


def test_head_and_token_embedding_are_one_parameter() -> None:
    model = small_gpt()
    assert model.head.weight is model.token_embed.weight
    assert sum(p is model.token_embed.weight for p in model.parameters()) == 1
    assert count_parameters(model) == sum(p.numel() for p in set(model.parameters()))


def test_input_longer_than_the_context_is_a_clear_error() -> None:
    model = GPT(context_length=256)
    with pytest.raises(
        ValueError, match="sequence length 300 is longer than the model's context_length 256"
    ):
        model(torch.zeros(1, 300, dtype=torch.long))


def test_init_is_gpt2s() -> None:
    depth = 6
    model = GPT(vocab_size=512, context_length=64, depth=depth, heads=4, hidden=256)
    block = model.blocks[0]
    assert model.token_embed.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.q.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.v.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = 0.02 / math.sqrt(2 * depth)
    assert block.attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.mlp[-1].weight.std().item() == pytest.approx(residual_std, rel=0.05)
    biases = [
        p for name, p in model.named_parameters() if name.endswith("bias") and "norm" not in name
    ]
    assert biases and all((b == 0).all() for b in biases)


def test_gpt_1b_has_about_a_billion_parameters() -> None:
    with torch.device("meta"):  # no memory, no init cost
        model = build_model("gpt_1b", {"vocab_size": 50304}, {})
    assert 0.9e9 <= count_parameters(model) <= 1.4e9


def test_fsdp_shards_per_block() -> None:
    model = small_gpt(depth=3)
    assert transformer_blocks(model) == list(model.blocks)
    assert len(transformer_blocks(model)) == 3


def test_dataset_vocab_is_used_and_its_seq_len_is_not() -> None:
    with torch.device("meta"):
        model = build_model("gpt_tiny", {}, {"vocab_size": 300, "seq_len": 512})
    assert model.head.out_features == 300
    assert model.context_length == 256  # the model's choice, not the data's
    with pytest.raises(ConfigError, match=r"model\.kwargs\.seq_len"):
        check_model("gpt", {"seq_len": 128})


def test_learns_a_repeating_sequence() -> None:
    model = small_gpt()
    tokens = torch.arange(16).repeat(4, 1) % 5  # 0 1 2 3 4 0 1 ...: next token is predictable
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > math.log(50) * 0.9  # starts near uniform
    assert losses[-1] < 0.5
