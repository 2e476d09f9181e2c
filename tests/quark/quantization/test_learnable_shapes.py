"""Learnable quantizers have their final shapes at prepare (before DDP lays out gradient buckets): LSQ per-channel
scales sized from the weight, and from the layer's features for activations along the feature axis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import LSQSpec, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.observer.observer import PerChannelMinMaxObserver
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, LSQFakeQuantize


def _lsq(ch_axis: int) -> QuantizationSpec:
    return QuantizationSpec(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_channel,
        ch_axis=ch_axis,
        symmetric=True,
        observer_cls=PerChannelMinMaxObserver,
        is_dynamic=False,
        qat_spec=LSQSpec(),
        round_method=RoundType.half_even,
        scale_type=ScaleType.float,
    )


def test_lsq_scales_have_their_final_shape_at_prepare_and_keep_their_parameter() -> None:
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    config = {
        "global_quant_config": {"weight": _lsq(0)},
        "layer_type_quant_config": {
            "Linear": {"weight": _lsq(0), "input_tensors": _lsq(-1)},
            "Conv2d": {"weight": _lsq(0), "input_tensors": _lsq(1)},
        },
    }
    ModelQuantizer(config).prepare(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith("scale")}
    assert shapes == {
        "0._input_quantizer.scale": (3,),
        "0._weight_quantizer.scale": (6,),
        "2._input_quantizer.scale": (96,),
        "2._weight_quantizer.scale": (5,),
    }
    params = {n: p for n, p in model.named_parameters() if n.endswith("scale")}
    for _, m in model.named_modules():
        if isinstance(m, LSQFakeQuantize):
            m.enable_observer()
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    after = dict(model.named_parameters())
    for name, p in params.items():  # initialised in place: the optimizer's and DDP's view of them still holds
        assert after[name] is p and p.shape == torch.Size([shapes[name][0]]) and p.grad is not None
        assert not torch.all(p == 1)


def test_lsq_activation_on_an_ambiguous_axis_stays_lazy_and_says_so() -> None:
    model = nn.Sequential(nn.Linear(8, 4))
    ModelQuantizer({"global_quant_config": {"input_tensors": _lsq(1)}}).prepare(model)
    q = model[0]._input_quantizer
    assert not q.channels_known  # axis 1 of a Linear input is the features only for 2-D input
    q.enable_observer()
    model(torch.randn(3, 8))
    assert q.channels_known and q.scale.shape == (8,)


def test_a_sized_lsq_scale_rejects_another_channel_count_by_name() -> None:
    q = FakeQuantizeBase.get_fake_quantize(_lsq(1))
    q.where = "layer 'enc' (Linear, input_tensors)"
    q.set_channels(4)
    q.enable_observer()
    with pytest.raises(ValueError, match=r"layer 'enc' \(Linear, input_tensors\).*4 channels.*5 along axis 1"):
        q(torch.randn(2, 5))


def test_tqt_per_channel_weight_thresholds_are_sized_at_prepare_and_init_in_place() -> None:
    tqt = QuantizationSpec(
        dtype=Dtype.int4,
        qscheme=QSchemeType.per_channel,
        ch_axis=0,
        symmetric=True,
        observer_cls=PerChannelMinMaxObserver,
        is_dynamic=False,
        qat_spec=TQTSpec(),
        round_method=RoundType.half_even,
        scale_type=ScaleType.pof2,
    )
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    ModelQuantizer({"global_quant_config": {"weight": tqt}}).prepare(model)
    params = {n: p for n, p in model.named_parameters() if n.endswith("log_threshold")}
    assert {n: tuple(p.shape) for n, p in params.items()} == {
        "0._weight_quantizer.log_threshold": (6,),
        "2._weight_quantizer.log_threshold": (5,),
    }
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    after = dict(model.named_parameters())
    for name, p in params.items():
        assert after[name] is p and p.grad is not None and not torch.all(p == 0)
