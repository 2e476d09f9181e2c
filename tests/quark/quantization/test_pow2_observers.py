"""Quark's power-of-two observers against the qparams amd-quark 0.13 itself computed on the same batches
(bench/amd_quark_reference/reference_pow2_observers.pt, made by make_pow2_reference.py), and in a model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.observer import observer as observers

REFERENCE = Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference" / "reference_pow2_observers.pt"
CASES = torch.load(REFERENCE)


def _spec(cls: str, dtype: str, symmetric: bool) -> QuantizationSpec:
    per_channel = "Channel" in cls
    return QuantizationSpec(
        dtype=dtype,
        observer_cls=cls,
        symmetric=symmetric,
        scale_type="float",
        round_method="half_even",
        qscheme="per_channel" if per_channel else "per_tensor",
        ch_axis=0 if per_channel else None,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_pow2_observers_match_amd_quark(name: str) -> None:
    cls, dtype, sym = name.split("-")
    case = CASES[name]
    observer = getattr(observers, cls)(_spec(cls, dtype, sym == "sym"))
    for x in case["inputs"]:
        observer(x)
    scale, zero_point = observer.calculate_qparams()
    assert torch.equal(scale.reshape(-1).float(), case["scale"])
    assert torch.equal(zero_point.reshape(-1).to(torch.int32), case["zero_point"])


def test_the_most_frequent_pair_wins_not_the_last() -> None:
    observer = observers.PerTensorPowOf2MinMaxObserver(_spec("PerTensorPowOf2MinMaxObserver", "int8", True))
    for amax in (1.0, 1.1, 7.0):  # 1.0 and 1.1 give 2^-7; the widened range 7.0 gives 2^-4 (round(log2(7/127.5)))
        observer(torch.tensor([-amax, amax]))
    scale, _ = observer.calculate_qparams()
    assert float(scale) == 2.0**-7


def test_pow2_observers_in_a_model_give_power_of_two_scales() -> None:
    torch.manual_seed(0)
    act = _spec("PerTensorPowOf2MinMSEObserver", "int8", True)
    weight = _spec("PerChannelPowOf2MinMaxObserver", "int8", True)
    model = ModelQuantizer(
        Config(global_quant_config=QuantizationConfig(weight=weight, input_tensors=act))
    ).quantize_model(
        nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4)), [torch.randn(4, 16) for _ in range(3)]
    )
    for layer in (model[0], model[2]):
        for q in (layer._weight_quantizer, layer._input_quantizer):
            scale, _ = q.calculate_qparams()
            assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))


def test_pow2_observers_refuse_other_dtypes_by_name() -> None:
    with pytest.raises(ValueError, match=r"observer_cls=PerTensorPowOf2MinMaxObserver cannot serve dtype=int4"):
        _spec("PerTensorPowOf2MinMaxObserver", "int4", True)


def test_quarks_qat_example_specs_run_with_tqt_and_lsq_observers() -> None:
    """The spec blocks of amd-quark's vision QAT example and its TQT test, written as they are there."""
    from quark.torch.quantization.config.config import LSQSpec, QuantizationSpec, TQTSpec
    from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType, TQTThresholdInitMeth
    from quark.torch.quantization.observer.lsq_observer import LSQObserver
    from quark.torch.quantization.observer.tqt_observer import TQTObserver
    from quark.torch.quantization.tensor_quantize import LSQFakeQuantize, TQTFakeQuantize

    def tqt(dtype: Dtype, init: TQTThresholdInitMeth) -> QuantizationSpec:
        return QuantizationSpec(
            dtype=dtype,
            qscheme=QSchemeType.per_tensor,
            observer_cls=TQTObserver,
            symmetric=True,
            scale_type=ScaleType.float,
            round_method=RoundType.half_even,
            is_dynamic=False,
            qat_spec=TQTSpec(threshold_init_meth=init),
        )

    weight = tqt(Dtype.int8, TQTThresholdInitMeth._3SD)
    act = tqt(Dtype.int4, TQTThresholdInitMeth._KL_J)
    lsq = QuantizationSpec(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_channel,
        ch_axis=0,
        observer_cls=LSQObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
        qat_spec=LSQSpec(),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    config = Config(
        global_quant_config=QuantizationConfig(weight=weight, input_tensors=act),
        layer_quant_config={"2": QuantizationConfig(weight=lsq, input_tensors=act)},
    )
    prepared = ModelQuantizer(config).prepare(model)
    assert isinstance(prepared[0]._weight_quantizer, TQTFakeQuantize) and isinstance(
        prepared[2]._weight_quantizer, LSQFakeQuantize
    )
    prepared.train()
    out = prepared(torch.randn(8, 16))
    out.sum().backward()
    assert prepared[0]._weight_quantizer.log_threshold.grad is not None
    scale = prepared[0]._weight_quantizer.scale
    assert float(torch.log2(scale)) == round(float(torch.log2(scale)))  # power of two whatever scale_type says
    with pytest.raises(ValueError, match=r"observer_cls=TQTObserver needs qat_spec=TQTSpec\(...\), got None"):
        QuantizationSpec(
            dtype=Dtype.int8,
            qscheme=QSchemeType.per_tensor,
            observer_cls=TQTObserver,
            symmetric=True,
            scale_type=ScaleType.float,
            round_method=RoundType.half_even,
        )
