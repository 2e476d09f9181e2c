"""amd-quark >= 0.11 API on our engine: QConfig / QLayerConfig / QTensorConfig, the spec helpers, and the OCP MX
``scale_format`` / ``scale_calculation_mode`` fields. The MX scale rules are checked against a reference written
here in plain Python (math.frexp per block, the fp4 value table, PyTorch's float8 dtype), not against our kernels."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config import config as C
from quark.torch.quantization.config.config import (
    BFP16Spec,
    Config,
    FP4PerGroupSpec,
    FP8E4M3PerTensorSpec,
    Int4PerGroupSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    MX6Spec,
    OCP_MXFP4Spec,
    OCP_MXFP8E4M3Spec,
    OCP_MXINT8Spec,
    QConfig,
    QLayerConfig,
    QTensorConfig,
    QuantizationConfig,
    QuantizationSpec,
    Uint4PerGroupSpec,
)
from quark.torch.quantization.config.spec_helpers import _HELPERS
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import fake_quantize_mx, quantize_mx

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # E2M1, codes 0..7
EMAX = {Dtype.fp4: 2, Dtype.fp8_e4m3: 8}
MBITS = {Dtype.fp4: 1, Dtype.fp8_e4m3: 3}


# ----------------------------------------------------------------------------------------------- names
def test_amd_quark_names_are_our_classes() -> None:
    assert QConfig is Config and QLayerConfig is QuantizationConfig and QTensorConfig is QuantizationSpec


def _required(cls: type) -> dict[str, int]:
    return {
        f.name: (0 if f.name == "ch_axis" else 32) for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
    }


@pytest.mark.parametrize("name", list(_HELPERS))
def test_every_helper_builds_a_spec_that_runs(name: str) -> None:
    spec = getattr(C, name)(**_required(getattr(C, name))).to_quantization_spec()
    assert isinstance(spec, QuantizationSpec)
    model = nn.Sequential(nn.Linear(64, 64))
    config = QConfig(global_quant_config=QLayerConfig(weight=spec))
    x = torch.randn(4, 64)
    quantized = ModelQuantizer(config).quantize_model(model, [x])
    out = quantized(x)
    assert out.shape == (4, 64) and torch.isfinite(out).all()


def test_helpers_keep_amd_quarks_defaults() -> None:
    spec = Int8PerTensorSpec().to_quantization_spec()
    assert (spec.dtype, spec.qscheme, spec.symmetric, spec.is_dynamic) == (
        Dtype.int8,
        QSchemeType.per_tensor,
        True,
        False,
    )
    assert spec.observer_cls.__name__ == "PerTensorMinMaxObserver"
    assert (
        Int8PerTensorSpec(observer_method="percentile").to_quantization_spec().observer_cls.__name__
        == "PerTensorPercentileObserver"
    )
    assert Int8PerChannelSpec(ch_axis=0).to_quantization_spec().symmetric is False  # amd-quark 0.13's default
    group = Uint4PerGroupSpec(ch_axis=1, group_size=128).to_quantization_spec()
    assert (group.dtype, group.qscheme, group.group_size, group.symmetric) == (
        Dtype.uint4,
        QSchemeType.per_group,
        128,
        False,
    )
    fp8 = FP8E4M3PerTensorSpec(is_dynamic=True).to_quantization_spec()
    assert fp8.dtype == Dtype.fp8_e4m3 and fp8.is_dynamic
    assert MX6Spec(ch_axis=-1, block_size=16).to_quantization_spec().group_size == 16
    assert BFP16Spec(ch_axis=-1).to_quantization_spec().group_size == 8
    mxint8 = OCP_MXINT8Spec(ch_axis=-1).to_quantization_spec()
    assert (mxint8.dtype, mxint8.mx_element_dtype, mxint8.mx_scale_mode) == (Dtype.mx, Dtype.int8, "even")


def test_int8_per_channel_helper_matches_torchs_kernel() -> None:
    """The weight a helper-built Config quantizes equals torch's own per-channel fake quantization."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    spec = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
    q = ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=spec))).quantize_model(
        nn.Sequential(layer), [torch.randn(2, 32)]
    )
    w = layer.weight.detach()
    scale = w.abs().amax(dim=1) / ((127 - (-128)) / 2)  # Quark's symmetric scale: max|w| / ((qmax - qmin) / 2)
    expect = torch.fake_quantize_per_channel_affine(w, scale, torch.zeros(16, dtype=torch.int32), 0, -128, 127)
    got = q[0]._weight_quantizer(w)
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)


