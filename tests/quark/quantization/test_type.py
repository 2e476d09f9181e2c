"""The vocabulary of ``quark.torch.quantization.config.type``: every enum of Quark's docs, with Quark's values."""

from __future__ import annotations

import pytest

from quark.torch.quantization.config.type import (
    DeviceType,
    Dtype,
    QSchemeType,
    QuantizationMode,
    RoundType,
    ScaleType,
    TQTThresholdInitMeth,
    ZeroPointType,
)

INT_DTYPES = [f"int{b}" for b in range(2, 17)] + ["int32"]
UINT_DTYPES = [f"uint{b}" for b in range(2, 17)]
FLOAT_DTYPES = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4"]
BLOCK_DTYPES = ["mx", "mx6", "mx9", "bfp16"]


# ----------------------------------------------------------------------------------------------- members and values
def test_qscheme_members() -> None:
    assert {m.name: m.value for m in QSchemeType} == {
        "per_tensor": "per_tensor",
        "per_channel": "per_channel",
        "per_group": "per_group",
        "per_block": "per_block",
    }


def test_zero_point_type_members() -> None:
    assert {m.name: m.value for m in ZeroPointType} == {"int32": "int32", "float32": "float32"}


@pytest.mark.parametrize("name", INT_DTYPES + UINT_DTYPES + FLOAT_DTYPES + BLOCK_DTYPES)
def test_dtype_member_has_its_name_as_value(name: str) -> None:
    member = Dtype[name]
    assert member.name == name
    assert member.value == name
    assert Dtype(name) is member


def test_dtype_has_exactly_the_documented_members() -> None:
    expected = set(INT_DTYPES + UINT_DTYPES + FLOAT_DTYPES + BLOCK_DTYPES)
    assert {m.name for m in Dtype} == expected


def test_scale_type_members() -> None:
    assert {m.name: m.value for m in ScaleType} == {
        "float": "float",
        "pof2": "pof2",
        "float32": "float32",
        "float16": "float16",
        "bfloat16": "bfloat16",
        "float8_e8m0fnu": "float8_e8m0fnu",
    }


def test_round_type_values_are_quarks() -> None:
    assert RoundType.round.value == 2
    assert RoundType.floor.value == 3
    assert RoundType.half_even.value == 8
    assert len(RoundType) == 3
    assert RoundType(8) is RoundType.half_even
    assert RoundType(2) is RoundType.round
    assert RoundType(3) is RoundType.floor


def test_device_type_members() -> None:
    assert DeviceType.CPU.value == "cpu"
    assert DeviceType.IPU.value == "ipu"
    assert {m.name for m in DeviceType} == {"CPU", "IPU"}


def test_quantization_mode_members() -> None:
    assert {m.name for m in QuantizationMode} == {"eager_mode", "fx_graph_mode"}
    assert QuantizationMode.eager_mode != QuantizationMode.fx_graph_mode
    assert QuantizationMode("eager_mode") is QuantizationMode.eager_mode
    assert QuantizationMode("fx_graph_mode") is QuantizationMode.fx_graph_mode


def test_tqt_threshold_init_members_and_kl_j_alias() -> None:
    assert TQTThresholdInitMeth._3SD.value == "_3sd"
    assert TQTThresholdInitMeth._LL_J.value == "_ll_j"
    # Quark's own code spells it _KL_J: the same member, not a third one
    assert TQTThresholdInitMeth._KL_J is TQTThresholdInitMeth._LL_J
    assert len(list(TQTThresholdInitMeth)) == 2
    assert TQTThresholdInitMeth("_kl_j") is TQTThresholdInitMeth._LL_J
    assert TQTThresholdInitMeth("_KL_J") is TQTThresholdInitMeth._LL_J
    assert TQTThresholdInitMeth("_ll_j") is TQTThresholdInitMeth._LL_J
    assert TQTThresholdInitMeth("_3sd") is TQTThresholdInitMeth._3SD


