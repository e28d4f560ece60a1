"""A language model's output head and cross-entropy as one step, without the full logits.

At a vocabulary of 50 k, the logits of a batch are the largest tensor of a step: 64 x 1,024
tokens in fp32 are 13 GB, written by the head, read by the loss, and kept for backward. Fusing
the head's matmul with the loss computes them a chunk of rows at a time and keeps only the
gradients (Liger Kernel's ``fused_linear_cross_entropy`` does it in Triton; ``chunked`` here
does it in plain torch, on any device). Which is faster depends on the batch: on one H100,
GPT-2 small at batch 16 ran faster with the full logits (48.8 against 60.1 ms a step), at batch
64 faster fused (145.7 against 174.4 ms, and 23.7 instead of 66.8 GiB), so ``auto`` takes the
full logits below ``FUSED_FROM_BYTES`` of fp32 logits and a fused path above.

Every path returns the loss *sum* over the real targets (``ignore_index`` left out), as the
``language_modeling`` task's loss does, so a path changes rounding, not the math.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from convoy.imports import installed, missing_extra

HeadLoss = Literal["auto", "logits", "chunked", "liger"]
HEAD_LOSSES: tuple[str, ...] = ("auto", "logits", "chunked", "liger")

FUSED_FROM_BYTES = 6 * 2**30
"""``auto`` fuses the head and the loss when the fp32 logits would take at least this much
(between the two measured points above: 3.3 GB full was faster, 13 GB fused was)."""

LIGER_NEEDS_CUDA = (
    "Liger Kernel's Triton kernels run on CUDA only; on the CPU use auto, logits or chunked"
)

CHUNK_ROWS = 8192
"""Rows (tokens) per chunk of the ``chunked`` path: its logits are CHUNK_ROWS x vocab in fp32."""


def liger_available() -> bool:
    """Whether Liger Kernel (the ``fused`` extra; it needs Triton and CUDA) is installed."""
    return installed("liger_kernel")


def check_head_loss(choice: str) -> None:
    """A ``ValueError`` (one line) for a ``head_loss`` that is unknown or not installed."""
    if choice not in HEAD_LOSSES:
        raise ValueError(f"head_loss: got {choice!r}; allowed: {', '.join(HEAD_LOSSES)}")
    if choice == "liger" and not liger_available():
        raise ValueError(missing_extra("head_loss: liger", "liger-kernel", "fused"))


def check_head_loss_device(choice: str, on_gpu: bool) -> None:
    """A ``ValueError`` (one line) for a path that cannot run where the job trains: ``liger``
    on the CPU. Said before the model is built, since installing the missing extra would not
    help there."""
    if choice == "liger" and not on_gpu:
        raise ValueError(LIGER_NEEDS_CUDA)


def resolve_head_loss(
    choice: str, rows: int, vocab: int, device: torch.device, weight: torch.Tensor
) -> str:
    """The path ``choice`` means for ``rows`` tokens of ``vocab`` logits on ``device``."""
    if choice != "auto":
        return choice
    if _is_sharded(weight) or rows * vocab * 4 < FUSED_FROM_BYTES:
        return "logits"
    return "liger" if device.type == "cuda" and liger_available() else "chunked"


def head_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    path: str,
) -> torch.Tensor:
    """The cross-entropy sum of ``hidden @ weight.T`` against ``targets`` over the real
    targets, by ``path`` (``logits``, ``chunked`` or ``liger``)."""
    flat, labels = hidden.flatten(0, -2), targets.flatten()
    if path == "logits":
        logits = F.linear(flat, weight).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if _is_sharded(weight):
        raise ValueError(
            f"model.kwargs.head_loss={path} needs the head's whole weight; a tensor-parallel "
            "head is sharded: use head_loss=logits (or auto)"
        )
    dtype = torch.get_autocast_dtype(flat.device.type) if _autocast_on(flat) else flat.dtype
    flat, weight_cast = flat.to(dtype), weight.to(dtype)
    if path == "liger":
        return _liger(flat, weight_cast, labels, ignore_index)
    if path == "chunked":
        with torch.autocast(flat.device.type, enabled=False):
            loss: torch.Tensor = ChunkedLinearCrossEntropy.apply(
                flat, weight_cast, labels, ignore_index, CHUNK_ROWS
            )
        return loss
    raise ValueError(f"model.kwargs.head_loss: got {path!r}; allowed: {', '.join(HEAD_LOSSES)}")


def _autocast_on(tensor: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(tensor.device.type)


def _is_sharded(weight: torch.Tensor) -> bool:
    # DTensor's modules take 1-2 s to import: only tensor parallelism pays them.
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def _liger(
    flat: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    if flat.device.type != "cuda":  # a job that bypassed the driver's check
        raise ValueError(f"model.kwargs.head_loss=liger: {LIGER_NEEDS_CUDA}")
    # Liger is an optional extra (``pip install convoy[fused]``): Triton kernels, CUDA only.
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    with torch.autocast(flat.device.type, enabled=False):
        loss = liger_fused_linear_cross_entropy(
            flat, weight, labels, ignore_index=ignore_index, reduction="sum"
        )
    if isinstance(loss, tuple):  # releases that return the z-loss beside it
        loss = loss[0]
    return loss.float()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(x @ w.T, y, reduction="sum")`` a chunk of rows at a time.

    Forward computes each chunk's logits in fp32, its loss, and at once its gradients (the
    softmax less the one-hot), which it multiplies into the gradients of ``x`` and ``w``; the
    logits of a chunk are freed before the next. Backward only scales the stored gradients.
    Peak extra memory: one chunk's logits and the two gradients, never the batch's logits.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
    ) -> torch.Tensor:
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x) if needs_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, len(x), chunk_rows):
            rows = x[start : start + chunk_rows]
            targets = labels[start : start + chunk_rows]
            logits = (rows @ weight.T).float()
            real = targets != ignore_index
            safe = torch.where(real, targets, 0)
            log_z = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += torch.where(real, log_z - picked, 0.0).sum()
            if grad_x is None and grad_w is None:
                continue
            # d loss / d logits = softmax - one_hot, zero on ignored rows.
            grad = torch.exp(logits - log_z[:, None])
            grad[torch.arange(len(safe), device=x.device), safe] -= 1.0
            grad *= real[:, None]
            if grad_x is not None:
                grad_x[start : start + chunk_rows] = (grad.to(weight.dtype) @ weight).to(x.dtype)
            if grad_w is not None:
                grad_w += grad.T.to(rows.dtype).matmul(rows).float()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        grad_x, grad_w = ctx.saved_tensors
        scale = grad_out.float()
        dx = None if grad_x is None else grad_x * scale.to(grad_x.dtype)
        dw = None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype)
        return dx, dw, None, None, None
