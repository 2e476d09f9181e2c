"""callbacks.compat: each private Lightning API the callbacks rely on still behaves as relied on (a Lightning upgrade
that breaks one fails here first, under the wrapper's name), and a missing one gives an error naming the version."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import lightning
import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import compat


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)


class _Tiny(LightningModule):
    """One linear layer, no dataloaders of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def test_step(self, batch: Any, batch_idx: int) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Data(LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.loader = _loader()

    def train_dataloader(self) -> DataLoader:
        return self.loader


class _Record(Callback):
    """What the wrappers return while a stage runs."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.seen = {
            "stage": compat.stage_dataloaders(trainer, trainer.state.fn),
            "given": compat.fit_dataloaders_argument(trainer),
        }

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.seen = {"stage": compat.stage_dataloaders(trainer, trainer.state.fn)}


def _trainer(record: _Record) -> Trainer:
    return Trainer(
        max_epochs=1,
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )


def test_loaders_given_to_fit() -> None:
    """trainer.fit(model, train_dataloaders=loader): the fit stage reads that loader, and it is the fit argument."""
    loader, record = _loader(), _Record()
    _trainer(record).fit(_Tiny(), train_dataloaders=loader)
    assert record.seen["stage"] is loader and record.seen["given"] is loader


def test_datamodule_given_to_fit() -> None:
    """trainer.fit(model, datamodule=dm): the fit stage reads dm.train_dataloader(); no loader was given to fit."""
    data, record = _Data(), _Record()
    _trainer(record).fit(_Tiny(), datamodule=data)
    assert record.seen["stage"] is data.loader and record.seen["given"] is None


def test_loaders_given_to_test() -> None:
    """trainer.test(model, dataloaders=loader): the test stage reads that loader."""
    loader, record = _loader(), _Record()
    _trainer(record).test(_Tiny(), dataloaders=loader)
    assert record.seen["stage"] is loader


def test_no_trainer_loop_is_nothing_given() -> None:
    """A trainer-like object without the stage's loop (a stub): None, as before the wrapper."""
    assert compat.stage_dataloaders(SimpleNamespace(), "fit") is None
    assert compat.fit_dataloaders_argument(SimpleNamespace()) is None


def test_missing_data_source_names_lightning_version() -> None:
    """A loop without ``_data_source`` (a Lightning that renamed it): an error naming the version and the way out."""
    trainer = SimpleNamespace(fit_loop=SimpleNamespace())
    version = re.escape(lightning.__version__)
    with pytest.raises(
        compat.LightningCompatError, match=rf"_data_source, which lightning {version} .*calib_dataloader="
    ):
        compat.fit_dataloaders_argument(trainer)
