"""QuantCallback(mode="ptq", mixed_precision=...): formats chosen per layer from the sensitivity at the end of fit."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from cb_helpers import DataModule, make_trainer
from lightning.pytorch import LightningModule
from torch import nn

from callbacks import MixedPrecision, QuantCallback, load_quantized_checkpoint
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.sensitivity import weight_bits


def wspec(bits: int) -> dict[str, Any]:
    return {
        "dtype": f"int{bits}",
        "qscheme": "per_channel",
        "ch_axis": 0,
        "observer_cls": "PerChannelMinMaxObserver",
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
    }


CANDIDATES = {"w8": {"weight": wspec(8)}, "w2": {"weight": wspec(2)}}


class Loud(LightningModule):
    """Two parallel linears of the same size; ``loud`` sees inputs 40x larger, so its weight error costs more."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.loud, self.quiet = nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loud(40 * x) + self.quiet(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_mixed_precision_at_the_end_of_fit(tmp_path: Path) -> None:
    target = (
        weight_bits(Config.from_dict({"global_quant_config": {"weight": wspec(8)}}).global_quant_config.weight, (4, 16))
        + weight_bits(
            Config.from_dict({"global_quant_config": {"weight": wspec(2)}}).global_quant_config.weight, (4, 16)
        )
    ) / 2
    callback = QuantCallback(
        {"global_quant_config": {}},
        mode="ptq",
        calib_batches=4,
        mixed_precision={"candidates": CANDIDATES, "target_bits": target, "method": "mse", "batches": 4},
    )
    model = Loud()
    trainer = make_trainer(tmp_path, [callback])
    trainer.fit(model, datamodule=DataModule())
    assert callback.mixed_choice == {"loud": "w8", "quiet": "w2"}
    assert (
        model.loud._weight_quantizer.spec.dtype.name == "int8"
        and model.quiet._weight_quantizer.spec.dtype.name == "int2"
    )
    assert callback.config.layer_quant_config["quiet"].weight.dtype.name == "int2"
    rows = list(csv.DictReader((tmp_path / "sensitivity.csv").open()))
    assert {(r["layer"], r["candidate"]) for r in rows if r["chosen"] == "1"} == {("loud", "w8"), ("quiet", "w2")}
    loss = {(r["layer"], r["candidate"]): float(r["loss"]) for r in rows}
    assert loss[("loud", "w2")] > loss[("quiet", "w2")] > loss[("quiet", "w8")]
    saved = Config.from_dict(__import__("yaml").safe_load((tmp_path / "mixed_precision.yaml").read_text()))
    assert saved.layer_quant_config["loud"].weight.dtype.name == "int8"
    # quantized.ckpt stores the mixed Config: a fresh module loads it with the same outputs
    x = torch.randn(5, 16)
    reloaded = load_quantized_checkpoint(Loud(), callback.quantized_checkpoint)  # type: ignore[arg-type]
    model.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x), model(x))


def test_mixed_precision_needs_ptq_and_a_valid_budget() -> None:
    with pytest.raises(ValueError, match="mode='ptq'"):
        QuantCallback(
            {"global_quant_config": {}}, mode="qat", mixed_precision={"candidates": CANDIDATES, "target_bits": 4}
        )
    with pytest.raises(ValueError, match=r"target_bits=-1"):
        MixedPrecision(candidates=CANDIDATES, target_bits=-1)
    with pytest.raises(ValueError, match=r"method='l1'"):
        MixedPrecision(candidates=CANDIDATES, target_bits=4, method="l1")
    with pytest.raises(ValueError, match="non-empty dict"):
        MixedPrecision(candidates={}, target_bits=4)