def test_bad_helper_options_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"Int8PerTensorSpec\.observer_method='minmax'.*min_max"):
        Int8PerTensorSpec(observer_method="minmax").to_quantization_spec()
    with pytest.raises(ValueError, match=r"scale_type='pof2'.*power_of_2"):
        Int4PerGroupSpec(ch_axis=1, group_size=32, scale_type="pof2").to_quantization_spec()
    with pytest.raises(TypeError, match="ch_axis"):
        Int8PerChannelSpec()  # type: ignore[call-arg]


# ----------------------------------------------------------------------------------------------- MX scale modes
def _shared_exponent_ref(amax: float, element: Dtype, mode: str) -> int:
    """The E8M0 exponent (unbiased) of a block, from its max|x|, in plain Python."""
    if amax == 0:
        e = -1  # frexp(0): any finite exponent works, the elements are 0
    else:
        m, e2 = math.frexp(amax)  # amax = m * 2^e2, m in [0.5, 1)
        e = e2 - 1  # floor(log2 amax)
        if mode == "ceil" and m > 0.5:
            e += 1
        if mode == "even" and 2 * m >= 2 - 2.0 ** -(MBITS[element] + 1):  # amax rounds up to 2^(e+1)
            e += 1
    return max(-127, min(127, e - EMAX[element]))


