"""Activation checkpointing and ``torch.compile`` per block (``convoy.strategies.blocks``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from convoy.config import load_job
from convoy.distributed import WorkerContext
from convoy.engine.loop import train
from convoy.models.gpt import GPT
from convoy.outputs import read_metrics
from convoy.strategies.blocks import prepare_blocks
from task_data_helpers import GPT_TINY_OVERRIDES

GPT_KWARGS = {"vocab_size": 50, "context_length": 32, "depth": 4, "heads": 2, "hidden": 32}


def ac(mode: str, every: int = 2) -> SimpleNamespace:
    return SimpleNamespace(activation_checkpointing=mode, checkpoint_every=every)


def gradients_and_saved_bytes(mode: str) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """One forward/backward of a seeded GPT with dropout (checkpointing must replay its
    random masks): every gradient, the bytes autograd kept for backward, the state keys."""
    torch.manual_seed(0)
    model = prepare_blocks(GPT(**GPT_KWARGS, dropout=0.2), ac(mode), compile_mode=False)
    tokens = torch.randint(0, 50, (4, 32))
    saved = [0]

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(1)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, saved[0], list(model.state_dict())


def test_checkpointing_keeps_less_for_backward_and_gives_the_same_gradients() -> None:
    plain, plain_bytes, plain_keys = gradients_and_saved_bytes("none")
    every_other, every_other_bytes, keys_every = gradients_and_saved_bytes("every_n")
    full, full_bytes, keys_full = gradients_and_saved_bytes("full")
    for grads in (every_other, full):
        assert grads.keys() == plain.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain[name], rtol=0, atol=0)
    # Blocks keep their inputs only: half the blocks, then all of them, keep less.
    assert full_bytes < every_other_bytes < plain_bytes
    # The module tree is unchanged: a checkpoint saved with it loads without it.
    assert plain_keys == keys_every == keys_full


def test_every_n_checkpoints_blocks_0_n_2n() -> None:
    model = prepare_blocks(GPT(**GPT_KWARGS), ac("every_n", every=3), compile_mode=False)
    replaced = [index for index, block in enumerate(model.blocks) if "forward" in vars(block)]
    assert replaced == [0, 3]


def test_blockless_models_compile_whole() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    prepare_blocks(model, ac("none"), compile_mode=True)
    assert "forward" in vars(model)


def compiled_job(tmp_path: Path, compile_blocks: bool | str) -> object:
    return load_job(
        None,
        [
            *GPT_TINY_OVERRIDES,
            "task.name=language_modeling",
            "data.name=task_data_helpers:ragged_lm",
            "data.batch_size=16",
            "strategy.name=single",
            "scaling.num_workers=1",
            "scaling.launcher=local",
            "run.max_steps=4",
            "run.log_every_steps=1",
            "run.progress=off",
            f"run.compile={str(compile_blocks).lower()}",
            f"run.storage_dir={tmp_path}",
            f"run.name=compile-{compile_blocks}",
        ],
    )


def test_compiled_blocks_train_as_eager_ones_and_report_the_compile_time(tmp_path: Path) -> None:
    """Inductor's code for each block (forward and backward) gives eager's losses, and the
    run reports the time spent compiling apart from its steps."""
    losses, summaries = {}, {}
    for compile_blocks in (False, True, "model"):
        job = compiled_job(tmp_path, compile_blocks)
        summaries[compile_blocks] = train(job, WorkerContext())  # type: ignore[arg-type]
        records = read_metrics(job.run_dir)  # type: ignore[attr-defined]
        losses[compile_blocks] = [r["train/loss"] for r in records if r["kind"] == "step"]
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    # The whole model, its fused-or-not loss included, in one graph: the same losses.
    assert losses["model"] == pytest.approx(losses[False], rel=1e-5)
    eager = summaries[False]  # the steady rate is the median step's, named apart
    assert eager["steady_samples_per_second"] == pytest.approx(16 / eager["step_seconds_median"])
    assert eager["steady_tokens_per_second"] > 0 and eager["tokens_per_second"] > 0
    assert summaries[False]["compile_seconds"] is None
    assert summaries[True]["compile_seconds"] > 0 and summaries["model"]["compile_seconds"] > 0
