"""Minifloats as one generic (exponent bits, mantissa bits) implementation: fp8 e4m3/e5m2, fp6 e3m2/e2m3, fp4 e2m1.

Rounding is to nearest, ties to even, on the element grid: subnormals are kept, magnitudes beyond ``max_normal``
saturate to it (as torch's float8 casts do for every finite input inside the range; outside it torch gives NaN
or inf, we saturate). The scaled variants divide by a scale first (per tensor, channel, group or 2-D block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.formats.grouping import (
    SteadyKernels,
    cast_saturating,
    channel_view,
    compilable,
    compiled_kernels_active,
    fast_apply,
    from_blocks,
    from_tiles,
    look_for_steady,
    saturate_to,
    steady_key,
    tile_view,
    to_blocks,
    to_tiles,
)
from quark.torch.quantization.formats.masks import at_most
from quark.torch.quantization.formats.table import FloatFormat


def round_to_grid(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round float32 ``x`` to the nearest value of ``fmt`` (ties to even), saturating at +-max_normal."""
    a = x.abs()
    # the grid step 2^(max(floor(log2 a), emin) - mbits) (fixed below the normal range: subnormals), built as the
    # bits of a float32 power of two from a's biased exponent field (zero and float32 subnormals read 0, below any
    # format's emin + 127): integer ops on an int32 view, no frexp/exp2, so a compiled kernel stays vectorized
    step_bits = (a.view(torch.int32) >> 23).clamp_(min=fmt.emin + 127).sub_(fmt.mbits).bitwise_left_shift_(23)
    step = step_bits.view(torch.float32)
    # a / step is exact (step is a power of two); a is this function's own temporary, so everything runs in place
    return a.div_(step).round_().mul_(step).clamp_(max=fmt.max_normal).copysign_(x)


#: auto mode compiles the minifloat forward from this size (the other kernels: ``Backend.min_numel``): eagerly, fp8
#: rounds through torch's float8 cast, whose conversion back to float32 is slow on CPU (2 idle cores, torch 2.13,
#: through the kernel cache: 4096 elements 20 us eager against 14 us compiled, 32768: 112 against 17)
GRID_MIN_NUMEL = 1 << 12


