"""Independent float64 / numpy references for the number-format tests (no engine code is used here).

Minifloat grids are built by enumerating every bit pattern from the format definitions (OCP 8-bit FP
and OCP MX v1.0), and rounding is done by a nearest-neighbour search in that table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch


@dataclass(frozen=True)
class GridSpec:
    """A sign + ``ebits`` + ``mbits`` minifloat as written in its specification."""

    name: str
    ebits: int
    mbits: int
    specials: str  # "none" (OCP MX fp6/fp4), "e4m3fn" (only S.1111.111 is NaN), "ieee" (top exponent is inf/NaN)
    max_normal: float  # the documented maximum, checked against the enumeration


SPECS = {
    "fp8_e4m3": GridSpec("fp8_e4m3", 4, 3, "e4m3fn", 448.0),
    "fp8_e5m2": GridSpec("fp8_e5m2", 5, 2, "ieee", 57344.0),
    "fp6_e3m2": GridSpec("fp6_e3m2", 3, 2, "none", 28.0),
    "fp6_e2m3": GridSpec("fp6_e2m3", 2, 3, "none", 7.5),
    "fp4": GridSpec("fp4", 2, 1, "none", 6.0),
}

#: OCP MX v1.0 emax_elem (int8: 0, its elements are k * 2^-6 with |k| <= 127).
MX_EMAX = {"fp8_e4m3": 8, "fp8_e5m2": 15, "fp6_e3m2": 4, "fp6_e2m3": 2, "fp4": 2, "int8": 0}


@cache
def enumerate_codes(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes int64, values float64) of every finite bit pattern of the format, in code order."""
    spec = SPECS[name]
    bias = 2 ** (spec.ebits - 1) - 1
    n_bits = 1 + spec.ebits + spec.mbits
    codes, values = [], []
    for code in range(2**n_bits):
        sign = (code >> (spec.ebits + spec.mbits)) & 1
        exp_field = (code >> spec.mbits) & (2**spec.ebits - 1)
        mant = code & (2**spec.mbits - 1)
        top = exp_field == 2**spec.ebits - 1
        if spec.specials == "ieee" and top:
            continue  # inf / NaN
        if spec.specials == "e4m3fn" and top and mant == 2**spec.mbits - 1:
            continue  # NaN
        if exp_field == 0:
            magnitude = (mant / 2**spec.mbits) * 2.0 ** (1 - bias)
        else:
            magnitude = (1 + mant / 2**spec.mbits) * 2.0 ** (exp_field - bias)
        codes.append(code)
        values.append(-magnitude if sign else magnitude)
    return np.array(codes, dtype=np.int64), np.array(values, dtype=np.float64)


@cache
def positive_grid(name: str) -> np.ndarray:
    """Non-negative values indexed by their code (code k <-> value grid[k]); increasing."""
    codes, values = enumerate_codes(name)
    n_bits = 1 + SPECS[name].ebits + SPECS[name].mbits
    pos = values[codes < 2 ** (n_bits - 1)]
    assert np.all(np.diff(pos) > 0)
    return pos


def round_to_table(v: np.ndarray, name: str) -> np.ndarray:
    """Nearest grid value of float64 ``v``, ties to the even code (last mantissa bit 0), saturating at max."""
    grid = positive_grid(name)
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), grid[-1])
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = np.where(pick_hi, grid[hi], grid[lo])
    return np.copysign(out, v)


def round_half_even(v: np.ndarray) -> np.ndarray:
    """numpy's rint: round half to even (independent of torch)."""
    return np.rint(np.asarray(v, dtype=np.float64))


def floor_log2(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) in float64 for a > 0 (exact for float32 inputs: log2's error is far below their spacing)."""
    with np.errstate(divide="ignore"):
        return np.floor(np.log2(np.asarray(a, dtype=np.float64)))


def f32(a) -> torch.Tensor:
    """A float64 numpy array (whose values must be float32-exact) as a float32 torch tensor; checks exactness."""
    arr = np.asarray(a, dtype=np.float64)
    t = torch.from_numpy(arr.astype(np.float32))
    assert np.array_equal(t.double().numpy(), arr, equal_nan=True), "reference value not representable in float32"
    return t


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits (so -0.0 != 0.0 and NaN == NaN); reports the first mismatches."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    width = {
        torch.float32: torch.int32,
        torch.float64: torch.int64,
        torch.float16: torch.int16,
        torch.bfloat16: torch.int16,
    }
    if actual.dtype in width:
        a_bits, e_bits = actual.contiguous().view(width[actual.dtype]), expected.contiguous().view(width[actual.dtype])
    else:
        a_bits, e_bits = actual, expected
    bad = (a_bits != e_bits).nonzero()
    if len(bad):
        idx = tuple(bad[0].tolist())
        raise AssertionError(
            f"{len(bad)} mismatches; first at {idx}: got {actual[idx].item()!r}, expected {expected[idx].item()!r}"
        )
    assert torch.equal(actual, expected) or bool(torch.isnan(expected).any())
