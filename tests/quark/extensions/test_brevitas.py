"""The Brevitas-style config: defaults, validation, the conversion to this engine's specs, and (with Brevitas
installed) the Brevitas backend agreeing with the native path and exporting ONNX QCDQ that onnxruntime runs."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from quark.torch import ModelQuantizer
from quark.torch.extensions.brevitas import (
    Backend,
    Config,
    ParamType,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    QuantType,
    to_quark_config,
)
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType
from quark_lightning.tasks.digits import DigitsCNN

warnings.filterwarnings("ignore", category=DeprecationWarning)


# ----------------------------------------------------------------------------------------------- config
def test_defaults_are_usable_as_they_are() -> None:
    spec = QuantizationSpec()
    assert (spec.qscheme, spec.symmetric, spec.scale_type, spec.quant_type, spec.param_type, spec.bit_width) == (
        QSchemeType.per_tensor,
        True,
        ScaleType.float,
        QuantType.int_quant,
        ParamType.stats,
        8,
    )
    assert spec.exponent_bit_width is None and spec.mantissa_bit_width is None
    config = Config(global_quant_config=QuantizationConfig(weight=spec))
    assert config.backend is Backend.layerwise and config.pre_quant_opt_config == [] and config.algo_config == []
    assert QTensorConfig is QuantizationSpec and QLayerConfig is QuantizationConfig


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"bit_width": 1}, r"bit_width=1 is out of range for int_quant; allowed: 2..16"),
        ({"bit_width": 17}, r"allowed: 2..16"),
        ({"quant_type": "float_quant", "bit_width": 8}, "needs exponent_bit_width and mantissa_bit_width"),
        (
            {"quant_type": "float_quant", "bit_width": 8, "exponent_bit_width": 4, "mantissa_bit_width": 2},
            r"1 sign \+ exponent_bit_width=4 \+ mantissa_bit_width=2 = 7 bits, but bit_width=8",
        ),
        (
            {"quant_type": "float_quant", "bit_width": 6, "exponent_bit_width": 1, "mantissa_bit_width": 4},
            r"e1m4 is not a format of this engine; allowed: \['e4m3 \(8 bits\)'",
        ),
        ({"exponent_bit_width": 4}, "apply to quant_type=float_quant only"),
        ({"qscheme": "per_group"}, r"per_group has no group size here; allowed: \['per_tensor', 'per_channel'\]"),
        ({"param_type": "kl"}, r"param_type='kl' is not allowed; allowed: \['stats', 'mse'\]"),
        ({"quant_type": "fixed"}, r"quant_type='fixed' is not allowed; allowed: \['int_quant', 'float_quant'\]"),
        ({"scale_type": "float16"}, r"scale_type=float16 is not allowed; allowed: \['float', 'pof2'\]"),
        ({"bits": 4}, r"QuantizationSpec has no field\(s\) \['bits'\]; allowed"),
    ],
)
def test_validation_names_the_field_and_what_is_allowed(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantizationSpec.from_dict(fields)


@pytest.mark.parametrize(
    ("spec", "role", "expected"),
    [
        (QuantizationSpec(), "weight", ("int8", "per_tensor", None, True, "float", "PerTensorMinMaxObserver")),
        (
            QuantizationSpec(qscheme="per_channel", bit_width=4),
            "weight",
            ("int4", "per_channel", 0, True, "float", "PerChannelMinMaxObserver"),
        ),
        (
            QuantizationSpec(qscheme="per_channel", bit_width=5),
            "input_tensors",
            ("int5", "per_channel", 1, True, "float", "PerChannelMinMaxObserver"),
        ),
        (
            QuantizationSpec(symmetric=False, bit_width=3),
            "input_tensors",
            ("uint3", "per_tensor", None, False, "float", "PerTensorMinMaxObserver"),
        ),
        (
            QuantizationSpec(scale_type="pof2", bit_width=6),
            "weight",
            ("int6", "per_tensor", None, True, "pof2", "PerTensorMinMaxObserver"),
        ),
        (
            QuantizationSpec(param_type="mse", bit_width=12),
            "weight",
            ("int12", "per_tensor", None, True, "float", "PerTensorMSEObserver"),
        ),
        (
            QuantizationSpec(quant_type="float_quant", bit_width=8, exponent_bit_width=5, mantissa_bit_width=2),
            "weight",
            ("fp8_e5m2", "per_tensor", None, None, None, "PerTensorMinMaxObserver"),
        ),
        (
            QuantizationSpec(quant_type="float_quant", bit_width=4, exponent_bit_width=2, mantissa_bit_width=1),
            "weight",
            ("fp4", "per_tensor", None, None, None, "PerTensorMinMaxObserver"),
        ),
    ],
)
def test_conversion_table(spec: QuantizationSpec, role: str, expected: tuple) -> None:
    config = to_quark_config(Config(global_quant_config=QuantizationConfig(**{role: spec})))
    s = getattr(config.global_quant_config, role)
    scale = s.scale_type.name if s.scale_type is not None and s.dtype.is_integer else None
    assert (s.dtype.name, s.qscheme.name, s.ch_axis, s.symmetric, scale, s.observer_cls.__name__) == expected
    assert s.is_dynamic is False


def test_mse_per_channel_is_refused_by_the_native_path() -> None:
    with pytest.raises(ValueError, match="param_type=mse runs per tensor in this engine"):
        to_quark_config(Config(global_quant_config={"weight": {"qscheme": "per_channel", "param_type": "mse"}}))


def test_native_path_runs_in_model_quantizer_and_matches_the_direct_config() -> None:
    """The converted config quantizes exactly like the same spec written in the engine's own API."""
    torch.manual_seed(0)
    x = torch.rand(32, 1, 8, 8)
    model = DigitsCNN(width=8).eval()
    brevitas = Config(
        global_quant_config=QuantizationConfig(
            weight=QuantizationSpec(qscheme="per_channel", bit_width=4), input_tensors=QuantizationSpec()
        )
    )
    native = ModelQuantizer(to_quark_config(brevitas)).quantize_model(copy.deepcopy(model), [x])
    direct_spec = {
        "qscheme": "per_channel",
        "ch_axis": 0,
        "observer_cls": "PerChannelMinMaxObserver",
        "symmetric": True,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }
    act = {**direct_spec, "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", "dtype": "int8"}
    act.pop("ch_axis")
    direct = ModelQuantizer(
        {"global_quant_config": {"weight": {**direct_spec, "dtype": "int4"}, "input_tensors": act}}
    ).quantize_model(copy.deepcopy(model), [x])
    with torch.no_grad():
        assert torch.equal(native(x), direct(x))
    assert native.fc1._weight_quantizer.spec.dtype is Dtype.int4


