"""Block formats (OCP MX v1.0, MX6 / MX9, BFP16) against float64 numpy references written from the specs."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from formats_reference import MX_EMAX, SPECS, assert_bitwise_equal, enumerate_codes, f32, floor_log2, round_to_table

from quark.torch.quantization.config.type import Dtype
from quark.torch.quantization.formats import (
    MX_ELEMENT_DTYPES,
    bfp_codes,
    bits_per_element,
    fake_quantize,
    fake_quantize_bfp16,
    fake_quantize_mx,
    fake_quantize_mx6,
    fake_quantize_mx9,
    microexponent_codes,
    mx_shared_exponent,
    quantize_mx,
    to_blocks,
)

# (x shape, axis, block size); ragged cases have an axis length that is not a multiple of the block
LAYOUTS = {
    "mx": [
        pytest.param((48, 96), -1, 32, id="2d-axis-1-b32"),
        pytest.param((96, 40), 0, 32, id="2d-axis0-b32"),
        pytest.param((4, 12, 48), -1, 16, id="3d-b16"),
        pytest.param((6, 64, 5), 1, 64, id="3d-axis1-b64"),
        pytest.param((50, 70), 1, 32, id="ragged-axis1"),
        pytest.param((45, 40), 0, 16, id="ragged-axis0"),
        pytest.param((60, 5), -1, 8, id="ragged-block-8"),
        pytest.param((60, 20), -1, 32, id="ragged-axis-shorter-than-block"),
    ],
    "micro": [
        pytest.param((40, 64), -1, 16, id="b16"),
        pytest.param((64, 30), 0, 16, id="axis0-b16"),
        pytest.param((3, 10, 32), -1, 32, id="3d-b32"),
        pytest.param((4, 24, 5), 1, 8, id="3d-axis1-b8"),
        pytest.param((50, 40), -1, 16, id="ragged-even"),
        pytest.param((50, 37), -1, 16, id="ragged-odd"),  # the last real element pairs with a zero pad
        pytest.param((21, 40), 0, 16, id="ragged-axis0"),
    ],
    "bfp": [
        pytest.param((60, 64), -1, 8, id="b8"),
        pytest.param((64, 30), 0, 8, id="axis0-b8"),
        pytest.param((5, 8, 48), -1, 16, id="3d-b16"),
        pytest.param((70, 37), 1, 8, id="ragged-axis1"),
        pytest.param((21, 30), 0, 8, id="ragged-axis0"),
    ],
}


# ---------------------------------------------------------------------------------------------------------------------
# layout plumbing of the references (plain numpy: pad the axis to whole blocks, blocks last)
# ---------------------------------------------------------------------------------------------------------------------


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _moved_shape(shape, axis):
    axis = axis % len(shape)
    return tuple(s for i, s in enumerate(shape) if i != axis) + (shape[axis],)


def _blocked(x: np.ndarray, axis: int, block: int) -> np.ndarray:
    """x (any layout) -> float64 [..., n_blocks, block], zero-padded."""
    moved = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    length = moved.shape[-1]
    nb = -(-length // block)
    padded = np.zeros((*moved.shape[:-1], nb * block))
    padded[..., :length] = moved
    return padded.reshape(*moved.shape[:-1], nb, block)


def _unblocked(xb: np.ndarray, shape, axis: int) -> np.ndarray:
    length = shape[axis]
    moved = xb.reshape(*xb.shape[:-2], -1)[..., :length]
    return np.moveaxis(moved, -1, axis)


def _make_blocks(shape, axis, block, rng, units_fn, exp_lo, exp_hi, tiny_exps=()):
    """Blocked inputs: each block is ``units * 2^e`` with its own e; a few all-zero blocks and a few blocks at
    special exponents (``tiny_exps``, huge ones). Returns x in ``shape`` as float32 numpy."""
    moved = _moved_shape(shape, axis)
    length = moved[-1]
    nb = -(-length // block)
    lead = moved[:-1]
    n = int(np.prod(lead)) * nb
    # the number of real elements of every block (the last one of a ragged axis is short)
    valid = np.full((int(np.prod(lead)), nb), block)
    valid[:, -1] = length - (nb - 1) * block
    units = units_fn(rng, n, block, valid.reshape(-1))
    exps = rng.integers(exp_lo, exp_hi + 1, n).astype(np.float64)
    kind = rng.random(n)
    exps[kind < 0.05] = rng.integers(90, 111, int((kind < 0.05).sum()))
    if tiny_exps:
        sel = (kind >= 0.05) & (kind < 0.12)
        exps[sel] = rng.choice(np.asarray(tiny_exps, dtype=np.float64), int(sel.sum()))
    units[(kind >= 0.12) & (kind < 0.14)] = 0.0
    # every input has an all-zero block, a huge block and (when asked) a block at each special exponent
    units[0] = 0.0
    exps[1] = 110
    exps[2 : 2 + len(tiny_exps)] = tiny_exps
    blocks = (units * np.exp2(exps)[:, None]).reshape(*lead, nb, block)
    return _unblocked(blocks, shape, axis).astype(np.float32)


def _place_anchor(rng, units, anchors, valid):
    """Put one anchor value per block at a random real position (it sets the block's exponent)."""
    pos = (rng.random(len(units)) * valid).astype(int)
    units[np.arange(len(units)), pos] = anchors
    return units


# ---------------------------------------------------------------------------------------------------------------------
# OCP MX
# ---------------------------------------------------------------------------------------------------------------------


def _element_values(element: str) -> np.ndarray:
    if element == "int8":
        return np.arange(-127, 128) / 64.0
    return enumerate_codes(element)[1]


def _mx_units(element: str):
    emax = MX_EMAX[element]
    values = _element_values(element)
    vmax = values.max()
    grid = np.unique(np.abs(values))
    mids = (grid[1:] + grid[:-1]) / 2
    top = grid[grid >= 2.0**emax]
    # anchors: magnitudes in [2^emax, 2^(emax+1)): grid values, midpoints there and beyond max (saturation)
    anchor_pool = np.concatenate(
        [
            top,
            mids[mids >= 2.0**emax],
            [vmax + (2.0 ** (emax + 1) - vmax) / 2],
            np.nextafter(2.0 ** (emax + 1), 0) * np.ones(1),
        ]
    )

    def fn(rng, n, block, valid):
        pick = rng.integers(0, 4, (n, block))
        sign = rng.choice([-1.0, 1.0], (n, block))
        u = (
            np.select(
                [pick == 0, pick == 1, pick == 2],
                [rng.choice(grid, (n, block)), rng.choice(mids, (n, block)), rng.uniform(0, vmax, (n, block))],
                np.exp2(rng.uniform(-12, emax, (n, block))),
            )
            * sign
        )
        anchors = rng.choice(anchor_pool, n) * rng.choice([-1.0, 1.0], n)
        anchors[::7] = rng.uniform(2.0**emax, 2.0 ** (emax + 1), len(anchors[::7]))  # random in the top binade
        return _place_anchor(rng, u, anchors, valid)

    return fn


def _round_mx_element(v: np.ndarray, element: str) -> np.ndarray:
    if element == "int8":  # MXINT8: k * 2^-6, |k| <= 127, half to even
        return np.clip(np.rint(v * 64.0), -127, 127) / 64.0
    return round_to_table(v, element)


def _ref_mx(x: np.ndarray, element: str, block: int, axis: int):
    """(output in x's layout, shared exponents [..., n_blocks] (nan for all-zero blocks), blocked elements)."""
    xb = _blocked(x, axis, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    exp = np.clip(floor_log2(amax) - MX_EMAX[element], -127, 127)  # OCP MX: floor(log2 max) - emax_elem, E8M0 range
    exp = np.where(amax > 0, exp, np.nan)
    safe = np.nan_to_num(exp, nan=0.0)
    elements = _round_mx_element(xb / np.exp2(safe), element)
    out = elements * np.exp2(safe)
    return _unblocked(out, x.shape, axis), exp[..., 0], elements


MX_ELEMENTS = ["fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4", "int8"]


def _mx_input(element, shape, axis, block, seed):
    rng = np.random.default_rng(seed)
    # -140..-120: blocks whose shared exponent clamps at -127 (float32 subnormals) or sits just above it
    tiny = list(range(-140, -118, 2))
    return _make_blocks(shape, axis, block, rng, _mx_units(element), -20, 20, tiny_exps=tiny)


def test_mx_element_dtypes_and_emax():
    assert [d.name for d in MX_ELEMENT_DTYPES] == MX_ELEMENTS
    for name in ("fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4"):
        # emax_elem = exponent of the largest normal
        assert MX_EMAX[name] == int(np.floor(np.log2(SPECS[name].max_normal)))


@pytest.mark.parametrize("shape,axis,block", LAYOUTS["mx"])
@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_fake_quantize_mx_matches_ocp_reference(element, shape, axis, block):
    x = _mx_input(element, shape, axis, block, seed=_seed(element, shape))
    ref, exps, _ = _ref_mx(x, element, block, axis)
    xt = torch.from_numpy(x).requires_grad_(True)
    if block == 32 and axis == -1:
        out = fake_quantize_mx(xt, element)  # the defaults: blocks of 32 along the last axis
    else:
        out = fake_quantize_mx(xt, Dtype(element), block, axis)
    assert_bitwise_equal(out.detach(), f32(ref))
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    (out * w).sum().backward()
    assert torch.equal(xt.grad, w)  # straight-through: identity
    assert_bitwise_equal(
        fake_quantize(torch.from_numpy(x), Dtype.mx, mx_element_dtype=Dtype(element), group_size=block, axis=axis),
        f32(ref),
    )
    # the inputs did reach the E8M0 clamp and the element saturation
    assert np.nanmin(exps) == -127


@pytest.mark.parametrize("shape,axis,block", LAYOUTS["mx"][::2])
@pytest.mark.parametrize("element", MX_ELEMENTS)
def test_quantize_mx_elements_and_e8m0(element, shape, axis, block):
    x = _mx_input(element, shape, axis, block, seed=_seed("q", element, shape))
    _, exps, ref_elements = _ref_mx(x, element, block, axis)
    elements, e8m0 = quantize_mx(torch.from_numpy(x), Dtype(element), block, axis)
    assert e8m0.dtype == torch.uint8 and e8m0.shape == exps.shape
    assert elements.shape == ref_elements.shape
    assert_bitwise_equal(elements, f32(ref_elements))
    nonzero = ~np.isnan(exps)
    assert np.array_equal(e8m0.numpy()[nonzero], (exps[nonzero] + 127).astype(np.uint8))
    assert (~nonzero).any()
    assert_bitwise_equal(elements[torch.from_numpy(~nonzero)], torch.zeros(int((~nonzero).sum()), block))
    # dequantization: elements * 2^(e8m0 - 127) is the fake-quantized tensor, in blocked layout
    deq = torch.ldexp(elements, e8m0.to(torch.int32)[..., None] - 127)
    fake, _ = to_blocks(fake_quantize_mx(torch.from_numpy(x), Dtype(element), block, axis), axis, block)
    assert_bitwise_equal(deq, fake)

    xb, _ = to_blocks(torch.from_numpy(x), axis, block)
    shared = mx_shared_exponent(xb, Dtype(element))
    assert shared.dtype == torch.int32 and shared.shape == (*exps.shape, 1)
    assert np.array_equal(shared[..., 0].numpy()[nonzero], exps[nonzero])


def test_mx_by_hand():
    # fp4 block max 6 * 2^3 = 48: exponent floor(log2 48) - 2 = 3; 20 / 8 = 2.5 -> tie -> 2 (even) -> 16
    x = torch.tensor([48.0, 20.0, 28.0, -3.0, 1.0] + [0.0] * 27)
    out = fake_quantize_mx(x, Dtype.fp4)
    assert out[:5].tolist() == [48.0, 16.0, 32.0, -4.0, 0.0]
    _, e8m0 = quantize_mx(x, Dtype.fp4)
    assert e8m0.tolist() == [130]
    # int8: max 1.5 -> exponent 0; elements k / 64, 127/64 at most
    x = torch.tensor([1.5, 1.0 / 128, 3.0 / 128, -1.0 / 128] + [0.0] * 28)
    assert fake_quantize_mx(x, Dtype.int8)[:4].tolist() == [1.5, 0.0, 2.0 / 64, -0.0]


@pytest.mark.parametrize(
    "element,bits",
    [("fp8_e4m3", 8.25), ("fp8_e5m2", 8.25), ("fp6_e3m2", 6.25), ("fp6_e2m3", 6.25), ("fp4", 4.25), ("int8", 8.25)],
)
def test_mx_bits_per_element(element, bits):
    assert bits_per_element(Dtype.mx, element) == bits
    assert bits_per_element(Dtype.mx, Dtype(element), block=16) == bits - 0.25 + 0.5


# ---------------------------------------------------------------------------------------------------------------------
# MX6 / MX9 (shared microexponents)
# ---------------------------------------------------------------------------------------------------------------------


def _ref_micro(x: np.ndarray, m: int, block: int, axis: int, e_min: float = -np.inf):
    """Blocks: E = floor(log2 max|x|); a pair both below 2^E shifts by 1; step 2^(E - shift - (m - 1));
    code = round-half-even(x / step) clamped to +-(2^m - 1). Returns (output, blocked codes, blocked step exponents)."""
    xb = _blocked(x, axis, block)
    a = np.abs(xb)
    amax = a.max(axis=-1, keepdims=True)
    e = np.maximum(np.where(amax > 0, floor_log2(amax), 0.0), e_min)
    below = a < np.exp2(e)
    pairs = below.reshape(*below.shape[:-1], block // 2, 2).all(axis=-1)
    shift = np.repeat(pairs, 2, axis=-1).astype(np.float64)
    step_exp = e - shift - (m - 1)
    limit = 2**m - 1
    codes = np.clip(np.rint(xb / np.exp2(step_exp)), -limit, limit)
    return _unblocked(codes * np.exp2(step_exp), x.shape, axis), codes, step_exp, amax[..., 0] > 0


def _micro_units(m: int):
    def fn(rng, n, block, valid):
        pick = rng.integers(0, 6, (n, block))
        sign = rng.choice([-1.0, 1.0], (n, block))
        k = rng.integers(0, 2**m, (n, block)).astype(np.float64)
        u = (
            np.select(
                [pick == 0, pick == 1, pick == 2, pick == 3, pick == 4],
                [
                    rng.uniform(0, 2, (n, block)),
                    (k + 0.5) * 2.0 ** -(m - 1),  # ties on the unshifted step (values up to 2)
                    ((k % 2 ** (m - 1)) + 0.5) * 2.0**-m,  # ties on the shifted step (below 1)
                    np.ones((n, block)),  # exactly 2^E: its pair does not shift
                    np.nextafter(np.ones((n, block)), 0),  # just below 2^E
                ],
                rng.uniform(0, 1, (n, block)),
            )
            * sign
        )
        top = 2.0 - 2.0**-m  # rounds to 2^m, clamped to 2^m - 1
        anchors = rng.choice([1.0, 1.5, top, 2.0 - 2.0 ** -(m + 2), (2**m - 1.5) * 2.0 ** -(m - 1)], n)
        anchors[::5] = rng.uniform(1, 2, len(anchors[::5]))
        return _place_anchor(rng, u, anchors * rng.choice([-1.0, 1.0], n), valid)

    return fn


MICRO = [
    pytest.param(4, fake_quantize_mx6, Dtype.mx6, id="mx6"),
    pytest.param(7, fake_quantize_mx9, Dtype.mx9, id="mx9"),
]


@pytest.mark.parametrize("shape,axis,block", LAYOUTS["micro"])
@pytest.mark.parametrize("m,fn,dtype", MICRO)
def test_microexponent_formats_match_reference(m, fn, dtype, shape, axis, block):
    rng = np.random.default_rng(_seed(m, shape, axis, block))
    # normal float32 blocks only, down to a max of 2^-126 (the smallest float32 normal)
    x = _make_blocks(shape, axis, block, rng, _micro_units(m), -30, 30, tiny_exps=(-126, -125, -123, -121, -119))
    ref, ref_codes, ref_step, nonzero = _ref_micro(x, m, block, axis)
    xt = torch.from_numpy(x).requires_grad_(True)
    out = fn(xt) if (block == 16 and axis == -1) else fn(xt, block, axis)
    assert_bitwise_equal(out.detach(), f32(ref))
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    (out * w).sum().backward()
    assert torch.equal(xt.grad, w)
    assert_bitwise_equal(fake_quantize(torch.from_numpy(x), dtype, group_size=block, axis=axis), f32(ref))

    xb, _ = to_blocks(torch.from_numpy(x), axis, block)
    codes, step_exp = microexponent_codes(xb, m)
    assert_bitwise_equal(codes, f32(ref_codes))
    nz = torch.from_numpy(nonzero)
    assert torch.equal(step_exp[nz].double(), torch.from_numpy(ref_step[nonzero]))
    # coverage of the inputs: clamped codes, shifted and unshifted pairs
    assert np.abs(ref_codes).max() == 2**m - 1
    assert (ref_step == np.floor(ref_step)).all() and len(np.unique(ref_step[nonzero] % 2)) == 2


def test_microexponent_by_hand():
    # E = 3 (max 12): pair (12, 1) unshifted, step 2^(3 - 3) = 1; pair (5, 3) both < 8: step 1/2
    x = torch.tensor([12.0, 1.0, 5.25, 3.0] + [0.0] * 12)
    assert fake_quantize_mx6(x)[:4].tolist() == [12.0, 1.0, 5.0, 3.0]  # 5.25 / 0.5 = 10.5 -> 10 (even)
    x = torch.tensor([15.9, 0.0] + [0.0] * 14)  # 15.9 -> 15.9 / 1 = 15.9 -> 16 -> clamp 15
    assert fake_quantize_mx6(x)[0].item() == 15.0


def test_microexponent_bits_per_element():
    assert bits_per_element(Dtype.mx6) == 6
    assert bits_per_element(Dtype.mx9) == 9
    assert Dtype.mx6.to_bitwidth() == 6 and Dtype.mx9.to_bitwidth() == 9


def test_microexponent_rejects_odd_block():
    with pytest.raises(ValueError):
        fake_quantize_mx6(torch.zeros(2, 15), 15)


# ---------------------------------------------------------------------------------------------------------------------
# BFP16
# ---------------------------------------------------------------------------------------------------------------------


def _ref_bfp(x: np.ndarray, block: int, axis: int, e_min: float = -np.inf):
    """step 2^(floor(log2 max) - 6); codes RNE; any code outside int8 doubles the step; codes clamped."""
    xb = _blocked(x, axis, block)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    step_exp = np.maximum(np.where(amax > 0, floor_log2(amax), 0.0), e_min) - 6
    codes = np.rint(xb / np.exp2(step_exp))
    overflow = ((codes > 127) | (codes < -128)).any(axis=-1, keepdims=True)
    step_exp = step_exp + overflow
    codes = np.clip(np.rint(xb / np.exp2(step_exp)), -128, 127)
    return _unblocked(codes * np.exp2(step_exp), x.shape, axis), codes, step_exp, amax > 0, overflow


def _bfp_units(rng, n, block, valid):
    pick = rng.integers(0, 3, (n, block))
    u = np.select(
        [pick == 0, pick == 1],
        [rng.integers(-128, 128, (n, block)) + 0.5, rng.integers(-128, 128, (n, block)).astype(np.float64)],
        rng.uniform(-128, 128, (n, block)),
    )
    # anchors in [64, 128) code units: 127.5 rounds to 128 (overflow: the step doubles), 127.49 does not,
    # -127.5 rounds to -128 (no overflow)
    anchors = rng.choice([127.5, 127.49, 127.75, -127.5, -127.75, 64.0, 100.5, 101.5, -64.0, 127.0], n)
    anchors[::4] = rng.uniform(64, 128, len(anchors[::4])) * rng.choice([-1, 1], len(anchors[::4]))
    return _place_anchor(rng, u / 64.0, anchors / 64.0, valid)  # units of 2^E


@pytest.mark.parametrize("shape,axis,block", LAYOUTS["bfp"])
def test_bfp16_matches_reference(shape, axis, block):
    rng = np.random.default_rng(_seed(shape, axis, block))
    x = _make_blocks(shape, axis, block, rng, _bfp_units, -30, 30, tiny_exps=(-126, -124, -121, -119))
    ref, ref_codes, ref_step, nonzero, overflow = _ref_bfp(x, block, axis)
    xt = torch.from_numpy(x).requires_grad_(True)
    out = fake_quantize_bfp16(xt) if (block == 8 and axis == -1) else fake_quantize_bfp16(xt, block, axis)
    assert_bitwise_equal(out.detach(), f32(ref))
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    (out * w).sum().backward()
    assert torch.equal(xt.grad, w)
    assert_bitwise_equal(fake_quantize(torch.from_numpy(x), Dtype.bfp16, group_size=block, axis=axis), f32(ref))

    xb, _ = to_blocks(torch.from_numpy(x), axis, block)
    codes, step_exp = bfp_codes(xb)
    assert_bitwise_equal(codes, f32(ref_codes))
    nz = torch.from_numpy(nonzero)
    assert torch.equal(step_exp[nz].double(), torch.from_numpy(ref_step[nonzero]))
    assert overflow[nonzero].any() and (~overflow[nonzero]).any()
    assert ref_codes.min() == -128 and ref_codes.max() == 127


@pytest.mark.parametrize("fmt", ["mx6", "mx9", "bfp16"])
def test_subnormal_blocks_clamp_the_8bit_shared_exponent(fmt):
    """Blocks of float32 subnormals (max < 2^-126): the 8-bit shared exponent E stops at -127 (the engine's
    convention, as E8M0); blocks just above (max in [2^-127, 2^-119)) need no clamp and lose nothing."""
    rng = np.random.default_rng(_seed(fmt))
    exps = np.concatenate([rng.integers(-149, -127, 60), rng.integers(-127, -119, 60)])
    mant = rng.uniform(1, 2, (120, 16)) * rng.choice([-1.0, 1.0], (120, 16))
    mant[:, 1:] *= np.exp2(-rng.integers(0, 12, (120, 15)))
    x = (mant * np.exp2(exps)[:, None]).astype(np.float32)  # float32 subnormals: rounded on input
    if fmt == "bfp16":
        ref = _ref_bfp(x, 16, -1, e_min=-127)[0]
        out = fake_quantize_bfp16(torch.from_numpy(x), 16)
    else:
        m = 4 if fmt == "mx6" else 7
        ref = _ref_micro(x, m, 16, -1, e_min=-127)[0]
        out = (fake_quantize_mx6 if fmt == "mx6" else fake_quantize_mx9)(torch.from_numpy(x))
    assert_bitwise_equal(out, f32(ref))
    assert torch.isfinite(out).all()


def test_bfp16_by_hand():
    # max 127.5 (step 1) rounds to 128: the step doubles to 2 and 127.5 / 2 = 63.75 -> 64 -> 128
    x = torch.tensor([127.5, 3.0, -5.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert fake_quantize_bfp16(x).tolist() == [128.0, 4.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    x = torch.tensor([-127.5, 3.5, 2.5, 1.0, 0.0, 0.0, 0.0, 0.0])  # -128 fits: step stays 1
    assert fake_quantize_bfp16(x).tolist() == [-128.0, 4.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert bits_per_element(Dtype.bfp16) == 9


@pytest.mark.parametrize(
    "fn", [fake_quantize_mx6, fake_quantize_mx9, fake_quantize_bfp16, lambda t: fake_quantize_mx(t, "fp4")]
)
def test_block_formats_keep_dtype_and_zero(fn):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = fn(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_bitwise_equal(out, fn(x.float()).to(torch.bfloat16))
    assert torch.equal(fn(torch.zeros(3, 64)), torch.zeros(3, 64))


@pytest.mark.parametrize("m,fn", [(4, fake_quantize_mx6), (7, fake_quantize_mx9)])
def test_microexponent_at_the_ends_of_float32_equals_ldexp_of_its_codes(m, fn):
    """Blocks of subnormals (steps down to 2^-134, whose inverse is no float32) and near float32's max: the fake
    quantized values are torch.ldexp(codes, step_exp), bit for bit (the kernel builds its powers of two from bits)."""
    g = torch.Generator().manual_seed(3)
    scales = torch.tensor([1e-45, 1e-42, 1e-39, 3e-38, 1.0, 1e30, 1.7e38]).repeat_interleave(64)
    x = (torch.rand(scales.numel(), generator=g) * 2 - 1) * scales
    x[::7] = 0.0
    codes, step_exp = microexponent_codes(x.reshape(-1, 16), m)
    assert_bitwise_equal(fn(x), torch.ldexp(codes, step_exp).reshape(-1))


def test_bfp16_block_with_minus_inf_doubles_its_step_as_the_rule_says():
    """-inf rounds below -128 steps: the step doubles, as for any code outside int8 (the finite elements see it)."""
    x = torch.tensor([-float("inf"), -3.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = fake_quantize_bfp16(x)
    assert out[1:3].tolist() == [-2.0, 0.5] and out[0].item() == -2.0


def test_block_formats_take_empty_tensors():
    for fn in (fake_quantize_mx6, fake_quantize_mx9, fake_quantize_bfp16):
        assert fn(torch.randn(0, 16)).shape == (0, 16)


@pytest.mark.parametrize("compiled", [False, True])
def test_block_absmax_is_each_blocks_largest_magnitude(compiled: bool, compiler: None) -> None:
    """What the MX / BFP observers record: max |x| per block along the axis, a ragged last block over what it has."""
    from quark.torch.quantization.formats import block_absmax
    from quark.torch.quantization.formats.grouping import Backend, set_compile

    torch.manual_seed(0)
    x = torch.randn(6, 70)
    x[2, 64:] = torch.tensor([-9.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # the ragged block's extreme is negative
    before = Backend.compile
    set_compile(compiled)
    try:
        along_rows = block_absmax(x, 32, -1)
        along_cols = block_absmax(x, 4, 0)
    finally:
        set_compile(before)
    expected = torch.stack([x[:, i : i + 32].abs().amax(dim=1) for i in range(0, 70, 32)], dim=-1)
    assert torch.equal(along_rows, expected) and along_rows[2, 2] == 9.0
    expected_cols = torch.stack([x[i : i + 4].abs().amax(dim=0) for i in range(0, 6, 4)], dim=-1)
    assert torch.equal(along_cols, expected_cols)
