"""float32 exponents and power-of-two scaling read from and written to IEEE-754 bits.

``torch.frexp`` and ``torch.ldexp`` are exact but compile to scalar loops (inductor's C++ backend has no vector form
for them), which de-vectorizes every kernel they are fused into. The forms here use int32 views, shifts and
multiplies only, give the same bits, and are what a compiled kernel traces; eager calls keep torch's ops, which are
one pass each there.
"""

from __future__ import annotations

import torch

_EXP_SHIFT = 23
_EXP_MASK = 0xFF
_BIAS = 127
_SIGN_AND_MANTISSA = -0x7F800001  # 0x807FFFFF as int32: every bit but the exponent field
_HALF_EXPONENT = 126 << _EXP_SHIFT  # the biased exponent field of [0.5, 1)
_SUBNORMAL_LIFT = 64  # subnormals are scaled by 2^64 (exact) to read their exponent


def biased_exponent(a: torch.Tensor) -> torch.Tensor:
    """The 8-bit biased exponent field of float32 ``a`` (int32): ``floor(log2 |a|) + 127`` for normal ``a``, 0 for
    zero and subnormals, 255 for inf and NaN."""
    return (a.view(torch.int32) >> _EXP_SHIFT) & _EXP_MASK


def frexp32(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.frexp`` of float32 ``a``: (mantissa in [0.5, 1) with a's sign, int32 exponent), ``a = m * 2^e``;
    (a, 0) for zero, inf and NaN, as torch gives. From the bits when traced by ``torch.compile``."""
    if not torch.compiler.is_compiling():
        return torch.frexp(a)
    sub = biased_exponent(a) == 0
    lifted = torch.where(sub, a * 2.0**_SUBNORMAL_LIFT, a)
    bits = lifted.view(torch.int32)
    exp = ((bits >> _EXP_SHIFT) & _EXP_MASK) - (_BIAS - 1) - torch.where(sub, _SUBNORMAL_LIFT, 0)
    mantissa = ((bits & _SIGN_AND_MANTISSA) | _HALF_EXPONENT).view(torch.float32)
    special = (a == 0) | ~torch.isfinite(a)
    return torch.where(special, a, mantissa), torch.where(special, 0, exp).to(torch.int32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """``2.0^k`` (float32) for int32 ``k`` in [-126, 127], written as exponent bits."""
    return ((k + _BIAS) << _EXP_SHIFT).view(torch.float32)


def ldexp32(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``torch.ldexp(x, k)`` for float32 ``x`` and int32 ``k`` in [-252, 254]: exact, one rounding (into the
    subnormals or to inf, as torch). From the bits when traced: one power-of-two factor for k in [-126, 127], two
    beyond (MX6's 2^-134 step needs 2^134), whose partial product is exact wherever the result is not 0."""
    if not torch.compiler.is_compiling():
        return torch.ldexp(x, k)
    half = k >> 1  # floor(k / 2)
    one_factor = (k >= -126) & (k <= 127)
    return torch.where(one_factor, x * pow2(k.clamp(-126, 127)), x * pow2(half) * pow2(k - half))
