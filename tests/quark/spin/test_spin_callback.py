"""QuantCallback(mode="ptq") with a trainable rotation: at the end of fit the callback's calibration trains the
rotations (the loss is logged before and after), folds them, and the test loop runs the quantized model."""

import logging

import pytest
import torch
import torch.nn.functional as F
from lightning import LightningModule, Trainer
from spin_models import char_model, w4a4
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, TensorDataset

from callbacks.quant import QuantCallback
from quark.torch.algorithm.rotation import ROTATION_BUFFER
from quark.torch.quantization.config.config import RotationConfig

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]


class LitChar(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = char_model().train()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, _):
        return self._loss(batch)

    def test_step(self, batch, _):
        self.log("test_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (16, 25), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)


def test_callback_trains_folds_and_tests(caplog, tmp_path):
    config = w4a4(RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=3, train_lr=1.5))
    callback = QuantCallback(
        config, mode="ptq", calib_batches=2, log_sqnr=False, progress_bar=False, save_quantized=False
    )
    module = LitChar()
    trainer = Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    with caplog.at_level(logging.INFO, logger="quark.torch.algorithm.rotation.training"):
        trainer.fit(module, _loader())
    assert any("rotation training" in r.getMessage() for r in caplog.records)
    assert not any(parametrize.is_parametrized(m) for m in module.modules())
    assert hasattr(module.net.model.layers[0].mlp.down_proj, ROTATION_BUFFER)
    (result,) = trainer.test(module, _loader(), verbose=False)
    assert torch.isfinite(torch.tensor(result["test_loss"]))
