"""No NaN or inf becomes a scale, and imports validate before they build (issue 18, items 3, 4 and 6's engine part).

Learned TQT thresholds and LSQ step sizes that turn non-finite are refused with an error naming the layer and role;
float16 scales saturate instead of overflowing; the MSE and percentile observers keep working for data near float32's
range; fp16 inputs at 65504 never come back as inf; and every crafted file, in this project's single-file format and
in amd-quark's directory, is refused with a ValueError naming the tensor before the model changes. References are
torch's own dtype limits and values computed by hand, not the code under test.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, LSQSpec, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.observer.observer import (
    LSQObserver,
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
    TQTObserver,
)
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, LSQFakeQuantize, TQTFakeQuantize

FP16_MAX = torch.finfo(torch.float16).max  # 65504


def _spec(**overrides: object) -> QuantizationSpec:
    kwargs: dict[str, object] = dict(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_tensor,
        observer_cls=PerTensorMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )
    kwargs.update(overrides)
    return QuantizationSpec(**kwargs)  # type: ignore[arg-type]


def _static(**kw: object) -> dict[str, object]:
    base = {
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
        "qscheme": "per_tensor",
    }
    return base | kw


# ----------------------------------------------------------------------------------------------- TQT / LSQ
class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


TQT = _static(dtype="int8", observer_cls="TQTObserver", scale_type="pof2", qat_spec={"method": "tqt"})
LSQ = _static(dtype="int8", observer_cls="LSQObserver", qat_spec={"method": "lsq"})


def _qat_model(spec: dict[str, object]) -> Two:
    torch.manual_seed(0)
    model = ModelQuantizer(Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})).prepare(
        Two()
    )
    model(torch.randn(8, 16))  # the first batch initialises every threshold / step size
    return model


@pytest.mark.parametrize(
    ("spec", "param", "value"),
    [
        (TQT, "log_threshold", float("nan")),
        (TQT, "log_threshold", float("inf")),
        (TQT, "log_threshold", 200.0),
        (TQT, "log_threshold", -200.0),
        (LSQ, "scale", float("nan")),
        (LSQ, "scale", float("inf")),
        (LSQ, "scale", 0.0),
        (LSQ, "scale", -0.5),
    ],
    ids=[
        "tqt_nan",
        "tqt_inf",
        "tqt_2^200_overflows",
        "tqt_2^-200_underflows",
        "lsq_nan",
        "lsq_inf",
        "lsq_zero",
        "lsq_negative",
    ],
)
def test_a_non_finite_learned_scale_is_refused_naming_the_layer_and_role(
    spec: dict[str, object], param: str, value: float
) -> None:
    model = _qat_model(spec)
    with torch.no_grad():
        getattr(model.fc2._weight_quantizer, param).fill_(value)  # what a bad optimizer step leaves behind
    with pytest.raises(ValueError, match=r"layer 'fc2' \(Linear, weight\).*no finite positive scale"):
        model(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"layer 'fc2' \(Linear, weight\)"):  # nor is it exported or frozen
        model.fc2._weight_quantizer.calculate_qparams()


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_a_nan_gradient_step_is_caught_at_the_next_forward(spec: dict[str, object]) -> None:
    model = _qat_model(spec)
    quantizer = model.fc1._input_quantizer
    learned = quantizer.log_threshold if isinstance(quantizer, TQTFakeQuantize) else quantizer.scale
    optimizer = torch.optim.SGD([learned], lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    learned.grad.fill_(float("nan"))
    optimizer.step()
    with pytest.raises(ValueError, match=r"layer 'fc1' \(Linear, input_tensors\)"):
        model(torch.randn(8, 16))


@pytest.mark.parametrize("spec", [TQT, LSQ], ids=["tqt", "lsq"])
def test_initialising_from_a_nan_batch_names_the_layer(spec: dict[str, object]) -> None:
    torch.manual_seed(0)
    model = ModelQuantizer(Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})).prepare(
        Two()
    )
    x = torch.randn(8, 16)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer 'fc1' \(Linear, input_tensors\).*NaN or Inf"):
        model(x)


def test_a_calibration_nan_names_the_layer_and_role() -> None:
    torch.manual_seed(0)
    spec = _static(dtype="int8")
    model = ModelQuantizer(Config.from_dict({"global_quant_config": {"weight": spec, "input_tensors": spec}})).prepare(
        Two()
    )
    x = torch.randn(8, 16)
    x[3, 5] = float("inf")
    with pytest.raises(
        ValueError, match=r"layer 'fc1' \(Linear, input_tensors\): PerTensorMinMaxObserver observed .*NaN or Inf"
    ):
        model(x)


def test_valid_learned_values_still_train() -> None:
    model = _qat_model(LSQ)
    out = model(torch.randn(8, 16))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(model.fc1._input_quantizer.scale.grad).all()


# ----------------------------------------------------------------------------------------------- float16 scales
def test_a_float16_scale_saturates_at_float16s_largest_value() -> None:
    q = FakeQuantizeBase.get_fake_quantize(_spec(scale_type=ScaleType.float16))
    x = torch.tensor([1e8, -1e8, 3.0])
    with pytest.warns(UserWarning, match="exceeds float16's largest value"):
        y = q(x)
    scale, _ = q.calculate_qparams()
    assert float(scale) == FP16_MAX  # 1e8 / 127.5 = 784314 has no float16: the largest finite one, not inf
    assert torch.isfinite(y).all()
    assert float(y[0]) == 127 * FP16_MAX and float(y[1]) == -128 * FP16_MAX  # clipped at the codes' ends


def test_a_float16_scale_in_range_is_the_float16_rounding() -> None:
    q = FakeQuantizeBase.get_fake_quantize(_spec(scale_type=ScaleType.float16))
    q(torch.tensor([100.0, -3.0]))
    scale, _ = q.calculate_qparams()
    assert float(scale) == float(torch.tensor(100.0 / 127.5).to(torch.float16))


# ----------------------------------------------------------------------------------------------- huge ranges
@pytest.mark.parametrize("observer", [PerTensorMSEObserver, PerTensorPercentileObserver])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("magnitude", [1e17, 1e20, 1e30, 1e36])
def test_histogram_observers_stay_near_min_max_for_huge_ranges(
    observer: type, symmetric: bool, magnitude: float
) -> None:
    torch.manual_seed(0)
    x = (torch.rand(20000) * 2 - 1) * magnitude  # uniform: the min-max range is (nearly) the best one
    obs = observer(_spec(observer_cls=observer, symmetric=symmetric))
    obs(x)
    scale = float(obs.calculate_qparams()[0])
    lo, hi = float(x.min()), float(x.max())
    # min-max by hand: max|x| / 127.5 (symmetric int8), (max - min) / 255 (asymmetric)
    min_max = max(-lo, hi) / 127.5 if symmetric else (hi - lo) / 255
    assert 0.5 <= scale / min_max <= 1.0 + 1e-3, (scale, min_max)


def test_an_asymmetric_range_past_float32s_span_gets_a_finite_scale() -> None:
    obs = PerTensorMinMaxObserver(_spec(symmetric=False, dtype=Dtype.uint8))
    obs(torch.tensor([-3e38, 3e38]))  # max - min overflows float32
    scale, zp = obs.calculate_qparams()
    assert torch.isfinite(scale) and abs(float(scale) - 6e38 / 255) / (6e38 / 255) < 1e-6
    assert 0 <= int(zp) <= 255


# ----------------------------------------------------------------------------------------------- fp16 at 65504
# (spec, fp16 input); the first value's grid point lies past 65504 (uint8: 255 * 257.27; fp8: 448 * 146.25; bfp16:
# 64 * 1024; LSQ: 16 * 4102; TQT: 32 * 2048), except mx6's (15 * 4096 = 61440), kept as a guard
FP16_CASES = {
    "uint8_asym": (
        _spec(dtype=Dtype.uint8, symmetric=False, scale_type=ScaleType.float32),
        [FP16_MAX, -100.0, 0.0, 1.5],
    ),
    "uint8_asym_float_scale": (_spec(dtype=Dtype.uint8, symmetric=False), [FP16_MAX, 0.0, 0.0, 1.5]),
    "fp8_e4m3": (_spec(dtype=Dtype.fp8_e4m3), [FP16_MAX, -FP16_MAX, 1.0, 0.5]),
    "bfp16": (
        _spec(
            dtype=Dtype.bfp16,
            qscheme=QSchemeType.per_group,
            observer_cls=PerBlockBFPObserver,
            group_size=8,
            ch_axis=-1,
            symmetric=None,
            scale_type=None,
            round_method=None,
        ),
        [FP16_MAX, -FP16_MAX, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    ),
    "mx6": (
        _spec(
            dtype=Dtype.mx6,
            qscheme=QSchemeType.per_group,
            observer_cls=PerBlockMXObserver,
            group_size=16,
            ch_axis=-1,
            symmetric=None,
            scale_type=None,
            round_method=None,
        ),
        [FP16_MAX, -FP16_MAX] + [1.0] * 14,
    ),
    "lsq_uint8_asym": (
        _spec(dtype=Dtype.uint8, symmetric=False, observer_cls=LSQObserver, qat_spec=LSQSpec()),
        [FP16_MAX, -FP16_MAX, 1.0, 0.5],
    ),
    "tqt_int8": (
        _spec(observer_cls=TQTObserver, qat_spec=TQTSpec(), scale_type=ScaleType.pof2),
        [FP16_MAX, -FP16_MAX, 0.0, 0.0],
    ),
}


@pytest.mark.parametrize("case", list(FP16_CASES))
def test_fp16_at_65504_never_becomes_inf(case: str) -> None:
    spec, values = FP16_CASES[case]
    x = torch.tensor(values, dtype=torch.float16, requires_grad=True)
    y = FakeQuantizeBase.get_fake_quantize(spec)(x)
    assert y.dtype == torch.float16
    assert torch.isfinite(y).all(), y
    # the grid point past 65504 saturates to float16's largest finite value
    assert float(y[0].detach()) == (15 * 4096 if case == "mx6" else FP16_MAX)
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()


def test_lsq_fp16_gradient_passes_through_the_saturated_value() -> None:
    q = LSQFakeQuantize(_spec(dtype=Dtype.uint8, symmetric=False, observer_cls=LSQObserver, qat_spec=LSQSpec()))
    x = torch.tensor([FP16_MAX, 1.0, 0.5, 2.0], dtype=torch.float16, requires_grad=True)
    q(x).float().sum().backward()
    assert float(x.grad[0]) == 1.0  # straight-through: the saturation is not a clip of the gradient


# ----------------------------------------------------------------------------------------------- imports
pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quark.torch.export import export_safetensors, import_model_from_safetensors  # noqa: E402

_MX_INT8 = {
    "dtype": "mx",
    "mx_element_dtype": "int8",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 32,
    "observer_cls": "PerBlockMXObserver",
    "is_dynamic": False,
}
_MX6 = {
    "dtype": "mx6",
    "qscheme": "per_group",
    "ch_axis": -1,
    "group_size": 16,
    "observer_cls": "PerBlockMXObserver",
    "is_dynamic": False,
}
IMPORT_CONFIG = {
    "global_quant_config": {},
    "layer_quant_config": {
        "fc1": {
            "weight": _static(dtype="int3", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver"),
            "input_tensors": _static(dtype="uint8", symmetric=False),
        },
        "fc2": {"weight": _MX_INT8},
        "fc3": {"weight": _static(dtype="fp8_e4m3"), "input_tensors": _static(dtype="fp8_e4m3")},
        "fc4": {"weight": _MX6},
        "fc5": {"weight": _static(dtype="int12"), "input_tensors": _static(dtype="int8")},
    },
}


class Five(nn.Module):
    """int3 per channel + uint8 asymmetric inputs, MX int8, fp8 weights and inputs, mx6, int12 + int8 inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc4, self.fc5 = (nn.Linear(64, 64) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in (self.fc1, self.fc2, self.fc3, self.fc4, self.fc5):
            x = torch.relu(fc(x))
        return x


def _fresh() -> Five:
    torch.manual_seed(0)
    return Five().eval()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    model = ModelQuantizer(Config.from_dict(IMPORT_CONFIG)).quantize_model(_fresh(), [torch.randn(8, 64)])
    root = tmp_path_factory.mktemp("exports")
    return {
        "single": export_safetensors(model, root / "single", custom_mode=None),
        "quark": export_safetensors(model, root / "quark"),
    }


def _set_first(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def mutate(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return mutate


DELETE = None
_ALL_NAN = lambda t: torch.full(t.shape, float("nan")).to(t.dtype)  # noqa: E731
# (format, key, mutation of the stored tensor: None deletes it)
IMPORT_CASES: dict[str, tuple[str, str, Callable[[torch.Tensor], torch.Tensor] | None]] = {}
for fmt in ("single", "quark"):
    IMPORT_CASES |= {
        f"{fmt}-nan_scale": (fmt, "fc1.weight_scale", _set_first(float("nan"))),
        f"{fmt}-zero_scale": (fmt, "fc5.weight_scale", _set_first(0.0)),
        f"{fmt}-negative_scale": (fmt, "fc1.weight_scale", _set_first(-0.5)),
        f"{fmt}-inf_scale": (fmt, "fc3.input_scale", _set_first(float("inf"))),
        f"{fmt}-zero_point_1000": (fmt, "fc1.input_zero_point", lambda t: torch.full(t.shape, 1000, dtype=torch.int32)),
        f"{fmt}-float_zero_point_for_an_integer_config": (fmt, "fc1.input_zero_point", lambda t: t.float() + 0.5),
        f"{fmt}-int12_codes_out_of_range": (fmt, "fc5.weight", _set_first(3000)),
        f"{fmt}-mxint8_minus_128": (fmt, "fc2.weight", _set_first(-128)),
        f"{fmt}-e8m0_nan_byte": (fmt, "fc2.weight_scale", _set_first(255)),
        f"{fmt}-fp8_nan_weight": (fmt, "fc3.weight", _ALL_NAN),
        f"{fmt}-missing_activation_zero_point": (fmt, "fc5.input_zero_point", DELETE),
        f"{fmt}-missing_weight_zero_point": (fmt, "fc1.weight_zero_point", DELETE),
        f"{fmt}-scale_wrong_shape": (fmt, "fc1.weight_scale", lambda t: t[:-1]),
        f"{fmt}-activation_scale_wrong_shape": (fmt, "fc5.input_scale", lambda t: t.reshape(-1).repeat(3)),
        f"{fmt}-nan_bias": (fmt, "fc4.bias", _set_first(float("nan"))),
        f"{fmt}-bias_stored_as_integers": (fmt, "fc4.bias", lambda t: t.to(torch.int32)),
    }
IMPORT_CASES |= {  # codes that only one of the formats stores
    "single-int3_packed_codes_wrong_dtype": ("single", "fc1.weight", lambda t: t.to(torch.int8)),
    "quark-int3_codes_out_of_range": ("quark", "fc1.weight", _set_first(5)),
    "quark-int3_zero_point_out_of_range": ("quark", "fc1.weight_zero_point", _set_first(100)),
    "quark-codes_wrong_dtype": ("quark", "fc1.weight", lambda t: t.to(torch.int16)),
    "quark-scale_float64": ("quark", "fc1.weight_scale", lambda t: t.double()),
    "quark-mx6_codes_out_of_range": ("quark", "fc4.weight", _set_first(100)),
    "quark-mx6_shift_not_0_or_1": ("quark", "fc4.weight_shift", _set_first(7)),
    "quark-mx6_step_nan": ("quark", "fc4.weight_scale", _set_first(float("nan"))),
    "quark-mx6_step_not_a_power_of_two": ("quark", "fc4.weight_scale", lambda t: t * 3),
    "quark-missing_mx6_shift": ("quark", "fc4.weight_shift", DELETE),
}


def _craft(source: Path, out_dir: Path, key: str, mutate: Callable[[torch.Tensor], torch.Tensor] | None) -> Path:
    """A copy of an export (its config.json too) with one tensor changed or deleted."""
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata()
    if mutate is None:
        del tensors[key]
    else:
        tensors[key] = mutate(tensors[key]).contiguous()
    out_dir.mkdir(parents=True)
    if (source.parent / "config.json").is_file():
        shutil.copy(source.parent / "config.json", out_dir / "config.json")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    return out_dir


def _assert_refused_and_unchanged(directory: Path, key: str) -> None:
    model = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        import_model_from_safetensors(model, directory)
    after = model.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, QuantMixin) for m in model.modules())


def test_both_untouched_exports_import_and_agree(exports: dict[str, Path]) -> None:
    x = torch.randn(4, 64)
    with torch.no_grad():
        single = import_model_from_safetensors(_fresh(), exports["single"].parent)(x)
        quark = import_model_from_safetensors(_fresh(), exports["quark"].parent)(x)
    assert torch.isfinite(single).all() and torch.equal(single, quark)


@pytest.mark.parametrize("case", sorted(IMPORT_CASES))
def test_a_crafted_file_is_refused_naming_the_tensor(case: str, exports: dict[str, Path], tmp_path: Path) -> None:
    fmt, key, mutate = IMPORT_CASES[case]
    _assert_refused_and_unchanged(_craft(exports[fmt], tmp_path / case, key, mutate), key)


def _with_header(source: Path, out_dir: Path, edit: Callable[[dict], None]) -> Path:
    """A copy whose safetensors header is edited (the data bytes kept): a byte length that contradicts the entry."""
    raw = source.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    out_dir.mkdir(parents=True)
    if (source.parent / "config.json").is_file():
        shutil.copy(source.parent / "config.json", out_dir / "config.json")
    (out_dir / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + n :])
    return out_dir


@pytest.mark.parametrize("fmt", ["single", "quark"])
def test_a_byte_length_that_contradicts_dtype_and_shape_names_the_tensor(
    fmt: str, exports: dict[str, Path], tmp_path: Path
) -> None:
    def grow(header: dict) -> None:
        header["fc5.bias"]["shape"] = [65]  # 65 float32 values in 256 bytes

    _assert_refused_and_unchanged(_with_header(exports[fmt], tmp_path / "grown", grow), "fc5.bias")

    def retype(header: dict) -> None:
        header["fc5.bias"]["dtype"] = "F16"  # a stored dtype that contradicts the bytes

    _assert_refused_and_unchanged(_with_header(exports[fmt], tmp_path / "retyped", retype), "fc5.bias")