# ----------------------------------------------------------------------------------------------- Brevitas backend
def test_backend_without_brevitas_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from quark.torch.extensions.brevitas import api

    for name in ("brevitas", "brevitas.nn"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ModuleNotFoundError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[brevitas\]"'):
        api.ModelQuantizer(Config(global_quant_config={"weight": {}})).quantize_model(DigitsCNN(width=8))


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    from quark_lightning.tasks.digits import train_digits_cnn

    model, train, test = train_digits_cnn(epochs=2)
    x = train.tensors[0][:256]
    return model, [x[i : i + 64] for i in range(0, 256, 64)], test.tensors[0]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel"])
def test_brevitas_backend_agrees_with_the_native_path(bits: int, qscheme: str, trained: tuple) -> None:
    pytest.importorskip("brevitas")
    from quark.torch.extensions.brevitas.api import ModelQuantizer as BrevitasQuantizer

    model, calib, xt = trained
    config = Config(
        global_quant_config=QuantizationConfig(
            weight=QuantizationSpec(qscheme=qscheme, bit_width=bits), input_tensors=QuantizationSpec()
        )
    )
    brevitas_model = BrevitasQuantizer(config).quantize_model(model, calib)
    native = ModelQuantizer(to_quark_config(config)).quantize_model(copy.deepcopy(model), calib)
    with torch.no_grad():
        ref, b, n = model(xt), brevitas_model(xt), native(xt)
    power = float((ref**2).mean())
    mutual = float(((b - n) ** 2).mean()) / power
    # both are close to the float model and to each other; the scale conventions differ slightly (Brevitas:
    # max / (2^(b-1) - 1); this engine, as Quark: 2 max / (2^b - 1))
    limit = 5e-4 if bits == 8 else 2e-2
    assert mutual < limit and float(((b - ref) ** 2).mean()) / power < limit
    assert float((b.argmax(1) == n.argmax(1)).float().mean()) > (0.99 if bits == 8 else 0.95)
    assert type(brevitas_model.fc1).__name__ == "QuantLinear" and type(model.fc1) is torch.nn.Linear  # a copy


def test_qcdq_export_runs_in_onnxruntime(trained: tuple, tmp_path: Path) -> None:
    pytest.importorskip("brevitas")
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from quark.torch.extensions.brevitas.api import ModelQuantizer as BrevitasQuantizer
    from quark.torch.extensions.brevitas.api import export_onnx_qcdq

    model, calib, xt = trained
    config = Config(
        global_quant_config=QuantizationConfig(
            weight=QuantizationSpec(qscheme="per_channel", bit_width=4), input_tensors=QuantizationSpec()
        )
    )
    brevitas_model = BrevitasQuantizer(config).quantize_model(model, calib)
    path = export_onnx_qcdq(brevitas_model, tmp_path / "model.onnx", xt[:1])
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"QuantizeLinear", "Clip", "DequantizeLinear"} <= ops  # 4-bit weights: int8 Q/DQ clipped to [-8, 7]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(path), options)
    out = session.run(None, {session.get_inputs()[0].name: xt[:1].numpy()})[0]
    with torch.no_grad():
        expected = brevitas_model(xt[:1]).numpy()
    assert abs(out - expected).max() < 1e-4 * max(1.0, abs(expected).max())
