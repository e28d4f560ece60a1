"""The language model's head and loss as one step: every path gives the task's loss sum and
the same gradients, without the batch's logits where it is fused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from convoy.models.gpt import GPT
from convoy.models.head_loss import (
    FUSED_FROM_BYTES,
    ChunkedLinearCrossEntropy,
    check_head_loss_device,
    head_loss_sum,
    liger_available,
    resolve_head_loss,
)
from convoy.tasks import LanguageModeling

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def test_chunked_cross_entropy_matches_the_full_logits_and_their_gradients() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=generator, requires_grad=True)
    w = torch.randn(500, 32, generator=generator, requires_grad=True)
    y = torch.randint(0, 500, (300,), generator=generator)
    y[::7] = -100  # padding: no loss, no gradient
    full = F.cross_entropy(F.linear(x, w), y, ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(full * 1.7, (x, w))
    chunked = ChunkedLinearCrossEntropy.apply(x, w, y, -100, 64)  # 5 chunks, the last short
    got = torch.autograd.grad(chunked * 1.7, (x, w))
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got[0][::7].abs().max() == 0  # an ignored row's input gets no gradient


def _model(head_loss: str) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=300, context_length=32, depth=2, heads=2, hidden=32, head_loss=head_loss)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 300, (4, 32), generator=generator)
    targets = torch.randint(0, 300, (4, 32), generator=generator)
    targets[0, 5:] = -100
    return inputs, targets


def test_the_model_computes_the_tasks_loss_bitwise_through_the_logits() -> None:
    task, (inputs, targets) = LanguageModeling(), _batch()
    model = _model("logits")
    outputs, loss = task.forward_loss(model, inputs, targets)
    assert outputs is None  # no logits leave the model in training
    assert torch.equal(loss, task.loss_sum(model(inputs), targets))


def test_the_chunked_path_trains_as_the_logits_path() -> None:
    task, (inputs, targets) = LanguageModeling(), _batch()
    grads = []
    for path in ("logits", "chunked"):
        model = _model(path)
        _, loss = task.forward_loss(model, inputs, targets)
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_auto_takes_the_full_logits_for_a_small_batch_and_fuses_a_large_one() -> None:
    weight = torch.zeros(1, 1)
    small_rows = 16 * 1024
    assert resolve_head_loss("auto", small_rows, 50304, CPU, weight) == "logits"
    large_rows = FUSED_FROM_BYTES // (50304 * 4) + 1
    assert resolve_head_loss("auto", large_rows, 50304, CPU, weight) == "chunked"
    assert resolve_head_loss("liger", small_rows, 50304, CPU, weight) == "liger"


def test_an_unknown_or_missing_head_loss_is_one_line_before_any_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from convoy.config import load_job
    from convoy.errors import ConfigError
    from convoy.preflight import preflight

    base = ["strategy.name=single", "scaling.num_workers=1", "scaling.launcher=local"]
    cases = [
        ("fast", [], "model.kwargs:", "head_loss: got 'fast'; allowed: auto, logits"),
        # On the CPU the device is said first: installing the extra would not help there.
        ("liger", [], "model.kwargs.head_loss: got 'liger';", "run on CUDA only"),
    ]
    if not liger_available():  # a GPU job without the extra: the exact install command
        install = "pip install 'convoy[fused]' (in a checkout: .venv/bin/pip install -c"
        cases.append(("liger", ["scaling.use_gpu=true"], "model.kwargs:", install))
    for value, more, starts, says in cases:
        job = load_job(
            REPO / "recipes/lm_tiny.yaml",
            [*base, *more, f"model.kwargs.head_loss={value}", "data.tokenizer=bytes"],
        )
        with pytest.raises(ConfigError) as info:
            preflight(job)
        message = str(info.value)
        assert message.startswith(starts) and says in message and "\n" not in message


def test_liger_is_refused_on_the_cpu_and_allowed_on_a_gpu() -> None:
    with pytest.raises(ValueError, match="CUDA only; on the CPU use auto, logits or chunked"):
        check_head_loss_device("liger", on_gpu=False)
    check_head_loss_device("liger", on_gpu=True)
    for other in ("auto", "logits", "chunked"):
        check_head_loss_device(other, on_gpu=False)


def test_the_liger_path_on_cpu_tensors_is_one_clear_error() -> None:
    """A job that reached a worker without the driver's check (its own script): the same
    sentence, not a Triton error from inside Liger."""
    hidden, weight = torch.randn(4, 8), torch.randn(16, 8)
    targets = torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="head_loss=liger: Liger Kernel's Triton kernels"):
        head_loss_sum(hidden, weight, targets, -100, "liger")
