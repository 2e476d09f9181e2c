"""Lightning wrappers of the digits task: a DataModule over the embedded 8x8 digits and a classifier module."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

from quark_lightning.tasks.digits import DigitsCNN, load_digits_tensors


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 8x8 digits: the stratified train split (90% train / 10% validation) and the test split."""

    def __init__(self, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str | None = None) -> None:
        train, self.test_set = load_digits_tensors(seed=self.seed)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
        n_val = len(train) // 10
        self.val_set, self.train_set = Subset(train, order[:n_val]), Subset(train, order[n_val:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=torch.Generator().manual_seed(self.seed)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=256)


class DigitsClassifier(L.LightningModule):
    """DigitsCNN trained with Adam; logs loss and accuracy (percent) for train / val / test."""

    metrics = ("test_loss", "test_acc")

    def __init__(self, lr: float = 2e-3, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = DigitsCNN(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.log(f"{stage}_loss", loss, prog_bar=stage != "train")
        self.log(f"{stage}_acc", 100.0 * (logits.argmax(dim=1) == y).float().mean(), prog_bar=stage != "train")
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
