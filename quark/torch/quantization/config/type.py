"""The vocabulary of the quantization config: every enum of Quark's ``quantization.config.type``.

Each enum accepts its member name or its value, case-insensitively (``Dtype("INT8")``, ``RoundType("half_even")``),
so YAML and JSON map onto it directly; anything else raises ValueError listing what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

#: the function ``Dtype.to_bitwidth`` asks: the format table (``quark.torch.quantization.formats.table``) installs it
#: when it is imported (``import quark.torch`` does), because the formats depend on these enums and never the reverse
_BITWIDTH_SOURCE: list[Callable[[Any], float]] = []


def set_bitwidth_source(bits_of: Callable[[Any], float]) -> None:
    """Install the function that gives a Dtype's storage bits per element (called once, by the format table)."""
    _BITWIDTH_SOURCE[:] = [bits_of]


class _LenientEnum(Enum):
    """Enum that also looks members up by name and by lower-cased value or name."""

    @classmethod
    def _missing_(cls, value: Any) -> Any:
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if key in (member.name.lower(), str(member.value).lower()):
                    return member
            for alias, target in cls._aliases().items():
                if key == alias:
                    return cls[target]
        return None

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {}

    @classmethod
    def choices(cls) -> list[str]:
        """The member names, as written in YAML."""
        return [m.name for m in cls]


class QSchemeType(_LenientEnum):
    """Granularity of the quantization parameters.

    ``per_block``: one scale per 2-D tile of ``QuantizationSpec.block_size = [rows, cols]`` of a 2-D weight
    (DeepSeek-V3-style block-wise fp8: [128, 128]); weights only.
    """

    per_tensor = "per_tensor"
    per_channel = "per_channel"
    per_group = "per_group"
    per_block = "per_block"


class ZeroPointType(_LenientEnum):
    """Storage of the zero point: rounded and clamped int32, or an unrounded float32."""

    int32 = "int32"
    float32 = "float32"


class Dtype(_LenientEnum):
    """The data types a tensor can be quantized to.

    Integers of every width from 2 to 16 bits, signed (``intN``, range ``[-2^(N-1), 2^(N-1)-1]``) and unsigned
    (``uintN``, range ``[0, 2^N-1]``), plus int32; bfloat16 and float16 casts; the minifloats fp8_e4m3 (as
    torch.float8_e4m3fn), fp8_e5m2, fp6_e3m2, fp6_e2m3 and fp4 (e2m1); the block formats mx (OCP MX with the element
    type of ``mx_element_dtype``), mx6, mx9 and bfp16.
    """

    int2 = "int2"
    int3 = "int3"
    int4 = "int4"
    int5 = "int5"
    int6 = "int6"
    int7 = "int7"
    int8 = "int8"
    int9 = "int9"
    int10 = "int10"
    int11 = "int11"
    int12 = "int12"
    int13 = "int13"
    int14 = "int14"
    int15 = "int15"
    int16 = "int16"
    int32 = "int32"
    uint2 = "uint2"
    uint3 = "uint3"
    uint4 = "uint4"
    uint5 = "uint5"
    uint6 = "uint6"
    uint7 = "uint7"
    uint8 = "uint8"
    uint9 = "uint9"
    uint10 = "uint10"
    uint11 = "uint11"
    uint12 = "uint12"
    uint13 = "uint13"
    uint14 = "uint14"
    uint15 = "uint15"
    uint16 = "uint16"
    bfloat16 = "bfloat16"
    float16 = "float16"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"
    fp6_e3m2 = "fp6_e3m2"
    fp6_e2m3 = "fp6_e2m3"
    fp4 = "fp4"
    mx = "mx"
    mx6 = "mx6"
    mx9 = "mx9"
    bfp16 = "bfp16"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {
            "fp4_e2m1": "fp4",
            "float8_e4m3fn": "fp8_e4m3",
            "float8_e5m2": "fp8_e5m2",
            "bf16": "bfloat16",
            "fp16": "float16",
        }

    @staticmethod
    def from_str(s: str) -> Dtype:
        """Quark's spelling of ``Dtype(s)``."""
        return Dtype(s)

    @staticmethod
    def integer(bits: int, signed: bool = True) -> Dtype:
        """The integer dtype of ``bits`` width: ``Dtype.integer(4) is Dtype.int4``; the knob of a bit-width sweep."""
        name = f"{'' if signed else 'u'}int{bits}"
        if name not in Dtype.__members__:
            allowed = "2..16 or 32 (signed), 2..16 (unsigned)"
            raise ValueError(
                f"No integer dtype of {bits} bits ({'signed' if signed else 'unsigned'}); allowed: {allowed}"
            )
        return Dtype[name]

    @property
    def is_integer(self) -> bool:
        return self.name.startswith(("int", "uint"))

    def to_bitwidth(self) -> int:
        """Bits per element of the format (block formats: element bits plus their share of the block's scales)."""
        if not _BITWIDTH_SOURCE:
            raise RuntimeError("Dtype.to_bitwidth needs the format table: import quark.torch (or its formats) first")
        return _BITWIDTH_SOURCE[0](self)


