"""The parameter table of every number format: one descriptor per Dtype, looked up by ``format_of``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quark.torch.quantization.config.type import Dtype, set_bitwidth_source


@dataclass(frozen=True)
class IntFormat:
    """Integers of ``bits`` width, two's complement when signed."""

    bits: int
    signed: bool

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1


@dataclass(frozen=True)
class FloatFormat:
    """A sign + ``ebits`` exponent + ``mbits`` mantissa minifloat with subnormals and saturation at ``max_normal``.

    ``bias`` is ``2^(ebits-1) - 1``; formats without infinities (e4m3fn, OCP fp6/fp4) use the top exponent for
    finite values, which is why ``max_normal`` is given rather than derived.
    """

    name: str
    ebits: int
    mbits: int
    max_normal: float

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (OCP MX's emax_elem)."""
        return math.floor(math.log2(self.max_normal))

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mbits)


@dataclass(frozen=True)
class CastFormat:
    """A plain cast to a torch float dtype (bfloat16, float16)."""

    torch_dtype: torch.dtype
    bits: int


@dataclass(frozen=True)
class BlockFormat:
    """Blocks of ``default_block`` elements sharing an 8-bit exponent.

    ``kind`` is ``"mx"`` (element format from ``mx_element_dtype``), ``"microexponent"`` (MX6/MX9: a 1-bit
    micro-exponent per pair, sign-magnitude mantissas of ``mantissa_bits``) or ``"bfp"`` (8-bit two's complement
    elements).
    """

    kind: str
    default_block: int
    mantissa_bits: int = 0


FP8_E4M3 = FloatFormat("fp8_e4m3", 4, 3, 448.0)
FP8_E5M2 = FloatFormat("fp8_e5m2", 5, 2, 57344.0)
FP6_E3M2 = FloatFormat("fp6_e3m2", 3, 2, 28.0)
FP6_E2M3 = FloatFormat("fp6_e2m3", 2, 3, 7.5)
FP4_E2M1 = FloatFormat("fp4", 2, 1, 6.0)

FLOAT_FORMATS: dict[Dtype, FloatFormat] = {
    Dtype.fp8_e4m3: FP8_E4M3,
    Dtype.fp8_e5m2: FP8_E5M2,
    Dtype.fp6_e3m2: FP6_E3M2,
    Dtype.fp6_e2m3: FP6_E2M3,
    Dtype.fp4: FP4_E2M1,
}

TORCH_FLOAT8: dict[Dtype, torch.dtype] = {Dtype.fp8_e4m3: torch.float8_e4m3fn, Dtype.fp8_e5m2: torch.float8_e5m2}

CAST_FORMATS: dict[Dtype, CastFormat] = {
    Dtype.bfloat16: CastFormat(torch.bfloat16, 16),
    Dtype.float16: CastFormat(torch.float16, 16),
}

BLOCK_FORMATS: dict[Dtype, BlockFormat] = {
    Dtype.mx: BlockFormat("mx", 32),
    Dtype.mx6: BlockFormat("microexponent", 16, mantissa_bits=4),
    Dtype.mx9: BlockFormat("microexponent", 16, mantissa_bits=7),
    Dtype.bfp16: BlockFormat("bfp", 8),
}

#: Element dtypes allowed for ``Dtype.mx`` (OCP MX v1.0).
MX_ELEMENT_DTYPES = (Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp4, Dtype.int8)

#: MXINT8 elements: symmetric int8 with an implicit scale of 2^-6 (emax 0).
MXINT8_QMAX = 127
MXINT8_IMPLICIT_EXP = -6


def format_of(dtype: Dtype | str) -> IntFormat | FloatFormat | CastFormat | BlockFormat:
    """The format descriptor of ``dtype``."""
    dtype = Dtype(dtype)
    if dtype.is_integer:
        signed = not dtype.name.startswith("u")
        return IntFormat(int(dtype.name.removeprefix("u").removeprefix("int")), signed)
    for table in (FLOAT_FORMATS, CAST_FORMATS, BLOCK_FORMATS):
        if dtype in table:
            return table[dtype]
    raise ValueError(f"dtype {dtype.name!r} has no format")  # unreachable while every Dtype has a table entry


def int_range(dtype: Dtype | str) -> tuple[int, int]:
    """``(qmin, qmax)`` of an integer dtype."""
    fmt = format_of(dtype)
    if not isinstance(fmt, IntFormat):
        raise ValueError(f"dtype {Dtype(dtype).name!r} is not an integer dtype")
    return fmt.qmin, fmt.qmax


def element_emax(element: Dtype) -> int:
    """OCP MX emax_elem of an MX element dtype (int8: 0)."""
    if element == Dtype.int8:
        return 0
    return FLOAT_FORMATS[element].emax


def bits_per_element(
    dtype: Dtype | str, mx_element_dtype: Dtype | str | None = None, block: int | None = None
) -> float:
    """Storage bits per element, the block formats' shared scales included (mx6: 6, mx9: 9, mxfp4/32: 4.25)."""
    dtype = Dtype(dtype)
    fmt = format_of(dtype)
    if isinstance(fmt, IntFormat | FloatFormat | CastFormat):
        return fmt.bits
    block = block or fmt.default_block
    if fmt.kind == "mx":
        element = Dtype(mx_element_dtype) if mx_element_dtype is not None else Dtype.fp8_e4m3
        element_bits = 8 if element == Dtype.int8 else FLOAT_FORMATS[element].bits
        return element_bits + 8 / block
    if fmt.kind == "microexponent":
        return 1 + fmt.mantissa_bits + 8 / block + 1 / 2
    return 8 + 8 / block


set_bitwidth_source(bits_per_element)
