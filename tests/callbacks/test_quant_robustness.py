"""QuantCallback with other models and callbacks: keyword-argument forwards, fit twice, ModelPruning, EarlyStopping,
bf16-mixed precision, configs that match nothing, bad arguments."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cb_helpers import (
    BoringMLP,
    DataModule,
    QuantCallback,
    assert_states_equal,
    fake_quant,
    float_forward,
    loader,
    make_data,
    make_trainer,
    manual_forward,
    minmax_config,
    qstate,
    quantizers,
    seed,
    tqt_config,
    tqt_params,
)
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import EarlyStopping, ModelPruning
from torch import nn

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantLinear, QuantMixin
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT, recipe


# ----------------------------------------------------------------------------------------------- keyword arguments
class KwargMLP(BoringMLP):
    """forward(x, *, scale): training, validation and calibration call it with the keyword."""

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x * scale)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x, scale=0.5)
        return logits, nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_model_whose_forward_takes_keyword_arguments(tmp_path, mode) -> None:
    seed(0)
    model = KwargMLP()
    dm = DataModule()
    cb = QuantCallback(
        minmax_config(), mode=mode, observer_steps=2, calib_batches=2, calib_forward=lambda m, b: m(b[0], scale=0.5)
    )
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2)
    trainer.fit(model, datamodule=dm)
    trainer.test(model, datamodule=dm, verbose=False)
    # the first layer's input range is the one of the scaled inputs (training or calibration batches 0-1)
    x = dm.train.tensors[0][:16] * 0.5
    observer = model.fc1._input_quantizer.observer
    assert float(observer.min_val) == float(x.min()) and float(observer.max_val) == float(x.max())
    for x_test, logits in model.test_outputs:
        assert torch.equal(logits, manual_forward(model, x_test * 0.5))


# ----------------------------------------------------------------------------------------------- fit twice
def _layout(model: nn.Module) -> tuple[list[str], list[str]]:
    return [k for k in model.state_dict()], [f"{n}:{type(m).__name__}" for n, m in model.named_modules()]


def test_fit_twice_on_the_same_trainer_does_not_swap_twice(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(tqt_config(), mode="qat", observer_steps=2)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=3, max_epochs=1)
    trainer.fit(model, datamodule=dm)
    layout = _layout(model)
    thresholds = [id(t) for t in tqt_params(model)]
    first_weights = model.fc1.weight.detach().clone()

    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 6
    assert _layout(model) == layout
    assert sum(isinstance(m, QuantMixin) for m in model.modules()) == 2
    assert type(model.fc1) is QuantLinear and not isinstance(model.fc1._input_quantizer, QuantMixin)
    assert [id(t) for t in tqt_params(model)] == thresholds  # the same Parameters, trained by the new optimizer
    in_optimizer = {id(p) for g in model.optimizer.param_groups for p in g["params"]}
    assert set(thresholds) <= in_optimizer
    assert not torch.equal(first_weights, model.fc1.weight)
    _, logits = model.val_outputs[-1]
    x = model.val_outputs[-1][0]
    assert torch.equal(logits, manual_forward(model, x))


def test_fit_again_with_a_second_trainer_on_the_same_model_and_callback(tmp_path) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(minmax_config(), mode="qat", observer_steps=2)
    make_trainer(tmp_path / "1", [cb], limit_train_batches=3).fit(model, datamodule=dm)
    layout = _layout(model)

    trainer = make_trainer(tmp_path / "2", [cb], limit_train_batches=3)
    trainer.fit(model, datamodule=dm)
    assert _layout(model) == layout
    assert sum(isinstance(m, QuantMixin) for m in model.modules()) == 2
    for _, q in quantizers(model):  # observers fixed again after the second run's warm-up
        assert not bool(q.observer_enabled) and bool(q.fake_quant_enabled) and bool(q.initialized)
    trainer.test(model, datamodule=dm, verbose=False)
    for x, logits in model.test_outputs:
        assert torch.equal(logits, manual_forward(model, x))


def test_ptq_fit_twice_trains_float_and_calibrates_the_new_weights(tmp_path) -> None:
    seed(0)
    model = BoringMLP(lr=0.5)
    dm = DataModule()
    cb = QuantCallback(minmax_config(), mode="ptq", calib_batches=2)
    make_trainer(tmp_path / "1", [cb], limit_train_batches=3).fit(model, datamodule=dm)
    layout = _layout(model)
    first = qstate(model)

    # the second fit calibrates on narrower data: its qparams must describe that data, not the first calibration's
    narrow = make_data(16, seed=9)
    narrow.tensors = (narrow.tensors[0] * 0.25, narrow.tensors[1])
    cb.calib_dataloader = loader(narrow)

    class Calibrated(Callback):
        def __init__(self) -> None:
            self.during: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.during.append(cb.calibrated)  # what a checkpoint written now would record

    n_val = len(model.val_outputs)
    flag = Calibrated()
    make_trainer(tmp_path / "2", [cb, flag], limit_train_batches=3).fit(model, datamodule=dm)
    assert flag.during == [False] * 3 and cb.calibrated
    assert _layout(model) == layout
    # the second fit trained and validated in float again ...
    for x, logits in model.val_outputs[n_val:]:
        assert torch.allclose(logits, float_forward(model, x), atol=1e-6)
    # ... and its calibration describes the new weights and the new data only: a fresh calibration agrees
    second = qstate(model)
    assert float(second["fc1.input_tensors.observer.max_val"]) == float(narrow.tensors[0].max())
    assert not torch.equal(first["fc1.input_tensors.<scale>"], second["fc1.input_tensors.<scale>"])
    fresh = BoringMLP()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if "_quantizer" not in k}, strict=False)
    make_trainer(tmp_path / "3", [QuantCallback(minmax_config(), mode="ptq", calib_dataloader=loader(narrow))]).test(
        fresh, datamodule=dm, verbose=False
    )
    assert_states_equal(second, qstate(fresh))


# ----------------------------------------------------------------------------------------------- other callbacks
def _zero_fractions(model: BoringMLP) -> tuple[float, float]:
    """(zeros in the weights and biases, zeros in what the quantized layers compute with), over both layers."""
    stored = effective = total = 0
    for layer in (model.fc1, model.fc2):
        assert isinstance(layer, QuantLinear) and isinstance(layer.weight, nn.Parameter)  # pruning made permanent
        stored += int((layer.weight == 0).sum()) + int((layer.bias == 0).sum())
        effective += int((fake_quant(layer._weight_quantizer, layer.weight) == 0).sum()) + int((layer.bias == 0).sum())
        total += layer.weight.numel() + layer.bias.numel()
    return stored / total, effective / total


@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_model_pruning_after_quant_callback_prunes_the_quantized_layers(tmp_path, mode) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    cb = QuantCallback(recipe("w8a8_int8"), mode=mode, observer_steps=1, calib_batches=2)
    trainer = make_trainer(tmp_path, [cb, ModelPruning("l1_unstructured", amount=0.5)], limit_train_batches=2)
    trainer.fit(model, datamodule=dm)

    # global L1 pruning of half of the weights and biases at the end of the epoch, made permanent at the end
    stored, effective = _zero_fractions(model)
    assert stored == 0.5
    assert 0.5 <= effective < 0.55  # int8 rounds a few more small weights to zero
    # the quantized layers compute with the pruned weights
    x = dm.test.tensors[0]
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), manual_forward(model, x))


def test_model_pruning_reaches_the_training_forward_of_the_quantized_layers(tmp_path) -> None:
    """Two epochs: in the second one, QAT trains with the weights pruned at the end of the first (50% then 75%)."""

    class WeightZeros(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            w = pl_module.fc1.weight  # what this step's forward computed with (pruning sets it in a pre-hook)
            self.seen.append((trainer.current_epoch, float((w == 0).float().mean())))

    seed(0)
    model = BoringMLP()
    cb = QuantCallback(recipe("w8a8_int8"), mode="qat", observer_steps=1)
    zeros = WeightZeros()
    pruning = ModelPruning("l1_unstructured", amount=0.5)
    make_trainer(tmp_path, [cb, pruning, zeros], max_epochs=2, limit_train_batches=2).fit(
        model, datamodule=DataModule()
    )
    stored, effective = _zero_fractions(model)
    assert stored == 0.75 and 0.75 <= effective < 0.8
    assert [f == 0.0 for e, f in zeros.seen if e == 0] == [True, True]
    assert all(f > 0.3 for e, f in zeros.seen if e == 1)  # pruned (globally: about half of fc1) in epoch 2
    assert len(model.train_checks) == 4
    for _, logits, manual in model.train_checks:  # manual: the quantizers applied to that pruned layer.weight
        assert torch.equal(logits, manual)


def test_model_pruning_before_quant_callback_is_refused_with_the_order_to_use(tmp_path) -> None:
    """ModelPruning collects the layers in its own setup; QuantCallback would then swap them out from under it."""
    trainer = make_trainer(tmp_path, [ModelPruning("l1_unstructured", amount=0.5), QuantCallback(minmax_config())])
    with pytest.raises(ValueError, match=r"QuantCallback.*before.*ModelPruning"):
        trainer.fit(BoringMLP(), datamodule=DataModule())


@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_early_stopping(tmp_path, mode) -> None:
    seed(0)
    model = BoringMLP()
    stop = EarlyStopping(monitor="val_loss", stopping_threshold=100.0)  # stops after the first validation
    cb = QuantCallback(minmax_config(), mode=mode, observer_steps=2, calib_batches=2)
    trainer = make_trainer(tmp_path, [cb, stop], max_epochs=5, limit_train_batches=3)
    trainer.fit(model, datamodule=DataModule())
    assert stop.stopped_epoch == 0 and trainer.current_epoch == 1 and trainer.global_step == 3
    for _, q in quantizers(model):
        assert bool(q.initialized) and bool(q.fake_quant_enabled) and not bool(q.observer_enabled)
    if mode == "ptq":
        assert cb.calibrated and os.path.isfile(cb.quantized_checkpoint)


# ----------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("mode", ["qat", "ptq"])
def test_bf16_mixed_precision(tmp_path, mode) -> None:
    seed(0)
    model = BoringMLP()
    dm = DataModule()
    config = tqt_config() if mode == "qat" else recipe("w8a8_int8")
    cb = QuantCallback(config, mode=mode, observer_steps=2, calib_batches=2)
    trainer = make_trainer(tmp_path, [cb], precision="bf16-mixed", limit_train_batches=3)
    trainer.fit(model, datamodule=dm)
    loss = trainer.test(model, datamodule=dm, verbose=False)[0]["test_loss"]
    assert torch.isfinite(torch.tensor(loss))
    for _, q in quantizers(model):
        scale, _ = q.calculate_qparams()
        assert bool(q.initialized) and bool(torch.isfinite(scale).all()) and bool(q.fake_quant_enabled)
    # the test logits are the quantized model's, computed in bf16 autocast as Lightning runs the step
    for x, logits in model.test_outputs:
        assert logits.dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, unquantized = manual_forward(model, x), float_forward(model, x)
        assert torch.equal(logits, expected)
        assert not torch.equal(logits, unquantized)
    if mode == "qat":
        assert all(bool(torch.isfinite(t).all()) for t in tqt_params(model))


# ----------------------------------------------------------------------------------------------- errors
def test_config_matching_no_layer_fails_in_setup_listing_the_layers(tmp_path) -> None:
    config = Config.from_dict({"global_quant_config": {"weight": INT8_PER_TENSOR_ACT}, "exclude": ["fc*"]})
    cb = QuantCallback(config)
    model = BoringMLP()
    with pytest.raises(ValueError, match="matches no layer") as err:
        make_trainer(tmp_path, [cb]).fit(model, datamodule=DataModule())
    for layer in ("fc1 (Linear)", "act (ReLU)", "fc2 (Linear)"):
        assert layer in str(err.value)
    assert not any(isinstance(m, QuantMixin) for m in model.modules())


def test_config_matching_no_layer_also_fails_for_test(tmp_path) -> None:
    config = Config.from_dict(
        {"global_quant_config": {}, "layer_quant_config": {"nothing_here": {"weight": INT8_PER_TENSOR_ACT}}}
    )
    with pytest.warns(UserWarning, match="nothing_here"), pytest.raises(ValueError, match=r"fc1 \(Linear\)"):
        make_trainer(tmp_path, [QuantCallback(config, mode="ptq")]).test(
            BoringMLP(), datamodule=DataModule(), verbose=False
        )


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"mode": "foo"}, "mode"),
        ({"mode": "QAT"}, "mode"),
        ({"observer_steps": 0}, "observer_steps"),
        ({"observer_steps": 2.5}, "observer_steps"),
        ({"observer_steps": True}, "observer_steps"),
        ({"calib_batches": 0}, "calib_batches"),
        ({"calib_batches": -3}, "calib_batches"),
        ({"calib_epochs": 0}, "calib_epochs"),
        ({"freeze_bn_epoch": -1}, "freeze_bn_epoch"),
        ({"calib_forward": "model"}, "calib_forward"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, argument) -> None:
    with pytest.raises(ValueError, match=rf"`?{argument}\b") as err:
        QuantCallback(minmax_config(), **kwargs)
    assert argument in str(err.value)


def test_config_of_a_wrong_type_is_refused() -> None:
    with pytest.raises(ValueError, match="config"):
        QuantCallback(42)


def test_config_as_a_dict_or_dictconfig(tmp_path) -> None:
    from omegaconf import OmegaConf

    data = {"global_quant_config": {"weight": INT8_PER_TENSOR_ACT, "input_tensors": INT8_PER_TENSOR_ACT}}
    for config in (data, OmegaConf.create(data)):
        cb = QuantCallback(config, mode="ptq", calib_dataloader=loader(make_data(16)))
        assert cb.config == minmax_config()
