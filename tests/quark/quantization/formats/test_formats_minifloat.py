"""Minifloats (fp8 e4m3 / e5m2, fp6 e3m2 / e2m3, fp4 e2m1) against torch's float8 casts and value tables
enumerated bit pattern by bit pattern from the OCP definitions (formats_reference.enumerate_codes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats_reference import (
    SPECS,
    assert_bitwise_equal,
    enumerate_codes,
    f32,
    positive_grid,
    round_to_table,
)

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    decode,
    encode,
    fake_quantize,
    fake_quantize_minifloat,
    round_to_grid,
)

FP8 = {"fp8_e4m3": (Dtype.fp8_e4m3, torch.float8_e4m3fn), "fp8_e5m2": (Dtype.fp8_e5m2, torch.float8_e5m2)}
SMALL = {"fp6_e3m2": Dtype.fp6_e3m2, "fp6_e2m3": Dtype.fp6_e2m3, "fp4": Dtype.fp4}
ALL = {**{k: v[0] for k, v in FP8.items()}, **SMALL}


def _fmt(name: str):
    return FLOAT_FORMATS[ALL[name]]


# ---------------------------------------------------------------------------------------------------------------------
# the reference tables themselves
# ---------------------------------------------------------------------------------------------------------------------


def test_reference_tables_match_the_specs():
    assert positive_grid("fp4").tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert positive_grid("fp6_e2m3").tolist()[:9] == [i / 8 for i in range(9)]
    assert positive_grid("fp6_e3m2").tolist()[:5] == [0, 0.0625, 0.125, 0.1875, 0.25]
    for name, spec in SPECS.items():
        codes, values = enumerate_codes(name)
        assert values.max() == spec.max_normal == _fmt(name).max_normal
        assert values.min() == -spec.max_normal
    assert len(enumerate_codes("fp4")[0]) == 16
    assert len(enumerate_codes("fp6_e3m2")[0]) == len(enumerate_codes("fp6_e2m3")[0]) == 64
    assert len(enumerate_codes("fp8_e4m3")[0]) == 254  # 0x7f, 0xff are NaN
    assert len(enumerate_codes("fp8_e5m2")[0]) == 248  # exponent 31: inf and NaN


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_reference_table_matches_torch_decoding(name):
    codes, values = enumerate_codes(name)
    torch_values = torch.from_numpy(codes.astype(np.uint8)).view(FP8[name][1]).double().numpy()
    assert np.array_equal(torch_values, values)
    all_values = torch.arange(256, dtype=torch.uint8).view(FP8[name][1]).float()
    assert int(torch.isfinite(all_values).sum()) == len(codes)


def test_format_parameters():
    for name, spec in SPECS.items():
        fmt = _fmt(name)
        assert (fmt.ebits, fmt.mbits, fmt.bits) == (spec.ebits, spec.mbits, 1 + spec.ebits + spec.mbits)
        assert fmt.bias == 2 ** (spec.ebits - 1) - 1
        grid = positive_grid(name)
        assert fmt.min_subnormal == grid[1]
        assert 2.0**fmt.emin == grid[2**spec.mbits]  # smallest normal: exponent field 1, mantissa 0


# ---------------------------------------------------------------------------------------------------------------------
# fp8: round_to_grid == torch's float8 casts for every float32 in range
# ---------------------------------------------------------------------------------------------------------------------


def _midpoints(values: np.ndarray) -> np.ndarray:
    """Midpoints between adjacent distinct values (exact in float32: one more mantissa bit) and their neighbours."""
    v = np.unique(values)
    mid = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    return np.concatenate([mid, np.nextafter(mid, np.float32(-np.inf)), np.nextafter(mid, np.float32(np.inf))])


def _in_range_values(name: str, n: int, seed: int) -> np.ndarray:
    """float32 values with |v| <= max: random bit patterns (every binade, float32 subnormals too), log-uniform
    magnitudes, uniform subnormals of the format, both signs."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    bits = bits[np.isfinite(bits) & (np.abs(bits) <= spec.max_normal)]
    logu = np.exp2(rng.uniform(-30, np.log2(spec.max_normal), n // 2)).astype(np.float32)
    logu = np.minimum(logu, np.float32(spec.max_normal))
    smallest_normal = positive_grid(name)[2**spec.mbits]
    sub = rng.uniform(0, smallest_normal, 20000).astype(np.float32)
    tiny = np.array([1e-45, 1e-40, 1e-38, 2.0**-126, 0.0], dtype=np.float32)
    pos = np.concatenate([np.abs(bits), logu, sub, tiny])
    return np.concatenate([pos, -pos])


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_round_to_grid_on_codes_and_midpoints(name):
    torch_dtype = FP8[name][1]
    _, values = enumerate_codes(name)
    v = np.concatenate([values.astype(np.float32), _midpoints(values), np.float32([-0.0])])
    x = torch.from_numpy(v)
    out = round_to_grid(x, _fmt(name))
    assert_bitwise_equal(out, x.to(torch_dtype).float())
    assert_bitwise_equal(out, f32(round_to_table(v.astype(np.float64), name)))
    assert_bitwise_equal(round_to_grid(torch.from_numpy(values.astype(np.float32)), _fmt(name)), f32(values))


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_round_to_grid_random_in_range(name):
    v = _in_range_values(name, 1_000_000, seed=len(name))
    x = torch.from_numpy(v)
    out = round_to_grid(x, _fmt(name))
    assert_bitwise_equal(out, x.to(FP8[name][1]).float())
    assert_bitwise_equal(out, f32(round_to_table(v.astype(np.float64), name)))


@pytest.mark.parametrize("name", list(ALL))
def test_round_to_grid_saturates_beyond_max(name):
    spec = SPECS[name]
    grid = positive_grid(name)
    virtual_next = grid[-1] + (grid[-1] - grid[-2])  # the value after max if the format went on
    big = np.array(
        [
            np.nextafter(np.float32(spec.max_normal), np.float32(np.inf)),
            (grid[-1] + virtual_next) / 2,
            virtual_next,
            2 * spec.max_normal,
            1e10,
            3.4e38,
            np.inf,
        ],
        dtype=np.float32,
    )
    x = torch.from_numpy(np.concatenate([big, -big]))
    expected = torch.tensor([spec.max_normal] * len(big) + [-spec.max_normal] * len(big))
    assert_bitwise_equal(round_to_grid(x, _fmt(name)), expected)


# ---------------------------------------------------------------------------------------------------------------------
# fp6 / fp4: the enumerated table is the reference
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SMALL))
def test_small_minifloat_outputs_are_table_values_and_nearest(name):
    spec = SPECS[name]
    rng = np.random.default_rng(3)
    grid = positive_grid(name)
    v = np.concatenate(
        [
            rng.uniform(-1.3 * spec.max_normal, 1.3 * spec.max_normal, 200_000),
            np.exp2(rng.uniform(-12, np.log2(spec.max_normal), 50_000)) * rng.choice([-1, 1], 50_000),
            rng.uniform(-grid[2**spec.mbits], grid[2**spec.mbits], 20_000),  # subnormal range
        ]
    ).astype(np.float32)
    out = round_to_grid(torch.from_numpy(v), _fmt(name))
    _, values = enumerate_codes(name)
    assert np.isin(out.double().numpy(), values).all()
    assert_bitwise_equal(out, f32(round_to_table(v.astype(np.float64), name)))
    # nearest: no table value is strictly closer (saturated inputs excepted)
    inside = np.abs(v) <= spec.max_normal
    dist = np.abs(out.double().numpy() - v)[inside]
    best = np.min(np.abs(values[None, :] - v[inside][:5000, None]), axis=1)
    assert np.array_equal(dist[:5000], best)


