"""Integer fake quantization against torch's fused kernels and float64 / ``decimal`` references.

References used here: ``torch.fake_quantize_per_{tensor,channel}_affine`` (forward and autograd backward) for
half-even rounding, Python ``decimal`` for half-away-from-zero and floor, numpy for codes and scale types.
"""

from __future__ import annotations

import decimal
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from formats_reference import assert_bitwise_equal

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.formats import (
    apply_scale_type,
    dequantize_int,
    fake_quantize,
    fake_quantize_int,
    int_range,
    quantize_int,
    round_to_int,
)

SIGNED = [Dtype.integer(b, True) for b in range(2, 17)]
UNSIGNED = [Dtype.integer(b, False) for b in range(2, 9)]
INT_DTYPES = SIGNED + UNSIGNED


def _zero_points(dtype: Dtype) -> list[int]:
    qmin, qmax = int_range(dtype)
    if qmin < 0:
        return [0, qmax // 2 + 1, qmin // 2]
    return [0, (qmax + 1) // 4 + 1, qmax]


INT_CASES = [pytest.param(d, z, id=f"{d.name}-zp{z}") for d in INT_DTYPES for z in _zero_points(d)]


def _bound_values(qmin: int, qmax: int, zp: int) -> np.ndarray:
    """x / scale at, just inside and beyond both clamp bounds (ties included), and far outliers."""
    lo, hi = qmin - zp, qmax - zp  # x / scale at the clamp bounds
    near = np.array([-7, -2, -1.5, -1, -0.5, -0.49, -0.25, 0, 0.25, 0.49, 0.5, 0.51, 1, 1.5, 2, 7, 100.5])
    far = np.array([0.0, -0.0, 1e6, -1e6, 3.0 * (hi - lo + 1), -3.0 * (hi - lo + 1)])
    return np.concatenate([lo + near, hi + near, far])


def _pool(qmin: int, qmax: int, zp: int, rng: np.random.Generator, n_random: int = 2000) -> np.ndarray:
    """Values of x / scale (float64) that stress rounding and clamping: exact ties k + 0.5 over the whole range,
    integers, the bound values and random values."""
    ks = np.arange(qmin - zp - 3, qmax - zp + 4, dtype=np.float64)
    return np.concatenate(
        [ks + 0.5, ks, _bound_values(qmin, qmax, zp), rng.uniform(qmin - zp - 4, qmax - zp + 4, n_random)]
    )


def _sample(qmin: int, qmax: int, zp: int, rng: np.random.Generator, n: int) -> np.ndarray:
    """The bound values plus ``n`` values drawn from the pool (for wide integers whose pool is large)."""
    pool = _pool(qmin, qmax, zp, rng, n_random=n // 4)
    return np.concatenate([_bound_values(qmin, qmax, zp), rng.choice(pool, n, replace=len(pool) < n)])


def _grad_weights(shape, seed: int = 7) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _forward_backward(fn, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.detach().clone().requires_grad_(True)
    out = fn(xr)
    (out * w).sum().backward()
    return out.detach(), xr.grad


# ---------------------------------------------------------------------------------------------------------------------
# half-even: bit for bit equal to torch's fake-quant kernels, forward and backward
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_torch_kernel", [True, False], ids=["kernel", "pure"])
@pytest.mark.parametrize("dtype,zp", INT_CASES)
def test_per_tensor_matches_torch(dtype, zp, use_torch_kernel):
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(zlib.crc32(f"{dtype.name}{zp}".encode()))
    units = _pool(qmin, qmax, zp, rng)
    for scale in (2.0**-5, 0.0371, 3.0):  # exact ties (power of two) and inexact 1 / scale
        x = torch.from_numpy((units * scale).astype(np.float32))
        w = _grad_weights(x.shape)
        s = torch.tensor(scale, dtype=torch.float32)
        z = torch.tensor(zp, dtype=torch.int32)

        def ref(t, s=s):
            return torch.fake_quantize_per_tensor_affine(t, float(s), zp, qmin, qmax)

        def eng(t, s=s, z=z):
            return fake_quantize_int(
                t, s, z, qmin, qmax, round_method=RoundType.half_even, use_torch_kernel=use_torch_kernel
            )

        out, grad = _forward_backward(eng, x, w)
        ref_out, ref_grad = _forward_backward(ref, x, w)
        assert_bitwise_equal(out, ref_out)
        assert_bitwise_equal(grad, ref_grad)
        # sanity of the inputs: the clamp and the ties really are exercised
        assert (ref_grad == 0).any() and (ref_grad != 0).any()


def _channel_tensor(dtype: Dtype, axis: int, rng: np.random.Generator, int64_zp: bool = False):
    """x with 4 channels along ``axis``, each channel its own scale / zero point and its own stress pool."""
    qmin, qmax = int_range(dtype)
    scales = np.array([2.0**-4, 0.0371, 8.0, 0.7], dtype=np.float32)
    zps = np.array([0, qmin, qmax, int(rng.integers(qmin, qmax + 1))], dtype=np.int64)
    rows = []
    for s, z in zip(scales, zps, strict=True):
        t = _sample(qmin, qmax, int(z), rng, 1500 - len(_bound_values(0, 0, 0)))
        rows.append(t * float(s))
    x = torch.from_numpy(np.stack(rows).reshape(4, 30, 50).astype(np.float32)).movedim(0, axis).contiguous()
    return x, torch.from_numpy(scales), torch.from_numpy(zps).to(torch.int64 if int64_zp else torch.int32)


@pytest.mark.parametrize("use_torch_kernel", [True, False], ids=["kernel", "pure"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: d.name)
def test_per_channel_matches_torch(dtype, axis, use_torch_kernel):
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(1000 + INT_DTYPES.index(dtype) * 7 + axis)
    x, s, z = _channel_tensor(dtype, axis, rng, int64_zp=axis == 1)
    w = _grad_weights(x.shape)

    def ref(t):
        return torch.fake_quantize_per_channel_affine(t, s, z.to(torch.int32), axis % 3, qmin, qmax)

    def eng(t):
        return fake_quantize_int(
            t, s, z, qmin, qmax, qscheme=QSchemeType.per_channel, axis=axis, use_torch_kernel=use_torch_kernel
        )

    out, grad = _forward_backward(eng, x, w)
    ref_out, ref_grad = _forward_backward(ref, x, w)
    assert_bitwise_equal(out, ref_out)
    assert_bitwise_equal(grad, ref_grad)


# (x shape, axis, group size): axis length divisible or not (ragged last group)
GROUP_CASES = [
    pytest.param((6, 64), 1, 16, id="2d-axis1"),
    pytest.param((64, 5), 0, 8, id="2d-axis0"),
    pytest.param((3, 4, 32), -1, 32, id="3d-axis-1-one-group"),
    pytest.param((3, 24, 4), 1, 8, id="3d-axis1"),
    pytest.param((6, 37), 1, 8, id="ragged-axis1"),
    pytest.param((13, 4), 0, 4, id="ragged-axis0"),
    pytest.param((2, 3, 50), 2, 16, id="ragged-3d"),
    pytest.param((5, 7), 1, 16, id="ragged-group-larger-than-axis"),
]


def _group_tensor(dtype: Dtype, shape, axis: int, g: int, rng: np.random.Generator):
    """x with per-group scale / zero point in the engine's layout [..., n_groups] (of x.movedim(axis, -1))."""
    qmin, qmax = int_range(dtype)
    moved_shape = list(torch.empty(shape).movedim(axis, -1).shape)
    length = moved_shape[-1]
    n_groups = -(-length // g)
    qshape = (*moved_shape[:-1], n_groups)
    scale_pool = np.array([2.0**-6, 2.0**-1, 0.0371, 0.7, 4.0, 1.3e-3], dtype=np.float32)
    scales = rng.choice(scale_pool, qshape)
    zps = rng.integers(qmin, qmax + 1, qshape)
    zps.reshape(-1)[:2] = [qmin, qmax]
    t = np.empty((*qshape, g))
    for idx in np.ndindex(*qshape):
        pool = _pool(qmin, qmax, int(zps[idx]), rng, n_random=50)
        t[idx] = rng.choice(pool, g)
    moved = (t * scales[..., None].astype(np.float64)).reshape(*qshape[:-1], n_groups * g)[..., :length]
    x = torch.from_numpy(moved.astype(np.float32)).movedim(-1, axis).contiguous()
    assert tuple(x.shape) == tuple(shape)
    return x, torch.from_numpy(scales), torch.from_numpy(zps.astype(np.int32))


def _ref_group_elementwise(x, scale, zp, axis, g, qmin, qmax):
    """Every element its own channel: expand the group qparams to x's layout, one per-channel call on x.flatten()."""
    length = x.shape[axis]
    s_full = scale.repeat_interleave(g, dim=-1)[..., :length].movedim(-1, axis).contiguous()
    z_full = zp.repeat_interleave(g, dim=-1)[..., :length].movedim(-1, axis).contiguous()
    out = torch.fake_quantize_per_channel_affine(x.reshape(-1), s_full.reshape(-1), z_full.reshape(-1), 0, qmin, qmax)
    return out.reshape(x.shape)


def _ref_group_padded_rows(x, scale, zp, axis, g, qmin, qmax):
    """Zero-pad the axis to whole groups, one row per group through the per-channel kernel, then crop."""
    moved = x.movedim(axis, -1)
    length = moved.shape[-1]
    n_groups = -(-length // g)
    padded = F.pad(moved, (0, n_groups * g - length))
    rows = padded.reshape(-1, g)
    out = torch.fake_quantize_per_channel_affine(rows, scale.reshape(-1), zp.reshape(-1), 0, qmin, qmax)
    return out.reshape(padded.shape)[..., :length].movedim(-1, axis)


GROUP_DTYPES = [
    Dtype.int2,
    Dtype.int3,
    Dtype.int4,
    Dtype.int8,
    Dtype.int12,
    Dtype.int16,
    Dtype.uint2,
    Dtype.uint4,
    Dtype.uint8,
]


@pytest.mark.parametrize("use_torch_kernel", [True, False], ids=["kernel", "pure"])
@pytest.mark.parametrize("shape,axis,g", GROUP_CASES)
@pytest.mark.parametrize("dtype", GROUP_DTYPES, ids=lambda d: d.name)
def test_per_group_matches_torch(dtype, shape, axis, g, use_torch_kernel):
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(sum(shape) * 31 + g + GROUP_DTYPES.index(dtype))
    x, s, z = _group_tensor(dtype, shape, axis, g, rng)
    w = _grad_weights(x.shape)

    def eng(t):
        return fake_quantize_int(
            t,
            s,
            z,
            qmin,
            qmax,
            qscheme=QSchemeType.per_group,
            axis=axis,
            group_size=g,
            use_torch_kernel=use_torch_kernel,
        )

    out, grad = _forward_backward(eng, x, w)
    for ref in (_ref_group_elementwise, _ref_group_padded_rows):
        ref_out, ref_grad = _forward_backward(lambda t, ref=ref: ref(t, s, z, axis, g, qmin, qmax), x, w)
        assert_bitwise_equal(out, ref_out)
        assert_bitwise_equal(grad, ref_grad)


@pytest.mark.parametrize("qscheme", [QSchemeType.per_tensor, QSchemeType.per_channel])
def test_float_zero_point_matches_torch(qscheme):
    """A float (unrounded) zero point: round(x / s + zp), as torch's per-channel kernel with float zero points.

    Random inputs only, compared with torch.equal: torch's float-zero-point kernel fuses x * inv_scale + zp (one
    rounding), the engine rounds the product first, so the two may differ within one ulp of a .5 tie, and torch's
    ``(q - zp) * s`` gives +0.0 where the engine may give -0.0.
    """
    qmin, qmax = int_range(Dtype.uint8)
    rng = np.random.default_rng(5)
    zps = np.array([0.0, 17.25, 127.5, 200.75], dtype=np.float32)
    scales = np.array([2.0**-4, 0.0371, 0.5, 0.7], dtype=np.float32)
    if qscheme == QSchemeType.per_tensor:
        zps, scales = zps[1:2], scales[1:2]
    t = np.stack([rng.uniform(qmin - z - 6, qmax - z + 6, 3000) for z in zps])
    x = torch.from_numpy((t * scales[:, None].astype(np.float64)).astype(np.float32))
    s, z = torch.from_numpy(scales), torch.from_numpy(zps)
    w = _grad_weights(x.shape)

    def ref(v):
        return torch.fake_quantize_per_channel_affine(v, s, z, 0, qmin, qmax)

    def eng(v):
        if qscheme == QSchemeType.per_tensor:
            return fake_quantize_int(v, s[0], z[0], qmin, qmax)
        return fake_quantize_int(v, s, z, qmin, qmax, qscheme=qscheme, axis=0)

    out, grad = _forward_backward(eng, x, w)
    ref_out, ref_grad = _forward_backward(ref, x, w)
    assert torch.equal(out, ref_out)
    assert torch.equal(grad, ref_grad)
    assert (ref_grad == 0).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_input_dtypes_round_trip_through_float32(dtype):
    qmin, qmax = int_range(Dtype.int8)
    x = (torch.randn(257, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    s, z = torch.tensor(0.03125), torch.tensor(-3, dtype=torch.int32)
    out = fake_quantize_int(x, s, z, qmin, qmax)
    ref = torch.fake_quantize_per_tensor_affine(x.float(), 0.03125, -3, qmin, qmax).to(dtype)
    assert_bitwise_equal(out, ref)


def test_dispatch_fake_quantize_int():
    qmin, qmax = int_range(Dtype.uint4)
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(4))
    s = torch.tensor([0.1, 0.2, 0.05, 0.3])
    z = torch.tensor([0, 3, 8, 15], dtype=torch.int32)
    out = fake_quantize(x, Dtype.uint4, s, z, qscheme=QSchemeType.per_channel, axis=0)
    assert_bitwise_equal(out, torch.fake_quantize_per_channel_affine(x, s, z, 0, qmin, qmax))


# ---------------------------------------------------------------------------------------------------------------------
# half away from zero and floor against Python's decimal on the same float32 v = x * (1 / scale)
# ---------------------------------------------------------------------------------------------------------------------

_DECIMAL_MODE = {RoundType.round: decimal.ROUND_HALF_UP, RoundType.floor: decimal.ROUND_FLOOR}


def _decimal_round(v: np.ndarray, method: RoundType) -> np.ndarray:
    """ROUND_HALF_UP is half away from zero in decimal; exact on the float32 values (Decimal(float) is exact)."""
    mode = _DECIMAL_MODE[method]
    return np.array([float(decimal.Decimal(float(e)).to_integral_value(rounding=mode)) for e in v.ravel()]).reshape(
        v.shape
    )


def _tricky_units(rng: np.random.Generator, kmax: int) -> np.ndarray:
    """Exact ties k + 0.5, their float32 neighbours (0.49999997-style) and random values, both signs."""
    ks = np.concatenate([np.arange(0, 300), rng.integers(0, kmax, 300), [kmax - 1, 2**22 - 1, 2**22 + 3]]).astype(
        np.float64
    )
    ties = (ks + 0.5).astype(np.float32)
    below = np.nextafter(ties, np.float32(0))
    above = np.nextafter(ties, np.float32(np.inf))
    special = np.array([0.49999997, 0.5, 0.50000006, 1.4999999, 2.5, 0.0, 1.0, 1e-30], dtype=np.float32)
    rand = rng.uniform(0, kmax, 1000).astype(np.float32)
    pos = np.concatenate([ties, below, above, special, rand, ks.astype(np.float32)])
    return np.concatenate([pos, -pos])


def test_decimal_reference_itself():
    """The reference (not the engine) on hand-checked values, so that the comparison below means something."""
    v = np.array([0.49999997, 0.5, -0.5, 1.5, 2.5, -2.5, -0.49999997, 2.4999998, -3.7], dtype=np.float32)
    assert _decimal_round(v, RoundType.round).tolist() == [0, 1, -1, 2, 3, -3, 0, 2, -4]
    assert _decimal_round(v, RoundType.floor).tolist() == [0, 0, -1, 1, 2, -3, -1, 2, -4]


@pytest.mark.parametrize("method", [RoundType.round, RoundType.floor])
def test_round_to_int_against_decimal(method):
    v = _tricky_units(np.random.default_rng(11), 2**23)
    out = round_to_int(torch.from_numpy(v), method)
    ref = _decimal_round(v, method).astype(np.float32)
    assert torch.equal(out, torch.from_numpy(ref))


def test_round_to_int_half_even_against_numpy():
    v = _tricky_units(np.random.default_rng(12), 2**23)
    assert torch.equal(round_to_int(torch.from_numpy(v), RoundType.half_even), torch.from_numpy(np.rint(v)))


def _numpy_fake_quant(x32, s32, zp, qmin, qmax, method):
    """float32 v = x * (1 / s) like torch, rounding by decimal / numpy, q clamped, (q - zp) * s in float32."""
    inv = (np.float32(1.0) / s32).astype(np.float32)
    v = (x32 * inv).astype(np.float32)
    r = np.rint(v.astype(np.float64)) if method == RoundType.half_even else _decimal_round(v, method)
    if method == RoundType.floor:  # the largest code whose float32 dequantized value is at most x
        r = r + ((r + 1).astype(np.float32) * s32 <= x32)
    q = r + np.asarray(zp, dtype=np.float64)
    mask = (q >= qmin) & (q <= qmax)
    out = (np.clip(q, qmin, qmax) - zp).astype(np.float32) * s32
    return out.astype(np.float32), mask, np.clip(q, qmin, qmax)


@pytest.mark.parametrize("use_torch_kernel", [True, False], ids=["kernel", "pure"])
@pytest.mark.parametrize("method", [RoundType.round, RoundType.floor])
@pytest.mark.parametrize(
    "dtype,zp,scale",
    [
        (Dtype.int16, 0, 1.0),
        (Dtype.int16, 0, 0.25),
        (Dtype.int16, -1000, 2.0**-7),
        (Dtype.int8, 5, 0.0371),
        (Dtype.int4, -2, 0.5),
        (Dtype.uint8, 128, 2.0**-3),
        (Dtype.uint4, 3, 0.013),
    ],
)
def test_round_and_floor_per_tensor_against_decimal(dtype, zp, scale, method, use_torch_kernel):
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(qmax + zp)
    units = np.concatenate([_tricky_units(rng, qmax - qmin + 8), _sample(qmin, qmax, zp, rng, 3000)])
    x32 = (units * scale).astype(np.float32)
    s32 = np.float32(scale)
    ref, mask, _ = _numpy_fake_quant(x32, s32, zp, qmin, qmax, method)
    x = torch.from_numpy(x32)
    w = _grad_weights(x.shape)

    def eng(t):
        return fake_quantize_int(
            t, torch.tensor(s32), torch.tensor(zp), qmin, qmax, round_method=method, use_torch_kernel=use_torch_kernel
        )

    out, grad = _forward_backward(eng, x, w)
    assert_bitwise_equal(out, torch.from_numpy(ref))
    assert torch.equal(grad, w * torch.from_numpy(mask))


@pytest.mark.parametrize("method", [RoundType.round, RoundType.floor])
def test_round_and_floor_per_channel_and_group_against_decimal(method):
    dtype = Dtype.int6
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(21)
    x, s, z = _channel_tensor(dtype, 1, rng)
    sv = s.numpy()[None, :, None, None].reshape(1, 4, 1)
    zv = z.numpy()[None, :, None].reshape(1, 4, 1)
    ref, mask, _ = _numpy_fake_quant(x.numpy(), sv, zv, qmin, qmax, method)
    out = fake_quantize_int(x, s, z, qmin, qmax, round_method=method, qscheme=QSchemeType.per_channel, axis=1)
    assert_bitwise_equal(out, torch.from_numpy(ref))

    x, s, z = _group_tensor(dtype, (6, 37), 1, 8, rng)
    s_full = s.repeat_interleave(8, dim=-1)[:, :37].numpy()
    z_full = z.repeat_interleave(8, dim=-1)[:, :37].numpy()
    ref, mask, _ = _numpy_fake_quant(x.numpy(), s_full, z_full, qmin, qmax, method)
    w = _grad_weights(x.shape)
    out, grad = _forward_backward(
        lambda t: fake_quantize_int(
            t, s, z, qmin, qmax, round_method=method, qscheme=QSchemeType.per_group, axis=1, group_size=8
        ),
        x,
        w,
    )
    assert_bitwise_equal(out, torch.from_numpy(ref))
    assert torch.equal(grad, w * torch.from_numpy(mask))


# ---------------------------------------------------------------------------------------------------------------------
# quantize_int -> dequantize_int == fake_quantize_int; codes int32 in range and equal to a numpy reference
# ---------------------------------------------------------------------------------------------------------------------


def _qparams_case(kind: str, dtype: Dtype, rng: np.random.Generator):
    qmin, qmax = int_range(dtype)
    if kind == "tensor":
        zp = _zero_points(dtype)[1]
        x = torch.from_numpy((_sample(qmin, qmax, zp, rng, 3000) * 0.0371).astype(np.float32)).reshape(-1, 1)
        s, z = torch.tensor(0.0371), torch.tensor(zp, dtype=torch.int32)
        return x, s, z, {"qscheme": QSchemeType.per_tensor}, s.numpy(), z.numpy()
    if kind == "channel":
        x, s, z = _channel_tensor(dtype, -1, rng)
        return x, s, z, {"qscheme": QSchemeType.per_channel, "axis": -1}, s.numpy(), z.numpy()
    g = 8
    x, s, z = _group_tensor(dtype, (37, 5), 0, g, rng)  # ragged along axis 0
    s_full = s.repeat_interleave(g, dim=-1)[:, :37].T.numpy()
    z_full = z.repeat_interleave(g, dim=-1)[:, :37].T.numpy()
    return x, s, z, {"qscheme": QSchemeType.per_group, "axis": 0, "group_size": g}, s_full, z_full


@pytest.mark.parametrize("method", [RoundType.half_even, RoundType.round, RoundType.floor])
@pytest.mark.parametrize("kind", ["tensor", "channel", "group"])
@pytest.mark.parametrize("dtype", [Dtype.int3, Dtype.int8, Dtype.int16, Dtype.uint4, Dtype.uint8], ids=lambda d: d.name)
def test_quantize_dequantize_equals_fake_quantize(dtype, kind, method):
    qmin, qmax = int_range(dtype)
    rng = np.random.default_rng(qmax + len(kind))
    x, s, z, kw, s_np, z_np = _qparams_case(kind, dtype, rng)
    codes = quantize_int(x, s, z, qmin, qmax, round_method=method, **kw)
    assert codes.dtype == torch.int32 and codes.shape == x.shape
    assert int(codes.min()) >= qmin and int(codes.max()) <= qmax
    if kind != "group":
        assert int(codes.min()) == qmin and int(codes.max()) == qmax  # the inputs reach both bounds
    _, _, ref_codes = _numpy_fake_quant(x.numpy(), s_np, z_np, qmin, qmax, method)
    assert torch.equal(codes, torch.from_numpy(ref_codes.astype(np.int32)))

    deq = dequantize_int(codes, s, z, **kw)
    fake = fake_quantize_int(x, s, z, qmin, qmax, round_method=method, **kw)
    assert_bitwise_equal(deq, fake)
    assert_bitwise_equal(dequantize_int(codes, s, z, dtype=torch.float16, **kw), fake.half())


# ---------------------------------------------------------------------------------------------------------------------
# scale types
# ---------------------------------------------------------------------------------------------------------------------


def _random_scales(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.exp2(rng.uniform(-30, 30, n)).astype(np.float32)


def test_pof2_scale_is_two_to_the_rounded_log2():
    s = _random_scales(20000, 1)
    log2 = np.log2(s.astype(np.float64))
    frac = log2 - np.floor(log2)
    s = s[np.abs(frac - 0.5) > 1e-6]  # a float32 log2 can land on k + 0.5 within 1e-7 of it: ambiguous, see below
    expected = np.exp2(np.round(np.log2(s.astype(np.float64)))).astype(np.float32)
    exact = np.exp2(np.arange(-40, 41, dtype=np.float64)).astype(np.float32)  # powers of two stay themselves
    s = np.concatenate([s, exact, np.float32([0.75, 1.4, 1.42, 2.9, 5.0, 0.3])])
    expected = np.concatenate([expected, exact, np.float32([1.0, 1.0, 2.0, 4.0, 4.0, 0.25])])
    out = apply_scale_type(torch.from_numpy(s), ScaleType.pof2, torch.float32)
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, torch.from_numpy(expected))
    mant, _ = torch.frexp(out)
    assert bool((mant == 0.5).all())


def test_pof2_near_half_exponent_is_a_neighbouring_power_of_two():
    k = np.arange(-20, 20, dtype=np.float64)
    centre = np.exp2(k + 0.5).astype(np.float32)
    s = np.concatenate([centre, np.nextafter(centre, np.float32(0)), np.nextafter(centre, np.float32(np.inf))])
    out = apply_scale_type(torch.from_numpy(s), ScaleType.pof2, torch.float32).double().numpy()
    kk = np.tile(k, 3)
    assert np.all((out == np.exp2(kk)) | (out == np.exp2(kk + 1)))


def _bfloat16_rne(s: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32 by bit arithmetic (round to nearest even), finite inputs."""
    bits = s.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("scale_type", [ScaleType.float16, ScaleType.bfloat16])
def test_low_precision_scales_equal_the_cast(scale_type):
    s = np.concatenate(
        [_random_scales(5000, 2), np.float32([1.0, 3.0, 0.1, 1e-3, 65504.0, 1 + 2**-11, 1 + 3 * 2**-11])]
    )
    s = s[(s > 6.2e-5) & (s < 65000)] if scale_type == ScaleType.float16 else s
    t = torch.from_numpy(s)
    out = apply_scale_type(t, scale_type, torch.float32)
    torch_dtype = torch.float16 if scale_type == ScaleType.float16 else torch.bfloat16
    assert_bitwise_equal(out, t.to(torch_dtype).float())
    independent = s.astype(np.float16).astype(np.float32) if scale_type == ScaleType.float16 else _bfloat16_rne(s)
    assert_bitwise_equal(out, torch.from_numpy(independent))


def test_float_and_float32_scale_types():
    s = torch.from_numpy(_random_scales(1000, 3))
    assert_bitwise_equal(apply_scale_type(s, ScaleType.float32, torch.bfloat16), s)
    assert_bitwise_equal(apply_scale_type(s, None, torch.float16), s)
    assert_bitwise_equal(apply_scale_type(s, ScaleType.float, torch.float32), s)
    assert_bitwise_equal(
        apply_scale_type(s, ScaleType.float, torch.bfloat16), torch.from_numpy(_bfloat16_rne(s.numpy()))
    )
    assert_bitwise_equal(apply_scale_type(s, ScaleType.float, torch.int8), s)


def test_a_scale_that_requires_grad_gets_none_and_the_backward_runs():
    """Only ``x`` is differentiable here (learned scales are TQT/LSQ's own functions): a scale that requires grad,
    with an input that does not, gets no gradient instead of a crash in the backward."""
    scale = torch.tensor(0.1, requires_grad=True)
    x = torch.randn(10000)  # past the size handed to torch's kernel: the elementwise path
    fake_quantize_int(x, scale, torch.tensor(0, dtype=torch.int32), -128, 127).sum().backward()
    assert scale.grad is None


@pytest.mark.parametrize("method", [RoundType.half_even, RoundType.round, RoundType.floor])
@pytest.mark.parametrize("float_zp", [False, True], ids=["int_zp", "float_zp"])
def test_every_grid_value_quantizes_back_to_its_own_code(method, float_zp):
    """Exhaustive over the codes of int8 and uint4 at many scales: the dequantized value of code k quantizes to k
    again, so fake quantization is idempotent (a bare ``floor(x * (1 / s))`` drops a step on about 6% of them)."""
    rng = np.random.default_rng(7)
    scales = np.concatenate([rng.uniform(1e-4, 1.0, 200), [0.1, 0.0371, 1 / 3, 2.0**-7]]).astype(np.float32)
    for dtype in (Dtype.int8, Dtype.uint4):
        qmin, qmax = int_range(dtype)
        k = torch.arange(qmin, qmax + 1, dtype=torch.float32)[:, None]  # [codes, 1]: every code at every scale
        s = torch.from_numpy(scales)[None, :]
        zp = torch.full((1, len(scales)), (qmin + qmax) // 2 + (0.25 if float_zp else 0), dtype=torch.float32)
        z = zp if float_zp else zp.to(torch.int32)
        x = (k - z) * s  # on the grid, computed as the fake quantizer dequantizes
        kwargs = {"round_method": method, "qscheme": QSchemeType.per_channel, "axis": 1}
        codes = quantize_int(x, s[0], z[0], qmin, qmax, **kwargs)
        assert torch.equal(codes, k.expand_as(x).to(torch.int32))
        assert torch.equal(fake_quantize_int(x, s[0], z[0], qmin, qmax, **kwargs), x)
