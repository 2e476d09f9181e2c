"""GPTQ through QuantCallback: it runs when PTQ calibration does (after fit), its qparams survive, the checkpoint
holds them, and the monitored metric is logged before and after."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cb_helpers import BoringMLP, DataModule, make_trainer, seed
from lightning.pytorch.loggers import CSVLogger

from callbacks.quant import QuantCallback, load_quantized_checkpoint
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

WEIGHT = {
    "dtype": "int3",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "observer_cls": "PerChannelMinMaxObserver",
    "symmetric": True,
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}


def _config(algo: dict | None) -> Config:
    data = {"global_quant_config": {"weight": WEIGHT}}
    if algo:
        data["algo_config"] = algo
    return Config.from_dict(data)


def _fit(tmp_path: Path, algo: dict | None) -> tuple[BoringMLP, QuantCallback, DataModule]:
    """Train float for 2 epochs; at the end of fit the callback calibrates (and runs the algorithm), then validate."""
    seed()
    model, dm = BoringMLP(), DataModule(n=64)
    callback = QuantCallback(_config(algo), mode="ptq", calib_batches=4, monitor="val_loss", progress_bar=False)
    trainer = make_trainer(tmp_path, [callback], max_epochs=2, logger=CSVLogger(str(tmp_path)))
    trainer.fit(model, datamodule=dm)
    trainer.validate(model, datamodule=dm, verbose=False)  # the quantized model's metric, next to the float one
    return model, callback, dm


def _output_error(model: BoringMLP, reference: BoringMLP, dm: DataModule) -> float:
    dm.setup("fit")
    x = torch.cat([b[0] for b in dm.train_dataloader()])
    with torch.no_grad():
        return float(((model(x) - reference(x)) ** 2).mean())


def test_gptq_runs_after_fit_and_keeps_its_qparams(tmp_path: Path) -> None:
    model, callback, dm = _fit(tmp_path / "gptq", {"name": "gptq", "desc_act": False})
    rtn, _, _ = _fit(tmp_path / "rtn", None)
    for layer in (model.fc1, model.fc2):
        q = layer._weight_quantizer
        assert isinstance(q, ScaledFakeQuantize) and not bool(q.observer_enabled)
        assert torch.equal(q(layer.weight), layer.weight)  # GPTQ's weights sit on the quantizer's own grid
    assert not torch.equal(model.fc1.weight, rtn.fc1._weight_quantizer(rtn.fc1.weight))  # not plain rounding
    # same float training (seeded): GPTQ's quantized model is closer to its float self than RTN's
    seed()
    float_model = BoringMLP()
    make_trainer(tmp_path / "float", [], max_epochs=2).fit(float_model, datamodule=DataModule(n=64))
    assert _output_error(model, float_model, dm) < _output_error(rtn, float_model, dm)
    # the checkpoint holds the GPTQ weights and qparams
    restored = load_quantized_checkpoint(BoringMLP(), callback.quantized_checkpoint)
    x = torch.randn(5, model.fc1.in_features)
    with torch.no_grad():
        assert torch.equal(restored(x), model.eval()(x))
    logged = (Path(tmp_path / "gptq") / "lightning_logs").rglob("metrics.csv")
    text = "".join(p.read_text() for p in logged)
    assert "quant/val_loss_fp32" in text and "quant/val_loss_quantized" in text


def test_algorithms_need_ptq_mode() -> None:
    with pytest.raises(ValueError, match=r"\['gptq'\] run on calibration data after training: use mode='ptq'"):
        QuantCallback(_config({"name": "gptq"}), mode="qat")


def test_callback_exports_at_the_end_of_fit(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("onnx")
    from quark.torch.export import import_model_from_safetensors
    from quark_lightning.tasks.recipes import recipe

    seed()
    model, dm = BoringMLP(), DataModule(n=64)
    callback = QuantCallback(
        recipe("w8a8_int8"),
        mode="ptq",
        calib_batches=2,
        progress_bar=False,
        export=["safetensors", "onnx"],
        export_dir=str(tmp_path / "out"),
    )
    make_trainer(tmp_path, [callback]).fit(model, datamodule=dm)
    assert set(callback.exported) == {"safetensors", "onnx"}
    for info in callback.exported.values():
        assert Path(info["path"]).exists() and info["file_bytes"] == Path(info["path"]).stat().st_size
    restored = import_model_from_safetensors(BoringMLP(), str(tmp_path / "out"))
    x = torch.randn(4, model.fc1.in_features)
    with torch.no_grad():
        assert torch.equal(restored(x), model.eval()(x))


def test_unknown_export_format_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"`export=\['tflite'\]` is not known; allowed: \['safetensors', 'onnx', 'quark'\]"
    ):
        QuantCallback(_config(None), mode="ptq", export=["tflite"])


def test_brevitas_style_config_in_the_callback(tmp_path: Path) -> None:
    from quark.torch.extensions.brevitas import Config as BrevitasConfig
    from quark.torch.extensions.brevitas import QuantizationConfig, QuantizationSpec

    seed()
    model = BoringMLP()
    config = BrevitasConfig(
        global_quant_config=QuantizationConfig(
            weight=QuantizationSpec(qscheme="per_channel", bit_width=4), input_tensors=QuantizationSpec()
        )
    )
    callback = QuantCallback(config, mode="ptq", calib_batches=2, progress_bar=False, save_quantized=False)
    make_trainer(tmp_path, [callback]).fit(model, datamodule=DataModule(n=32))
    assert (
        model.fc1._weight_quantizer.spec.dtype.name == "int4" and model.fc1._input_quantizer.spec.dtype.name == "int8"
    )
    assert callback.calibrated