# ----------------------------------------------------------------------------------------------- lenient lookup
@pytest.mark.parametrize(
    ("enum_cls", "text", "member"),
    [
        (Dtype, "INT8", Dtype.int8),
        (Dtype, "Int4", Dtype.int4),
        (Dtype, "UINT16", Dtype.uint16),
        (Dtype, "FP8_E4M3", Dtype.fp8_e4m3),
        (Dtype, "BFloat16", Dtype.bfloat16),
        (Dtype, "MX", Dtype.mx),
        (QSchemeType, "PER_CHANNEL", QSchemeType.per_channel),
        (QSchemeType, "Per_Group", QSchemeType.per_group),
        (ZeroPointType, "FLOAT32", ZeroPointType.float32),
        (ScaleType, "POF2", ScaleType.pof2),
        (ScaleType, "Float", ScaleType.float),
        (RoundType, "HALF_EVEN", RoundType.half_even),
        (RoundType, "half_even", RoundType.half_even),
        (RoundType, "Floor", RoundType.floor),
        (DeviceType, "cpu", DeviceType.CPU),
        (DeviceType, "CPU", DeviceType.CPU),
        (DeviceType, "Ipu", DeviceType.IPU),
        (QuantizationMode, "FX_GRAPH_MODE", QuantizationMode.fx_graph_mode),
        (TQTThresholdInitMeth, "_3sd", TQTThresholdInitMeth._3SD),
        (TQTThresholdInitMeth, "_LL_J", TQTThresholdInitMeth._LL_J),
    ],
)
def test_lookup_by_name_or_value_case_insensitive(enum_cls: type, text: str, member: object) -> None:
    assert enum_cls(text) is member


@pytest.mark.parametrize(
    ("enum_cls", "text"),
    [
        (Dtype, "int9x"),
        (Dtype, "int1"),
        (Dtype, "int64"),
        (Dtype, ""),
        (QSchemeType, "per_row"),
        (ZeroPointType, "int8"),
        (ScaleType, "pof3"),
        (RoundType, "nearest"),
        (RoundType, 5),
        (DeviceType, "gpu"),
        (QuantizationMode, "graph"),
        (TQTThresholdInitMeth, "_4sd"),
    ],
)
def test_bad_strings_raise_value_error(enum_cls: type, text: object) -> None:
    with pytest.raises(ValueError):
        enum_cls(text)


# ----------------------------------------------------------------------------------------------- Dtype helpers
def test_dtype_from_str_and_integer() -> None:
    assert Dtype.from_str("int8") is Dtype.int8
    assert Dtype.from_str("UINT4") is Dtype.uint4
    assert Dtype.integer(4) is Dtype.int4
    assert Dtype.integer(8, signed=False) is Dtype.uint8
    assert Dtype.integer(32) is Dtype.int32
    with pytest.raises(ValueError, match="17"):
        Dtype.integer(17)
    with pytest.raises(ValueError):
        Dtype.integer(32, signed=False)
    with pytest.raises(ValueError):
        Dtype.from_str("int9x")


@pytest.mark.parametrize("bits", range(2, 17))
def test_integer_dtypes_bitwidth(bits: int) -> None:
    assert Dtype[f"int{bits}"].is_integer
    assert Dtype[f"uint{bits}"].is_integer
    assert Dtype[f"int{bits}"].to_bitwidth() == bits
    assert Dtype[f"uint{bits}"].to_bitwidth() == bits


def test_non_integer_dtypes_are_not_integer() -> None:
    for name in FLOAT_DTYPES + BLOCK_DTYPES:
        assert not Dtype[name].is_integer, name
    assert Dtype.int32.is_integer


def test_scalar_float_bitwidths() -> None:
    assert Dtype.bfloat16.to_bitwidth() == 16
    assert Dtype.float16.to_bitwidth() == 16
    assert Dtype.fp8_e4m3.to_bitwidth() == 8
    assert Dtype.fp8_e5m2.to_bitwidth() == 8
    assert Dtype.fp6_e3m2.to_bitwidth() == 6
    assert Dtype.fp6_e2m3.to_bitwidth() == 6
    assert Dtype.fp4.to_bitwidth() == 4
    # MX6 / MX9 are named after their storage per element
    assert Dtype.mx6.to_bitwidth() == 6
    assert Dtype.mx9.to_bitwidth() == 9


def test_choices_lists_member_names() -> None:
    assert QSchemeType.choices() == ["per_tensor", "per_channel", "per_group", "per_block"]
    assert RoundType.choices() == ["round", "floor", "half_even"]
    assert "int8" in Dtype.choices() and "bfp16" in Dtype.choices()
