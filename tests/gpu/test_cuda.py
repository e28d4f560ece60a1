"""GPU tier: runs where CUDA is present (the lent GPU machine), skipped elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import convoy
from convoy.config import load_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "default.yaml"


@pytest.mark.parametrize("strategy", ["single", "fsdp2"])
def test_bf16_training_on_cuda(strategy: str, tmp_path: Path) -> None:
    # The default recipe's ViT and optimizer (batch 32, warm-up, weight decay 0.3). The bare
    # defaults (vit_tiny, batch 64, no warm-up) reach only ~0.57 test accuracy on digits in
    # 10 epochs, in fp32 on the CPU as well: that bar said nothing about bf16 on CUDA.
    job = load_job(
        DEFAULT_RECIPE,
        [
            f"strategy.name={strategy}",
            "precision=bf16",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            "scaling.use_gpu=true",
            "run.epochs=30",
            "run.progress=off",
            "checkpoint.every_epochs=null",
            f"run.storage_dir={tmp_path}",
        ],
    )
    result = convoy.train(job)
    assert result.summary["metrics"]["test/acc"] > 0.85


def test_fp16_uses_a_grad_scaler_on_cuda(tmp_path: Path) -> None:
    job = load_job(
        None,
        [
            "model.name=mlp",
            "strategy.name=single",
            "precision=fp16",
            "scaling.launcher=local",
            "scaling.num_workers=1",
            "scaling.use_gpu=true",
            "run.epochs=5",
            "run.progress=off",
            f"run.storage_dir={tmp_path}",
        ],
    )
    assert convoy.train(job).summary["metrics"]["test/acc"] > 0.9
