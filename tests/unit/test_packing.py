"""Packed samples attend only within themselves (``convoy.models.packing``), fp32.

Two samples packed in one row, positions restarting at each, give each sample the logits and
the loss it gets alone in a row; swapping the sample beside it changes nothing. For Convoy's
``gpt`` (a block-causal mask for ``scaled_dot_product_attention``) and ``hf`` models built
from a config (Llama: rotary positions; GPT-2: learned ones), whose attention ``transformers``
masks from the restarting ``position_ids``.
"""

from __future__ import annotations

import pytest
import torch

from convoy.models.packing import block_causal_mask, sample_ids
from convoy.models.registry import build_initial
from convoy.tasks.language_modeling import LanguageModeling
from hf_fixtures import GPT2_TINY, LLAMA_TINY

VOCAB = 256
MODELS = {
    "gpt": ("gpt_tiny", {"depth": 2}),
    "llama": ("hf", {"config": LLAMA_TINY}),
    "gpt2": ("hf", {"config": GPT2_TINY}),
}
ROW = 16


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def packed(*samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """One row of ``ROW`` tokens: the samples, then padding (a sample of its own)."""
    used = sum(len(s) for s in samples)
    ids = torch.cat([*samples, torch.zeros(ROW - used, dtype=torch.long)])
    positions = torch.cat([torch.arange(len(s)) for s in (*samples, ids[used:])])
    return {"input_ids": ids[None], "position_ids": positions[None]}


def alone(sample: torch.Tensor) -> torch.Tensor:
    return sample[None]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    if request.param != "gpt":
        pytest.importorskip("transformers")
    name, kwargs = MODELS[request.param]
    return build_initial(name, kwargs, {"vocab_size": VOCAB}, seed=0).eval()


def logits(model: torch.nn.Module, inputs: object) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs)


def test_each_sample_gets_its_own_logits_packed(model: torch.nn.Module) -> None:
    a, b = tokens(5, 1), tokens(7, 2)
    row = logits(model, packed(a, b))[0]
    torch.testing.assert_close(row[:5], logits(model, alone(a))[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(row[5:12], logits(model, alone(b))[0], atol=1e-5, rtol=1e-5)


def test_the_sample_beside_changes_nothing(model: torch.nn.Module) -> None:
    """Fails with any attention across the boundary: the first sample differs, the second's
    logits must not."""
    a, other, b = tokens(5, 1), tokens(5, 3), tokens(7, 2)
    first, second = logits(model, packed(a, b))[0], logits(model, packed(other, b))[0]
    assert not torch.allclose(first[:5], second[:5])
    torch.testing.assert_close(first[5:12], second[5:12], atol=1e-6, rtol=1e-6)


def test_per_sample_losses_are_the_same_packed_and_padded(model: torch.nn.Module) -> None:
    """The task's loss sum over each sample's targets (its last token predicts nothing: -100
    at the boundary), packed in one row vs one padded row each."""
    task = LanguageModeling()
    a, b = tokens(5, 1), tokens(7, 2)
    ignore = torch.full((ROW,), -100)
    row_targets = ignore.clone()
    row_targets[:4], row_targets[5:11] = a[1:], b[1:]
    with torch.no_grad():
        _, together = task.forward_loss(model, packed(a, b), row_targets[None])
        sums = []
        for sample in (a, b):
            targets = torch.full((len(sample),), -100)
            targets[:-1] = sample[1:]
            sums.append(task.forward_loss(model, alone(sample), targets[None])[1])
    torch.testing.assert_close(together, sum(sums), atol=1e-5, rtol=1e-5)


def test_samples_are_found_where_positions_restart() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert sample_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    mask = block_causal_mask(positions)
    assert mask is not None and mask.shape == (1, 1, 8, 8)
    assert mask[0, 0, 4].tolist() == [False, False, False, True, True, False, False, False]
    assert block_causal_mask(torch.arange(8)[None]) is None  # one sample: plain causal