@compilable(min_numel=GRID_MIN_NUMEL)
def grid_forward(x: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``x`` scaled onto the float format's grid, rounded there and scaled back (the compilable minifloat kernel),
    computed in float32 and returned in x's dtype (saturated there): compiled, a bfloat16 / float16 input is read
    and written in its dtype within the one pass."""
    return saturate_to(round_to_grid(x.float() / scale, fmt).mul_(scale), x.dtype)


def cast_forward(x: torch.Tensor, scale: torch.Tensor, max_normal: float, torch_dtype: torch.dtype) -> torch.Tensor:
    """``x`` scaled, saturated and cast through ``torch_dtype`` (torch's own fp8 rounding), then scaled back."""
    # eager only: where the compiled kernels are active, fp8 takes the grid rounding (the cast does not vectorize)
    return (x / scale).clamp_(-max_normal, max_normal).to(torch_dtype).to(torch.float32).mul_(scale)


@compilable(min_numel=GRID_MIN_NUMEL)  # the forward's threshold: its gradient is as cheap to serve compiled
def _saturation_grad(grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, max_normal: float) -> torch.Tensor:
    """The straight-through gradient: ``grad`` where ``|x / scale| <= max_normal``, 0 where the format saturates
    (recomputed from ``x``, not stored as a mask)."""
    return grad * at_most((x.float() / scale).abs(), max_normal, grad.dtype)


def minifloat_gradient_passes(values: torch.Tensor, scale: torch.Tensor, max_normal: float) -> torch.Tensor:
    """Whether the straight-through gradient passes at every one of ``values`` (a 0-dim bool tensor), ``values``
    elementwise to ``scale``: ``_saturation_grad``'s test, which grows with ``|value|``, so a range's two ends passing
    means every value between them does."""
    return at_most((values.float() / scale.float()).abs(), max_normal, torch.float32).all()  # its own mask


class _GridSTE(torch.autograd.Function):
    """Straight-through rounding to a grid: gradient 1 inside [-limit, limit] (after scaling), 0 where saturated."""

    @staticmethod
    def forward(ctx, x, scale, fmt):  # type: ignore[override]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, scale)
            ctx.max_normal = fmt.max_normal
        return grid_forward(x, scale, fmt)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale = ctx.saved_tensors
        return _saturation_grad(grad, x, scale, ctx.max_normal), None, None


def fake_quantize_minifloat(
    x: torch.Tensor,
    fmt: FloatFormat,
    scale: torch.Tensor | None = None,
    *,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    torch_dtype: torch.dtype | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """``round_to_grid(x / scale) * scale`` with a per tensor, channel, group or block scale (None: scale 1).

    When ``torch_dtype`` (a torch float8 dtype of the same format) is given and the kernels run eagerly, the rounding
    is done by torch's cast, which is bit-identical inside the range and faster there; compiled, the grid rounding
    (integer ops on the bits) vectorizes and the cast does not.
    """
    orig_dtype = x.dtype
    # compiled, the kernels read a half-precision input as it is (float32 inside one pass); eagerly it is cast first
    xf = x if compiled_kernels_active(x, GRID_MIN_NUMEL) or torch.compiler.is_compiling() else x.float()
    if scale is None:
        scale = torch.ones((), device=x.device)
    scale = scale.float()
    if qscheme == QSchemeType.per_group:
        xb, layout = to_blocks(xf, axis, group_size)  # type: ignore[arg-type]
        out = from_blocks(_scaled_round(xb, scale.unsqueeze(-1), fmt, torch_dtype), layout, xf.shape)
    elif qscheme == QSchemeType.per_block:
        xt, tiles = to_tiles(xf, block_size)  # [n_rows, rows, n_cols, cols]; scale [n_rows, 1, n_cols, 1]
        out = from_tiles(_scaled_round(xt, tile_view(scale, tiles), fmt, torch_dtype), tiles)
    else:
        s = channel_view(scale, xf.ndim, axis) if qscheme == QSchemeType.per_channel else scale.reshape(())  # type: ignore[arg-type]
        out = _scaled_round(xf, s, fmt, torch_dtype)
    return cast_saturating(out, orig_dtype)  # max_normal * scale can lie past an fp16 input's largest value


def fake_quantize_minifloat_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    fmt: FloatFormat,
    scale: torch.Tensor,
    *,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The gradient ``fake_quantize_minifloat`` gives ``x`` for ``grad`` (straight-through where ``|x / scale|`` is
    within the format's range), for a caller that computed the forward itself."""
    xf, gf, scale = x.float(), grad.float(), scale.float()
    if qscheme == QSchemeType.per_group:
        xb, layout = to_blocks(xf, axis, group_size)  # type: ignore[arg-type]
        gb, _ = to_blocks(gf, axis, group_size)  # type: ignore[arg-type]
        out = from_blocks(_saturation_grad(gb, xb, scale.unsqueeze(-1), fmt.max_normal), layout, xf.shape)
    elif qscheme == QSchemeType.per_block:
        xt, tiles = to_tiles(xf, block_size)
        gt, _ = to_tiles(gf, block_size)
        out = from_tiles(_saturation_grad(gt, xt, tile_view(scale, tiles), fmt.max_normal), tiles)
    else:
        s = channel_view(scale, xf.ndim, axis) if qscheme == QSchemeType.per_channel else scale.reshape(())  # type: ignore[arg-type]
        out = _saturation_grad(gf, xf, s, fmt.max_normal)
    return out.to(grad.dtype)


def _scaled_round(
    x: torch.Tensor, scale: torch.Tensor, fmt: FloatFormat, torch_dtype: torch.dtype | None
) -> torch.Tensor:
    if torch_dtype is not None and not compiled_kernels_active(x, GRID_MIN_NUMEL) and not torch.compiler.is_compiling():
        # the cast: the fastest eager rounding (compiled, the grid rounding vectorizes and the cast does not)
        return _CastSTE.apply(x, scale, fmt, torch_dtype)
    return _grid_ste(x, scale, fmt)


_grid_ste = fast_apply(_GridSTE)


class _SteadyGridSTE(torch.autograd.Function):
    """``_GridSTE`` with its direct kernels called straight (``PreparedGrid``'s steady path): the same kernels and
    bits, without the decisions and signature lookups between the quantizer and the generated code."""

    @staticmethod
    def forward(ctx, x, scale, prepared, steady):  # type: ignore[override]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, scale)
            ctx.max_normal, ctx.steady = prepared.fmt.max_normal, steady
        return steady.forward((x, scale, prepared.fmt))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale = ctx.saved_tensors
        return ctx.steady.backward_call(_saturation_grad, (grad, x, scale, ctx.max_normal)), None, None, None


_steady_grid_ste = fast_apply(_SteadyGridSTE)


@dataclass(frozen=True, eq=False)
class PreparedGrid:
    """``fake_quantize_minifloat`` per tensor or per channel with its scale shaped once, for inputs of one rank, kept
    by a quantizer whose qparams stay as they are (QAT with observers off): once its kernels are served directly it
    calls them straight (the steady path, as ``PreparedInt``). The same bits as ``fake_quantize_minifloat``."""

    scale: torch.Tensor  #: float32, 0-dim per tensor or ``channel_view`` per channel
    fmt: FloatFormat
    torch_dtype: torch.dtype | None  #: torch's float8 type of the format, for the eager cast
    steady: dict[tuple[Any, ...], SteadyKernels] = field(default_factory=dict, repr=False)
    calls: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls, scale: torch.Tensor, fmt: FloatFormat, torch_dtype: torch.dtype | None, axis: int | None, ndim: int
    ) -> PreparedGrid:
        """Prepared for inputs of rank ``ndim``; ``axis`` None is per tensor."""
        scale = scale.float()
        return cls(scale.reshape(()) if axis is None else channel_view(scale, ndim, axis), fmt, torch_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = steady_key(x)
        steady = self.steady.get(key) if key is not None else None
        if steady is not None:
            return cast_saturating(_steady_grid_ste(x, self.scale, self, steady), x.dtype)
        # ``fake_quantize_minifloat``'s per-tensor / per-channel path with the scale shaped already
        xf = x if compiled_kernels_active(x, GRID_MIN_NUMEL) or torch.compiler.is_compiling() else x.float()
        out = cast_saturating(_scaled_round(xf, self.scale, self.fmt, self.torch_dtype), x.dtype)
        if key is not None and compiled_kernels_active(x, GRID_MIN_NUMEL, count=False):
            self._look_for_steady(key, x)
        return out

    def _look_for_steady(self, key: tuple[Any, ...], x: torch.Tensor) -> None:
        """Take the forward's direct kernel for ``key`` once the kernel cache serves it (``look_for_steady``). Not
        where the scale requires grad (a learned one)."""
        if not self.scale.requires_grad:
            look_for_steady(self.steady, self.calls, key, grid_forward, (x, self.scale, self.fmt))


class _CastSTE(torch.autograd.Function):
    """Rounding through torch's float8 cast: ``clamp(x / s) -> float8 -> float32 * s``."""

    @staticmethod
    def forward(ctx, x, scale, fmt, torch_dtype):  # type: ignore[override]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, scale)
            ctx.max_normal = fmt.max_normal
        return cast_forward(x, scale, fmt.max_normal, torch_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale = ctx.saved_tensors
        return _saturation_grad(grad, x, scale, ctx.max_normal), None, None, None


def encode(values: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Bit patterns (uint8, in the low ``fmt.bits`` bits) of values already on ``fmt``'s grid."""
    v = values.float()
    sign = torch.signbit(v).to(torch.int32)
    a = v.abs()
    _, e = torch.frexp(a)
    e = e - 1
    normal = a >= 2.0**fmt.emin
    exp_field = torch.where(normal, e + fmt.bias, torch.zeros_like(e))
    # normal: a = (1 + m / 2^mbits) * 2^e; subnormal: a = m * 2^(emin - mbits)
    mant = torch.where(
        normal,
        a * torch.exp2((fmt.mbits - e).float()) - 2**fmt.mbits,
        a * 2.0 ** (fmt.mbits - fmt.emin),
    )
    code = (sign << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant.round().to(torch.int32)
    return code.to(torch.uint8)


def decode(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Values (float32) of ``fmt`` bit patterns produced by ``encode``."""
    c = codes.to(torch.int32)
    mant = (c & (2**fmt.mbits - 1)).float()
    exp_field = (c >> fmt.mbits) & (2**fmt.ebits - 1)
    sign = 1.0 - 2.0 * ((c >> (fmt.ebits + fmt.mbits)) & 1).float()
    normal = (1.0 + mant / 2**fmt.mbits) * torch.exp2((exp_field - fmt.bias).float())
    sub = mant * 2.0 ** (fmt.emin - fmt.mbits)
    return sign * torch.where(exp_field > 0, normal, sub)
