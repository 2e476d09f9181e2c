"""What QuantCallback logs: per-layer SQNR of weights and activations, model size, FP32 vs quantized monitor."""

from __future__ import annotations

import csv
import glob
import math
import os

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, QuantCallback, make_trainer, seed
from lightning.pytorch.loggers import CSVLogger

from quark.torch.quantization.nn.modules import QuantMixin
from quark_lightning.tasks.recipes import recipe


def _rows(tmp_path) -> list[dict[str, str]]:
    files = glob.glob(os.path.join(str(tmp_path), "logs", "**", "metrics.csv"), recursive=True)
    assert len(files) == 1, files
    with open(files[0]) as f:
        return list(csv.DictReader(f))


def _last(rows: list[dict[str, str]], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    assert values, f"{key} was never logged; columns: {sorted(rows[0]) if rows else []}"
    return values[-1]


def _sqnr(signal: torch.Tensor, quantized: torch.Tensor) -> float:
    x = signal.double()
    return 10 * math.log10(float((x**2).sum()) / float(((x - quantized.double()) ** 2).sum()))


def _check_report(model: BoringMLP, rows: list[dict[str, str]], x: torch.Tensor) -> None:
    """SQNR of each layer's weight and input (on batch ``x``) as recomputed here, and the model size."""
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            layer = getattr(model, name)
            expected = _sqnr(layer.weight, layer._weight_quantizer(layer.weight))
            assert _last(rows, f"quant/sqnr_weight/{name}") == pytest.approx(expected, rel=1e-9)
            assert 30 < expected < 60  # int8: about 6 dB per bit
        h = torch.relu(model.fc1(x))
        for name, inp in (("fc1", x), ("fc2", h)):
            q = getattr(model, name)._input_quantizer
            assert _last(rows, f"quant/sqnr_act/{name}") == pytest.approx(_sqnr(inp, q(inp)), rel=1e-9)
    # int8 weights: the quantized layers' weights take a quarter of their float bits; biases stay float32
    quantized, fp32 = _last(rows, "quant/model_size_bits"), _last(rows, "quant/fp32_size_bits")
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantMixin))
    others = sum(p.numel() for p in model.parameters()) - weights
    assert fp32 == 32 * (weights + others)
    assert quantized == 8 * weights + 32 * others
    assert (quantized - 32 * others) / (fp32 - 32 * others) == 0.25


def test_ptq_logs_sqnr_and_model_size(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], logger=CSVLogger(str(tmp_path), name="logs"))
    trainer.fit(model, datamodule=dm)
    _check_report(model, _rows(tmp_path), dm.train.tensors[0][:8])  # activations: the first calibration batch


def test_qat_logs_sqnr_and_model_size(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(recipe("w8a8_int8"), mode="qat", observer_steps=2)
    trainer = make_trainer(tmp_path, [cb], logger=CSVLogger(str(tmp_path), name="logs"))
    trainer.fit(model, datamodule=dm)
    rows = _rows(tmp_path)
    # logged when the observers were fixed (step 2) and at the end of fit (the final weights, checked here)
    steps = sorted({int(r["step"]) for r in rows if r.get("quant/sqnr_weight/fc1")})
    assert steps == [2, 4]
    _check_report(model, rows, dm.train.tensors[0][:8])


def test_log_sqnr_false_logs_no_report(tmp_path) -> None:
    seed(0)
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=2, log_sqnr=False)
    make_trainer(tmp_path, [cb], logger=CSVLogger(str(tmp_path), name="logs")).fit(BoringMLP(), datamodule=DataModule())
    assert not any(k.startswith("quant/") for k in _rows(tmp_path)[0])


def test_ptq_monitor_logs_fp32_and_quantized_values(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(recipe("w8a8_int8"), mode="ptq", calib_batches=2, monitor="val_loss")
    trainer = make_trainer(tmp_path, [cb], max_epochs=2, logger=CSVLogger(str(tmp_path), name="logs"))
    trainer.fit(model, datamodule=dm)
    float_val_loss = _last(_rows(tmp_path), "val_loss")  # the last validation of fit: the float model
    assert cb.fp32_metric == float_val_loss

    quantized_val_loss = trainer.validate(model, datamodule=dm, verbose=False)[0]["val_loss"]
    rows = _rows(tmp_path)
    assert _last(rows, "quant/val_loss_fp32") == float_val_loss
    assert _last(rows, "quant/val_loss_quantized") == pytest.approx(quantized_val_loss, rel=1e-7)
    assert quantized_val_loss != float_val_loss

    # a test run afterwards reports no stale pair: its metrics hold no val_loss of the quantized model
    n = len([r for r in rows if r.get("quant/val_loss_quantized")])
    trainer.test(model, datamodule=dm, verbose=False)
    rows = _rows(tmp_path)
    assert len([r for r in rows if r.get("quant/val_loss_quantized")]) == n