@pytest.mark.parametrize("name", list(SMALL))
def test_small_minifloat_ties_go_to_even_mantissa(name):
    codes, values = enumerate_codes(name)
    spec = SPECS[name]
    n_bits = 1 + spec.ebits + spec.mbits
    pos_codes = codes[codes < 2 ** (n_bits - 1)]
    pos_vals = values[codes < 2 ** (n_bits - 1)]
    mids = (pos_vals[1:] + pos_vals[:-1]) / 2
    # the neighbour whose code has last (mantissa) bit 0
    even = np.where(pos_codes[1:] % 2 == 0, pos_vals[1:], pos_vals[:-1])
    mids_all = np.concatenate([mids, -mids])
    expected = np.concatenate([even, -even])
    out = round_to_grid(f32(mids_all), _fmt(name))
    assert_bitwise_equal(out, f32(expected))
    # just off the tie: the nearer neighbour
    up = np.nextafter(mids.astype(np.float32), np.float32(np.inf))
    down = np.nextafter(mids.astype(np.float32), np.float32(0))
    assert_bitwise_equal(round_to_grid(torch.from_numpy(up), _fmt(name)), f32(pos_vals[1:]))
    assert_bitwise_equal(round_to_grid(torch.from_numpy(down), _fmt(name)), f32(pos_vals[:-1]))


def test_fp4_ties_by_hand():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -2.5, -5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -2.0, -4.0])
    assert_bitwise_equal(round_to_grid(x, FLOAT_FORMATS[Dtype.fp4]), expected)


# ---------------------------------------------------------------------------------------------------------------------
# encode / decode against the enumerated codes (and torch's bit patterns for fp8)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALL))
def test_encode_decode_against_enumeration(name):
    codes, values = enumerate_codes(name)
    x = f32(values)
    enc = encode(x, _fmt(name))
    assert enc.dtype == torch.uint8
    assert torch.equal(enc, torch.from_numpy(codes.astype(np.uint8)))
    assert_bitwise_equal(decode(torch.from_numpy(codes.astype(np.uint8)), _fmt(name)), x)
    assert_bitwise_equal(decode(enc, _fmt(name)), x)  # -0.0 keeps its sign bit


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_encode_equals_torch_bits(name):
    torch_dtype = FP8[name][1]
    all_values = torch.arange(256, dtype=torch.uint8).view(torch_dtype).float()
    finite = all_values[torch.isfinite(all_values)]
    assert torch.equal(encode(finite, _fmt(name)), finite.to(torch_dtype).view(torch.uint8))
    assert_bitwise_equal(decode(encode(finite, _fmt(name)), _fmt(name)), finite)


