"""QuantCallback finds what it can before training (issue 18, items 5 and 6): activation channel axes against one
batch, an empty or non-finite ``calib_dataloader`` at ``on_fit_start``; calibrates in the module's own dtype under
``precision="64-true"`` / ``"bf16-true"``; warns once about layer names and layer types that configure nothing."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from cb_helpers import (
    BoringMLP,
    DataModule,
    QuantCallback,
    loader,
    make_data,
    make_trainer,
    minmax_config,
    quantizers,
    seed,
)
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT


class StepCounter(Callback):
    """Counts sanity-check starts and training batches: zero means the error came before any of them."""

    def __init__(self) -> None:
        self.steps = 0

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.steps += 1

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.steps += 1


def per_channel_act_config(ch_axis: int) -> Config:
    act = {
        **INT8_PER_TENSOR_ACT,
        "qscheme": "per_channel",
        "ch_axis": ch_axis,
        "observer_cls": "PerChannelMinMaxObserver",
    }
    return Config.from_dict({"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": act}})


# ----------------------------------------------------------------------------------------------- channel axes
@pytest.mark.parametrize("mode", ["ptq", "qat"])
def test_activation_ch_axis_out_of_range_is_found_before_training(mode: str, tmp_path: Any) -> None:
    seed()
    counter = StepCounter()
    trainer = make_trainer(tmp_path, [QuantCallback(per_channel_act_config(5), mode=mode, calib_batches=2), counter])
    with pytest.raises(
        ValueError,
        match=r"layer 'fc1' \(Linear, input_tensors\): ch_axis=5 \(per_channel\) is out of range for the activation of shape \(8, 16\)",
    ):
        trainer.fit(BoringMLP(), datamodule=DataModule())
    assert counter.steps == 0  # no sanity check, no training batch ran


def test_activation_ch_axis_in_range_trains_and_calibrates(tmp_path: Any) -> None:
    seed()
    model = BoringMLP()
    trainer = make_trainer(tmp_path, [QuantCallback(per_channel_act_config(-1), mode="ptq", calib_batches=2)])
    trainer.fit(model, datamodule=DataModule())
    scales = {name: q.calculate_qparams()[0].shape for name, q in quantizers(model) if name.endswith("input_tensors")}
    assert scales == {"fc1.input_tensors": torch.Size([16]), "fc2.input_tensors": torch.Size([32])}


# ----------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize(("precision", "dtype"), [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_true_precision_calibrates_and_tests_in_the_models_dtype(
    precision: str, dtype: torch.dtype, tmp_path: Any
) -> None:
    seed()
    model, dm = BoringMLP(), DataModule()
    logger = CSVLogger(str(tmp_path))  # the SQNR report runs a batch too
    trainer = make_trainer(
        tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_batches=2)], precision=precision, logger=logger
    )
    trainer.fit(model, datamodule=dm)  # PTQ: calibrates at the end of fit
    (metrics,) = trainer.test(model, datamodule=dm, verbose=False)
    assert model.fc1.weight.dtype == dtype and torch.isfinite(torch.tensor(metrics["test_loss"]))
    assert all(bool(q.initialized) for _, q in quantizers(model))
    calibration_inputs = [x for training, grad, x in model.calls if not training and not grad]
    assert calibration_inputs and all(x.dtype == dtype for x in calibration_inputs)

    fresh = BoringMLP()  # PTQ on test(): calibration before the test loop, in the same dtype
    tester = make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_batches=2)], precision=precision)
    (again,) = tester.test(fresh, datamodule=dm, verbose=False)
    assert torch.isfinite(torch.tensor(again["test_loss"]))


# ----------------------------------------------------------------------------------------------- calibration data
@pytest.mark.parametrize(
    "calib",
    [[], DataLoader(TensorDataset(torch.zeros(0, 16), torch.zeros(0, dtype=torch.long)), batch_size=8), iter([])],
    ids=["empty-list", "empty-dataloader", "exhausted-iterator"],
)
def test_empty_calib_dataloader_errors_at_fit_start(calib: Any, tmp_path: Any) -> None:
    counter = StepCounter()
    trainer = make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_dataloader=calib), counter])
    with pytest.raises(ValueError, match=r"QuantCallback: calib_dataloader (is empty|yielded no batch)"):
        trainer.fit(BoringMLP(), datamodule=DataModule())
    assert counter.steps == 0


def test_nan_calib_dataloader_errors_at_fit_start(tmp_path: Any) -> None:
    data = make_data(16)
    data.tensors[0][3, 5] = float("nan")
    counter = StepCounter()
    trainer = make_trainer(
        tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_dataloader=loader(data)), counter]
    )
    with pytest.raises(
        ValueError,
        match=r"first batch of calib_dataloader holds non-finite values in batch\[0\] \(Tensor\[8, 16\]: 1 NaN, 0 Inf\)",
    ):
        trainer.fit(BoringMLP(), datamodule=DataModule())
    assert counter.steps == 0


def test_a_one_shot_calibration_iterator_keeps_the_batch_peeked_at(tmp_path: Any) -> None:
    seed()
    first = torch.zeros(8, 16)
    first[0, 0] = 100.0  # only the first batch has this maximum: calibration must see it
    batches = (b for b in [(first, torch.zeros(8, dtype=torch.long)), *list(loader(make_data(16)))])
    model = BoringMLP()
    trainer = make_trainer(tmp_path, [QuantCallback(minmax_config(), mode="ptq", calib_dataloader=batches)])
    trainer.fit(model, datamodule=DataModule())
    scale = float(model.fc1._input_quantizer.calculate_qparams()[0])
    assert scale > 0.5  # about 100 / 127.5: the first batch's maximum (the other batches' are about 4)


# ----------------------------------------------------------------------------------------------- warnings
def test_unmatched_names_and_unused_layer_types_warn_once(tmp_path: Any) -> None:
    config = Config.from_dict(
        {
            "global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT},
            "layer_type_quant_config": {"Conv1d": {"weight": INT8_PER_TENSOR_ACT}},
            "layer_quant_config": {"fc9": {"weight": INT8_PER_TENSOR_ACT}},
        }
    )
    trainer = make_trainer(tmp_path, [QuantCallback(config, mode="ptq", calib_batches=1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every call shows: a second warning of the same text would be counted
        trainer.fit(BoringMLP(), datamodule=DataModule())
    messages = [str(w.message) for w in caught]
    typo = [m for m in messages if "layer_quant_config entries match no layer" in m]
    unused = [m for m in messages if "layer_type_quant_config entries name layer types the model does not have" in m]
    assert typo == ["Config.layer_quant_config entries match no layer of the model (typo?): ['fc9']"]
    assert (
        len(unused) == 1
        and "['Conv1d']" in unused[0]
        and "the model's quantizable layer types: ['Linear']" in unused[0]
    )
