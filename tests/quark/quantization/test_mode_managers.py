"""``preserve_modes`` / ``paused_quantizers`` (quark.torch.quantization.state) and the code paths built on them: a
BatchNorm frozen in eval while the model trains (the callback's ``freeze_bn_epoch``) stays frozen after a
measurement, and every quantizer switch is put back exactly, also on error and when nested."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.algorithm.sensitivity import hessian_trace, measure_sensitivity
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.graph.checks import float_run
from quark.torch.quantization.state import paused_quantizers, preserve_modes
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase


def _spec(qscheme: str = "per_channel") -> QuantizationSpec:
    d = {
        "dtype": "int8",
        "qscheme": qscheme,
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
        "observer_cls": "PerChannelMinMaxObserver" if qscheme == "per_channel" else "PerTensorMinMaxObserver",
    }
    if qscheme == "per_channel":
        d["ch_axis"] = 0
    return QuantizationSpec.from_dict(d)


def _frozen_bn_model() -> tuple[nn.Module, nn.BatchNorm1d]:
    """A model in training with its BatchNorm in eval, as ``freeze_bn_epoch`` leaves it."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    model = nn.Sequential(nn.Linear(4, 8), bn, nn.ReLU(), nn.Linear(8, 3)).train()
    bn.eval()
    return model, bn


def _quantized() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    config = Config(global_quant_config=QuantizationConfig(weight=_spec(), input_tensors=_spec("per_tensor")))
    return ModelQuantizer(config).quantize_model(model, [torch.randn(16, 4)])


def _flags(model: nn.Module) -> list[tuple[int, int]]:
    return [
        (int(q.observer_enabled), int(q.fake_quant_enabled)) for q in model.modules() if isinstance(q, FakeQuantizeBase)
    ]


# ----------------------------------------------------------------------------------------------- preserve_modes
def test_preserve_modes_restores_each_submodule_flag_also_on_error() -> None:
    model, bn = _frozen_bn_model()
    with pytest.raises(RuntimeError), preserve_modes(model, mode=False):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("boom")
    assert model.training and model[0].training and not bn.training


def test_preserve_modes_nested() -> None:
    model, bn = _frozen_bn_model()
    with preserve_modes(model, mode=False):
        with preserve_modes(model, mode=True):
            assert bn.training
        assert not any(m.training for m in model.modules())
    assert model.training and not bn.training


def test_measure_sensitivity_keeps_a_frozen_batchnorm_in_eval() -> None:
    model, bn = _frozen_bn_model()
    batches = [torch.randn(16, 4) for _ in range(2)]
    measure_sensitivity(model, {"w8": QuantizationConfig(weight=_spec())}, batches, method="mse")
    assert model.training and not bn.training  # model.train(was_training) put it back in training


def test_hessian_trace_keeps_a_frozen_batchnorm_in_eval() -> None:
    model, bn = _frozen_bn_model()
    hessian_trace(model, ["0"], [torch.randn(16, 4)], lambda m, b: m(b).pow(2).mean(), samples=1)
    assert model.training and not bn.training


# ----------------------------------------------------------------------------------------------- paused_quantizers
def test_paused_quantizers_observers_off_then_restored_exactly() -> None:
    model = _quantized()
    qs = [q for q in model.modules() if isinstance(q, FakeQuantizeBase)]
    qs[0].enable_observer(True)
    qs[1].disable_fake_quant()  # the user's choice: stays off
    before = _flags(model)
    with paused_quantizers(model) as paused:
        assert paused == qs
        assert all(int(q.observer_enabled) == 0 for q in qs)
        assert [int(q.fake_quant_enabled) for q in qs] == [f for _, f in before]
    assert _flags(model) == before


def test_paused_quantizers_restored_after_an_error_and_nested() -> None:
    model = _quantized()
    before = _flags(model)
    with pytest.raises(ValueError), paused_quantizers(model):
        with paused_quantizers(model, fake_quant=True):
            assert _flags(model) == [(0, 0)] * len(before)
        assert all(f == 1 for _, f in _flags(model))
        raise ValueError("boom")
    assert _flags(model) == before


def test_paused_quantizers_predicate_picks_the_float_ones() -> None:
    model = _quantized()
    qs = [q for q in model.modules() if isinstance(q, FakeQuantizeBase)]
    with paused_quantizers(model, fake_quant=lambda q: q is qs[0]):
        assert [int(q.fake_quant_enabled) for q in qs] == [0] + [1] * (len(qs) - 1)
    assert all(int(q.fake_quant_enabled) for q in qs)


def test_float_run_restores_flags_and_modes() -> None:
    model = _quantized()
    model.train()
    model[1].eval()
    before = _flags(model)
    x = torch.randn(5, 4)
    out = float_run(model, ((x,), {}))
    with torch.no_grad():
        hidden = torch.relu(torch.nn.functional.linear(x, model[0].weight, model[0].bias))
        reference = torch.nn.functional.linear(hidden, model[2].weight, model[2].bias)
    torch.testing.assert_close(out, reference)  # float: no quantizer applied
    assert _flags(model) == before and model.training and not model[1].training