class ScaleType(_LenientEnum):
    """How a scale is held: in the model's float dtype, as a power of two, or in a fixed float precision.

    ``pof2`` rounds the scale to the nearest power of two in the log domain (``2^round(log2 s)``, Quark's rule);
    ``float8_e8m0fnu`` (UE8M0, as DeepSeek-V3 / DeepGEMM store block scales) rounds it up to the next power of two
    (``2^ceil(log2 s)``, so no value that fitted before clips), clamped to E8M0's range [2^-127, 2^127]; such a scale
    is exactly representable as ``torch.float8_e8m0fnu``. ``float16`` / ``bfloat16`` (and ``float`` for a model in
    those dtypes) saturate: a scale past the type's largest finite value is held as that value (with a warning),
    never as inf.
    """

    float = "float"
    pof2 = "pof2"
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    float8_e8m0fnu = "float8_e8m0fnu"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"ue8m0": "float8_e8m0fnu", "e8m0fnu": "float8_e8m0fnu"}

    def to_torch_dtype(self) -> Any:
        """The torch dtype a scale of this type is stored in (amd-quark's method); ``float`` and ``pof2`` have none."""
        import torch

        dtypes = {
            "float32": "float32",
            "float16": "float16",
            "bfloat16": "bfloat16",
            "float8_e8m0fnu": "float8_e8m0fnu",
        }
        if self.name not in dtypes:
            raise ValueError(
                f"ScaleType.{self.name} is held in the model's float dtype, not one torch dtype; "
                f"to_torch_dtype() serves {list(dtypes)}"
            )
        if not hasattr(torch, dtypes[self.name]):
            raise RuntimeError(f"ScaleType.{self.name} needs a torch build with torch.{dtypes[self.name]}")
        return getattr(torch, dtypes[self.name])


class RoundType(_LenientEnum):
    """Rounding of ``x / scale`` to the integer grid (values as in Quark's kernels)."""

    round = 2  # half away from zero
    floor = 3
    half_even = 8


class DeviceType(_LenientEnum):
    """The target device of the quantized model."""

    CPU = "cpu"
    IPU = "ipu"


class QuantizationMode(_LenientEnum):
    """Eager module swapping or torch.fx graph mode."""

    eager_mode = 1
    fx_graph_mode = 2


class TQTThresholdInitMeth(_LenientEnum):
    """Threshold initialisation of TQT (Jain et al. 2019, table 2).

    - ``_3SD``: ``t = |mean(x)| + 3 * std(x)``.
    - ``_LL_J``: the threshold minimising the Jeffreys divergence between the ``|x|`` histogram and its requantised copy
      (Settle et al. 2018, algorithm 1). ``_KL_J`` (Quark's own spelling) is the same member.
    """

    _3SD = "_3sd"
    _LL_J = "_ll_j"
    _KL_J = "_ll_j"  # alias: TQTThresholdInitMeth._KL_J is TQTThresholdInitMeth._LL_J

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"_kl_j": "_LL_J", "kl_j": "_LL_J", "ll_j": "_LL_J", "3sd": "_3SD"}
