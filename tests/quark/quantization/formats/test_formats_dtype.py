"""Integer dtypes of every width: Dtype.integer, format_of, int_range and bits against the documented ranges."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import Dtype
from quark.torch.quantization.formats import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    FLOAT_FORMATS,
    CastFormat,
    IntFormat,
    bits_per_element,
    format_of,
    int_range,
    is_scaled,
)

# documented ranges, written out by hand
DOCUMENTED = {
    "int2": (-2, 1),
    "int3": (-4, 3),
    "int4": (-8, 7),
    "int5": (-16, 15),
    "int6": (-32, 31),
    "int7": (-64, 63),
    "int8": (-128, 127),
    "int9": (-256, 255),
    "int10": (-512, 511),
    "int11": (-1024, 1023),
    "int12": (-2048, 2047),
    "int13": (-4096, 4095),
    "int14": (-8192, 8191),
    "int15": (-16384, 16383),
    "int16": (-32768, 32767),
    "int32": (-2147483648, 2147483647),
    "uint2": (0, 3),
    "uint3": (0, 7),
    "uint4": (0, 15),
    "uint5": (0, 31),
    "uint6": (0, 63),
    "uint7": (0, 127),
    "uint8": (0, 255),
    "uint9": (0, 511),
    "uint10": (0, 1023),
    "uint11": (0, 2047),
    "uint12": (0, 4095),
    "uint13": (0, 8191),
    "uint14": (0, 16383),
    "uint15": (0, 32767),
    "uint16": (0, 65535),
}


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("bits", range(2, 17))
def test_integer_dtype_of_every_width(bits, signed):
    dtype = Dtype.integer(bits, signed)
    name = f"{'' if signed else 'u'}int{bits}"
    assert dtype is Dtype[name] and dtype.is_integer
    fmt = format_of(dtype)
    assert isinstance(fmt, IntFormat)
    assert (fmt.bits, fmt.signed) == (bits, signed)
    assert (fmt.qmin, fmt.qmax) == int_range(dtype) == int_range(name) == DOCUMENTED[name]
    assert fmt.qmax - fmt.qmin + 1 == 2**bits  # every code of the width is used
    assert bits_per_element(dtype) == bits == dtype.to_bitwidth()
    assert is_scaled(dtype)


def test_default_signedness_and_int32():
    assert Dtype.integer(8) is Dtype.int8
    assert Dtype.integer(32) is Dtype.int32
    assert int_range(Dtype.int32) == DOCUMENTED["int32"]


@pytest.mark.parametrize(
    "dtype,torch_dtype",
    [(Dtype.int8, torch.int8), (Dtype.uint8, torch.uint8), (Dtype.int16, torch.int16), (Dtype.int32, torch.int32)],
)
def test_ranges_match_torch_iinfo(dtype, torch_dtype):
    info = torch.iinfo(torch_dtype)
    assert int_range(dtype) == (info.min, info.max)


@pytest.mark.parametrize(
    "bits,signed", [(1, True), (17, True), (0, True), (64, True), (1, False), (17, False), (32, False)]
)
def test_integer_rejects_missing_widths(bits, signed):
    with pytest.raises(ValueError):
        Dtype.integer(bits, signed)


def test_int_range_rejects_non_integers():
    for dtype in (Dtype.fp8_e4m3, Dtype.bfloat16, Dtype.mx):
        with pytest.raises(ValueError):
            int_range(dtype)


def test_every_dtype_has_a_format():
    for dtype in Dtype:
        fmt = format_of(dtype)
        if dtype.is_integer:
            assert isinstance(fmt, IntFormat)
        else:
            assert dtype in FLOAT_FORMATS or dtype in CAST_FORMATS or dtype in BLOCK_FORMATS
    assert format_of("FP4_E2M1") is FLOAT_FORMATS[Dtype.fp4]
    assert isinstance(format_of("bf16"), CastFormat) and format_of("bf16").torch_dtype == torch.bfloat16


def test_bits_of_the_other_formats():
    expected = {
        Dtype.fp8_e4m3: 8,
        Dtype.fp8_e5m2: 8,
        Dtype.fp6_e3m2: 6,
        Dtype.fp6_e2m3: 6,
        Dtype.fp4: 4,
        Dtype.bfloat16: 16,
        Dtype.float16: 16,
        Dtype.mx6: 6,
        Dtype.mx9: 9,
        Dtype.bfp16: 9,
    }
    for dtype, bits in expected.items():
        assert bits_per_element(dtype) == bits
    assert bits_per_element(Dtype.mx, Dtype.fp4) == 4.25
