"""The app's SQNR report (``quark_lightning.app.run._report``) leaves a BatchNorm frozen in eval as it found it."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark_lightning.app.run import _report


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def test_report_keeps_a_frozen_batchnorm_in_eval() -> None:
    torch.manual_seed(0)
    spec = QuantizationSpec.from_dict(
        {
            "dtype": "int8",
            "qscheme": "per_tensor",
            "symmetric": True,
            "is_dynamic": False,
            "observer_cls": "PerTensorMinMaxObserver",
            "round_method": "half_even",
            "scale_type": "float",
        }
    )
    config = Config(global_quant_config=QuantizationConfig(weight=spec, input_tensors=spec))
    model = ModelQuantizer(config).quantize_model(_Net(), [torch.randn(16, 4)])
    model.train()
    model.bn.eval()  # as QuantCallback's freeze_bn_epoch leaves it
    batch = torch.randn(8, 4)
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(convert_input=lambda b: b))
    datamodule = SimpleNamespace(test_dataloader=lambda: [batch])
    report = _report(model, datamodule, trainer)  # type: ignore[arg-type]
    assert set(report["sqnr_db"]["activation"]) == {"fc", "head"}
    assert model.training and model.fc.training and not model.bn.training