def _round_fp4_ref(v: float) -> float:
    """Nearest E2M1 value (ties to the even code), saturating at 6."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(FP4_VALUES[c] - mag), c % 2))
    return math.copysign(FP4_VALUES[best], v)


def _mx_ref(x: torch.Tensor, element: Dtype, mode: str, block: int = 32) -> tuple[torch.Tensor, list[int]]:
    rows, exps = [], []
    for b in x.reshape(-1, block).tolist():
        e = _shared_exponent_ref(max(abs(v) for v in b), element, mode)
        exps.append(e + 127)
        scale = 2.0**e
        if element == Dtype.fp4:
            rows.append([_round_fp4_ref(v / scale) * scale for v in b])
        else:  # PyTorch's own float8 e4m3fn cast, saturating at 448
            scaled = torch.tensor([v / scale for v in b]).clamp(-448, 448)
            rows.append((scaled.to(torch.float8_e4m3fn).float() * scale).tolist())
    return torch.tensor(rows).reshape(x.shape), exps


def _blocks_with_edge_maxima() -> torch.Tensor:
    """Random blocks, plus blocks whose max sits at, just below and just above the "even" bump point of fp4 and
    fp8, exact powers of two, and an all-zero block."""
    torch.manual_seed(1)
    x = torch.randn(24, 32) * torch.logspace(-3, 3, 24).unsqueeze(1)
    edges = [1.75, 1.7499, 1.7501, 1.9375, 1.937, 2.0, 1.0, 0.75 * 2**-5, 1.75 * 2**7, 0.0]
    for i, top in enumerate(edges):
        x[i] = x[i].clamp(-abs(top) * 0.9, abs(top) * 0.9) if top else 0.0
        x[i, i] = top
    return x


@pytest.mark.parametrize("element", [Dtype.fp4, Dtype.fp8_e4m3])
@pytest.mark.parametrize("mode", ["floor", "even", "ceil"])
def test_mx_scale_modes_match_the_plain_python_reference(element: Dtype, mode: str) -> None:
    x = _blocks_with_edge_maxima()
    expect, exps = _mx_ref(x, element, mode)
    _, e8m0 = quantize_mx(x, element, 32, -1, mode)
    assert e8m0.flatten().tolist() == exps
    got = fake_quantize_mx(x, element, 32, -1, mode)
    assert torch.equal(got, expect)


def test_even_takes_the_next_exponent_where_the_block_max_would_round_up() -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = 1.75  # fp4 with floor: scale 2^-2, 1.75 / 0.25 = 7 saturates to 6; even: 2^-1
    exps = {mode: int(quantize_mx(x, Dtype.fp4, 32, -1, mode)[1]) - 127 for mode in ("floor", "even", "ceil")}
    assert exps == {"floor": -2, "even": -1, "ceil": -1}
    x[0, 0] = 1.5  # exact on the element grid at 2^-2 (6 * 0.25): even keeps floor's exponent, ceil does not
    exps = {mode: int(quantize_mx(x, Dtype.fp4, 32, -1, mode)[1]) - 127 for mode in ("floor", "even", "ceil")}
    assert exps == {"floor": -2, "even": -2, "ceil": -1}


def test_amd_quark_mx_spelling_reads_as_mx_with_its_default_rule() -> None:
    spec = QTensorConfig(
        dtype="fp4",
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        scale_format="e8m0",
        is_dynamic=True,
        observer_cls="PerBlockMXObserver",
    )
    assert (spec.dtype, spec.mx_element_dtype, spec.mx_scale_mode) == (Dtype.mx, Dtype.fp4, "even")
    legacy = QuantizationSpec(dtype="mx", mx_element_dtype="fp4", ch_axis=-1, group_size=32, is_dynamic=True)
    assert legacy.mx_scale_mode == "floor"  # the documented dtype=mx spelling keeps OCP MX v1.0's rule
    assert OCP_MXFP4Spec(ch_axis=-1, scale_calculation_mode="floor").to_quantization_spec().mx_scale_mode == "floor"
    assert QuantizationSpec.from_dict(spec.to_dict()) == spec
    per_group_float = FP4PerGroupSpec(ch_axis=-1, group_size=32).to_quantization_spec()
    assert per_group_float.dtype == Dtype.fp4 and per_group_float.mx_scale_mode is None


def test_a_model_quantized_with_even_differs_from_floor_only_in_the_scales() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(64, 8)
    w = layer.weight.detach()
    outs = {}
    for mode in ("floor", "even"):
        spec = OCP_MXFP8E4M3Spec(ch_axis=-1, scale_calculation_mode=mode).to_quantization_spec()
        q = ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=spec))).quantize_model(
            nn.Sequential(nn.Linear(64, 8)), [torch.randn(1, 64)]
        )
        outs[mode] = q[0]._weight_quantizer(w)
        torch.testing.assert_close(outs[mode], _mx_ref(w, Dtype.fp8_e4m3, mode)[0], rtol=0, atol=0)


def test_bad_mx_scale_fields_name_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"scale_calculation_mode='nearest'.*\['floor', 'ceil', 'even'\]"):
        QuantizationSpec(dtype="mx", mx_element_dtype="fp4", scale_calculation_mode="nearest")
    with pytest.raises(ValueError, match=r"scale_format='e4m3'.*\['e8m0', 'float32'\]"):
        QuantizationSpec(
            dtype="fp4",
            qscheme="per_group",
            ch_axis=-1,
            group_size=16,
            scale_format="e4m3",
            observer_cls="PerGroupMinMaxObserver",
        )
    with pytest.raises(ValueError, match=r"scale_format='e8m0'.*needs dtype=mx"):
        QuantizationSpec(
            dtype="int8",
            qscheme="per_channel",
            ch_axis=0,
            symmetric=True,
            round_method="half_even",
            scale_type="float",
            observer_cls="PerChannelMinMaxObserver",
            scale_format="e8m0",
        )
    with pytest.raises(ValueError, match=r"scale_calculation_mode='even' applies to OCP MX scales only"):
        QuantizationSpec(
            dtype="int8",
            qscheme="per_tensor",
            symmetric=True,
            round_method="half_even",
            scale_type="float",
            observer_cls="PerTensorMinMaxObserver",
            scale_calculation_mode="even",
        )
    with pytest.raises(ValueError, match=r"OCP MX\) needs qscheme=per_group"):
        QuantizationSpec(
            dtype="fp4", qscheme="per_channel", ch_axis=0, scale_format="e8m0", observer_cls="PerChannelMinMaxObserver"
        )


def test_scaling_layers_take_quarks_help_key_as_a_comment() -> None:
    entry = {"prev_op": "ln", "layers": ["q", "k"], "inp": "q", "help": "q/k read the LayerNorm's output"}
    assert C.AWQConfig(scaling_layers=[entry]).scaling_layers == [entry]
    assert C.SmoothQuantConfig(scaling_layers=[entry]).scaling_layers == [entry]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['hint'\]"):
        C.AWQConfig(scaling_layers=[{**entry, "hint": "typo"}])
