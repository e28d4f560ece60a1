"""A LightningModule written as Lightning's documentation writes them, trained by Convoy.

Nothing here knows about Convoy: ``recipes/lightning_digits.yaml`` points Convoy at
``DigitsClassifier`` and ``DigitsDataModule``, and Convoy picks the launcher, the strategy
(ddp, fsdp2, ...), the epochs, the precision and where checkpoints and metrics go.

    convoy train recipes/lightning_digits.yaml -o strategy.name=fsdp2
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 8x8 digits (1,797 images, 10 classes) as flat 64-pixel tensors."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, seed: int = 0):
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed

    def setup(self, stage: str) -> None:
        images, labels = load_digits(return_X_y=True)
        dataset = TensorDataset(
            torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels)
        )
        val = int(len(dataset) * self.val_fraction)
        generator = torch.Generator().manual_seed(self.seed)
        self.train_set, self.val_set, self.test_set = random_split(
            dataset, [len(dataset) - 2 * val, val, val], generator=generator
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)


class DigitsClassifier(L.LightningModule):
    """A two-layer MLP on 64 pixels."""

    def __init__(self, hidden: int = 64, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self._evaluate(batch, "test")

    def _evaluate(self, batch, stage: str) -> None:  # type: ignore[no-untyped-def]
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", acc, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