# ---------------------------------------------------------------------------------------------------------------------
# scaled fake quantization (per tensor / channel / group), forward and straight-through backward
# ---------------------------------------------------------------------------------------------------------------------


def _scaled_reference(x: torch.Tensor, s_full: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(x / s) * s, gradient mask) with x / s in float32; fp8 rounding by torch's cast, others by the table."""
    spec = SPECS[name]
    v = x / s_full
    inside = v.abs() <= spec.max_normal
    if name in FP8:
        r = torch.where(
            inside, v.clamp(-spec.max_normal, spec.max_normal).to(FP8[name][1]).float(), torch.sign(v) * spec.max_normal
        )
    else:
        r = f32(round_to_table(v.double().numpy(), name))
    return r * s_full, inside


def _scaled_inputs(name: str, s_full: torch.Tensor, seed: int) -> torch.Tensor:
    """Per element: a table value, a midpoint, random in range or beyond max, all times the element's scale."""
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    _, values = enumerate_codes(name)
    mids = _midpoints(values)
    pick = rng.integers(0, 4, s_full.shape)
    units = np.select(
        [pick == 0, pick == 1, pick == 2],
        [
            rng.choice(values, s_full.shape),
            rng.choice(mids, s_full.shape),
            rng.uniform(-spec.max_normal, spec.max_normal, s_full.shape),
        ],
        rng.uniform(-3 * spec.max_normal, 3 * spec.max_normal, s_full.shape),
    )
    x = torch.from_numpy((units * s_full.double().numpy()).astype(np.float32))
    flat = x.view(-1)
    flat[:4] = torch.tensor([1.0, -1.0, 1.0, -1.0]) * spec.max_normal * s_full.reshape(-1)[:4]  # exactly at +-max
    return x


# fp8 through torch's cast and through the generic grid; fp6 / fp4 (no torch dtype) through the grid only
SCALED_CASES = [pytest.param(n, True, id=f"{n}-torch-cast") for n in FP8]
SCALED_CASES += [pytest.param(n, False, id=f"{n}-grid") for n in ALL]


@pytest.mark.parametrize("qscheme", ["tensor", "channel", "group", "group-ragged", "none"])
@pytest.mark.parametrize("name,via_torch_cast", SCALED_CASES)
def test_fake_quantize_minifloat_scaled(name, via_torch_cast, qscheme):
    rng = np.random.default_rng(17)
    scale_pool = np.array([2.0**-7, 0.0371, 1.0, 3.3, 2.0**5], dtype=np.float32)
    shape = (6, 40)
    kw: dict = {}
    if qscheme == "tensor":
        scale = torch.tensor(0.0371)
        s_full = scale.expand(shape)
    elif qscheme == "channel":
        scale = torch.from_numpy(rng.choice(scale_pool, 40))
        s_full = scale[None, :].expand(shape)
        kw = {"qscheme": QSchemeType.per_channel, "axis": 1}
    elif qscheme == "none":
        scale = None
        s_full = torch.ones(shape)
    else:
        g = 8 if qscheme == "group" else 16  # 40 = 2.5 groups of 16: ragged, zero-padded internally
        scale = torch.from_numpy(rng.choice(scale_pool, (6, -(-40 // g))))
        s_full = scale.repeat_interleave(g, dim=-1)[:, :40]
        kw = {"qscheme": QSchemeType.per_group, "axis": 1, "group_size": g}
    s_full = s_full.contiguous()
    x = _scaled_inputs(name, s_full, seed=len(name) + len(qscheme))
    ref, mask = _scaled_reference(x, s_full, name)
    torch_dtype = FP8[name][1] if via_torch_cast else None
    xr = x.clone().requires_grad_(True)
    out = fake_quantize_minifloat(xr, _fmt(name), scale, torch_dtype=torch_dtype, **kw)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    (out * w).sum().backward()
    assert_bitwise_equal(out.detach(), ref)
    assert torch.equal(xr.grad, w * mask)
    assert (~mask).any() and mask.any()
    if via_torch_cast and scale is not None:  # the dispatcher takes the torch-cast path for fp8
        assert_bitwise_equal(fake_quantize(x, ALL[name], scale, **kw), ref)
    if not via_torch_cast and name in SMALL and scale is not None:
        assert_bitwise_equal(fake_quantize(x, ALL[name], scale, **kw), ref)


def test_fake_quantize_minifloat_keeps_input_dtype():
    x = torch.randn(64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = fake_quantize_minifloat(
        x, FLOAT_FORMATS[Dtype.fp8_e4m3], torch.tensor(0.01), torch_dtype=TORCH_FLOAT8[Dtype.fp8_e4m3]
    )
    assert out.dtype == torch.bfloat16
    ref = ((x.float() / torch.tensor(0.01)).to(torch.float8_e4m3fn).float() * 0.01).to(torch.bfloat16)
    assert_bitwise_equal(out, ref)
