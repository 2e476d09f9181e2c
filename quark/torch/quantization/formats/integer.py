"""Integers of any width: quantize -> dequantize with a scale and zero point, per tensor, channel or group.

Layout of the qparams (``scale`` and ``zero_point`` alike):
- per_tensor: one element;
- per_channel: [C], C the size of ``axis``;
- per_group: [..., n_groups], the shape of ``x.movedim(axis, -1)`` with its last dim split into groups of
  ``group_size`` (a ragged last group is padded, see ``to_blocks``);
- per_block: [ceil(R / rows), ceil(C / cols)] for a 2-D x [R, C] in tiles of ``block_size`` = [rows, cols] (ragged
  edge tiles allowed, see ``to_tiles``).

Arithmetic follows torch's fused kernels exactly: ``q = round(x * (1 / scale)) + zp``, ``y = (clamp(q) - zp) * scale``,
and the straight-through gradient is 1 where ``qmin <= q <= qmax``, else 0. The kernels here run compiled by default
(``grouping.Backend``: one fused pass forward, one backward); where they run eagerly, half-even with an integer zero
point dispatches to ``torch.fake_quantize_per_{tensor,channel}_affine`` up to ``TORCH_KERNEL_MAX_NUMEL`` elements, the
fastest eager form there (larger tensors take the elementwise chain, several times faster).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quark.torch.quantization import late_flag
from quark.torch.quantization.config.type import QSchemeType, RoundType, ScaleType
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
    normalize_axis,
    round_to_int,
    saturate_to,
    steady_key,
    tile_layout,
    tile_view,
    to_blocks,
    to_tiles,
)
from quark.torch.quantization.formats.masks import equal, within

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
#: the largest tensor handed to torch's fused fake-quant kernels when running eagerly. Measured on 2 cores (forward,
#: per tensor): 1024 elements 9.7 us against 13.3 for the elementwise chain, 8192: 53 against 25, 32768: 210 against
#: 47, 4M: 13.6 ms against 3.9 (torch's kernel runs about 6 ns per element on one thread)
TORCH_KERNEL_MAX_NUMEL = 8192
_E8M0_MIN, _E8M0_MAX = 2.0**-127, 2.0**127  # the finite range of float8_e8m0fnu
#: auto mode compiles the integer kernels from this size, as the block and minifloat ones (``BLOCK_MIN_NUMEL``,
#: ``GRID_MIN_NUMEL``). Inside a training step the eager chain (about ten ops forward) runs with cold caches and costs
#: 3-5x its tight-loop time: the width-512 MLP's 32x512 activation took 108-125 us a forward there against 47 us
#: compiled (docs/performance.md, seventh round)
INT_MIN_NUMEL = 1 << 12


def apply_scale_type(
    scale: torch.Tensor, scale_type: ScaleType | None, model_dtype: torch.dtype, who: str = "a quantizer"
) -> torch.Tensor:
    """Hold ``scale`` in the precision of ``scale_type``; returned as float32 for the arithmetic.

    float: the model's float dtype; pof2: ``2^round(log2 s)`` (Quark's convention), the exponent at most 127;
    float32/float16/bfloat16: that dtype; float8_e8m0fnu: ``2^ceil(log2 s)`` (UE8M0, rounded up so no value clips),
    clamped to [2^-127, 2^127].

    A scale held in a narrower float (float16, bfloat16, or ``float`` for such a model) saturates to that type's
    range: one past its largest finite value becomes that value (a warning says so: inputs beyond ``qmax`` times it
    clip; ``who`` names the quantizer there) and one below its smallest subnormal becomes that subnormal, never inf
    or 0.
    """
    if scale_type == ScaleType.pof2:
        held = torch.exp2(torch.round(torch.log2(scale.float())).clamp(max=127))
    elif scale_type == ScaleType.float8_e8m0fnu:
        held = ceil_pow2(scale)
    else:
        held = _held_in(scale, scale_dtype(scale_type, model_dtype), who)
    return held.float()


def scale_dtype(scale_type: ScaleType | None, model_dtype: torch.dtype) -> torch.dtype:
    """The float dtype a scale of ``scale_type`` is held in (float32 for the power-of-two types, which it holds
    exactly); ``model_dtype`` decides for ``float``."""
    if scale_type in (None, ScaleType.float32, ScaleType.pof2, ScaleType.float8_e8m0fnu):
        return torch.float32
    if scale_type == ScaleType.float:
        return model_dtype if model_dtype.is_floating_point else torch.float32
    if scale_type == ScaleType.float16:
        return torch.float16
    if scale_type == ScaleType.bfloat16:
        return torch.bfloat16
    raise ValueError(f"scale_type={scale_type!r} is not one of {ScaleType.choices()}")


def _held_in(scale: torch.Tensor, dtype: torch.dtype, who: str) -> torch.Tensor:
    """``scale`` in ``dtype``, saturated to its finite positive range (see ``apply_scale_type``)."""
    s = scale.float()
    if dtype == torch.float32 or torch.finfo(dtype).max >= torch.finfo(s.dtype).max:
        return s.to(dtype)
    info = torch.finfo(dtype)
    # traced into a compiled graph the check would break it: a caller tracing this checks the held scale itself
    if not torch.compiler.is_compiling() and bool((s > info.max).any()):
        warnings.warn(
            f"{who}: a scale of {float(s.max()):.6g} exceeds {str(dtype).removeprefix('torch.')}'s largest value "
            f"{info.max:.6g}; it is held as {info.max:.6g}, so values beyond it times the format's largest code clip "
            "(scale_type=float32 keeps the full range)",
            stacklevel=3,
        )
    smallest = info.smallest_normal * info.eps  # the smallest subnormal: 2^-24 (float16), 2^-133 (bfloat16)
    return s.clamp(smallest, info.max).to(dtype)


def ceil_pow2(scale: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 s)`` clamped to E8M0's range [2^-127, 2^127], exactly (from the float32 exponent, no log)."""
    s = scale.float().clamp(_E8M0_MIN, _E8M0_MAX)
    mantissa, exp = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1): a power of two has m == 0.5
    exp = torch.where(mantissa == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(s), exp).clamp(_E8M0_MIN, _E8M0_MAX)


def _int_codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, method: RoundType) -> torch.Tensor:
    """``round(x * (1 / scale)) + zp`` (an integer zero point) or ``round(x * (1 / scale) + zp)`` (a float one).

    ``floor`` is the largest code whose dequantized value ``(q - zp) * scale`` is at most ``x``: ``x * (1 / scale)``
    of a value on the grid can land an ulp below its integer, which a bare floor would drop a step, so quantizing a
    quantized tensor (GPTQ's result, a frozen weight) would not give it back."""
    v = x * torch.reciprocal(scale)
    if zero_point.is_floating_point():
        q = round_to_int(v + zero_point, method)
        return q + ((q + 1 - zero_point) * scale <= x) if method == RoundType.floor else q
    q = round_to_int(v, method)
    if method == RoundType.floor:
        q = q + ((q + 1) * scale <= x)
    return q + zero_point


@compilable(min_numel=INT_MIN_NUMEL)
def int_forward(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, method: RoundType
) -> torch.Tensor:
    """Fake-quantized ``x`` (computed in float32, returned in x's dtype), qparams broadcastable to it: one fused pass
    when compiled."""
    return saturate_to(
        (_int_codes(x.float(), scale, zero_point, method).clamp(qmin, qmax) - zero_point) * scale, x.dtype
    )


@compilable(min_numel=INT_MIN_NUMEL)
def _int_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    method: RoundType,
) -> torch.Tensor:
    """The straight-through gradient: ``grad`` where ``qmin <= q <= qmax``, else 0 (the mask recomputed from ``x``
    rather than stored: a compiled backward reads ``x`` once instead of writing and reading a mask)."""
    q = _int_codes(x.float(), scale, zero_point, method)
    return grad * within(q, qmin, qmax, grad.dtype)


def _int_forward_masked(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, method: RoundType
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager forward that also returns the straight-through mask (``masks``: a float tensor on CPU): eagerly each op
    is a pass over memory, and one mask written now is cheaper than the backward's recomputation."""
    q = _int_codes(x.float(), scale, zero_point, method)
    clamped = q.clamp(qmin, qmax)
    mask = equal(q, clamped, x.dtype)  # qmin <= q <= qmax (NaN: 0), what ``masks.within`` gives, sharing the clamp
    return saturate_to(clamped.sub_(zero_point).mul_(scale), x.dtype), mask


class _IntFakeQuant(torch.autograd.Function):
    """y = (clamp(round(x / s) + zp) - zp) * s with torch's straight-through mask as gradient: compiled, the mask is
    recomputed from the saved input in the backward's one pass; eagerly it is stored by the forward."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, round_method):  # type: ignore[override]
        if not ctx.needs_input_grad[0]:  # (a scale that requires grad gets none here: it is not learned)
            ctx.meta = "no grad"
            return int_forward(x, scale, zero_point, qmin, qmax, round_method)
        if compiled_kernels_active(x, INT_MIN_NUMEL) or torch.compiler.is_compiling():
            ctx.save_for_backward(x, scale, zero_point)
            ctx.meta = (qmin, qmax, round_method)
            return int_forward(x, scale, zero_point, qmin, qmax, round_method)
        out, mask = _int_forward_masked(x, scale, zero_point, qmin, qmax, round_method)
        ctx.save_for_backward(mask)
        ctx.meta = None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.meta == "no grad":
            return None, None, None, None, None, None
        if ctx.meta is None:
            (mask,) = ctx.saved_tensors
            return grad * mask, None, None, None, None, None  # as torch: -0.0 where a negative grad is masked
        x, scale, zero_point = ctx.saved_tensors
        return _int_grad(grad, x, scale, zero_point, *ctx.meta), None, None, None, None, None


_int_fake_quant = fast_apply(_IntFakeQuant)


def _torch_kernel_applies(zero_point: torch.Tensor, qmin: int, qmax: int, method: RoundType) -> bool:
    return (
        method == RoundType.half_even
        and not zero_point.is_floating_point()
        and _INT32_MIN <= qmin <= qmax <= _INT32_MAX
    )


def _torch_kernel_serves(x: torch.Tensor, applies: bool, per_channel: bool) -> bool:
    """Whether torch's fused fake-quant kernel quantizes ``x`` (``applies``: the caller allows it and the qparams
    suit it): eagerly and on small tensors only. Above ``TORCH_KERNEL_MAX_NUMEL`` the elementwise chain
    (multithreaded ops) is faster, a compiled kernel (one pass, no stored mask) beats both, and traced into a
    caller's compiled graph the elementwise chain fuses. Not torch's per-channel kernel where a host read waits for
    the device (CUDA, ``late_flag.defers``): it checks its integer zero points with ``aminmax`` and two ``.item()``
    inside the op, two host syncs per call."""
    return (
        applies
        and not (per_channel and late_flag.defers(x.device))
        and x.numel() <= TORCH_KERNEL_MAX_NUMEL
        and not compiled_kernels_active(x, INT_MIN_NUMEL)
        and not torch.compiler.is_compiling()
    )


def _fake_quantize_elementwise(
    x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int, method: RoundType
) -> torch.Tensor:
    """Core with ``scale``/``zp`` already broadcastable to ``x``."""
    return _int_fake_quant(x, scale, zp, qmin, qmax, method)


class _SteadyIntFakeQuant(torch.autograd.Function):
    """``_IntFakeQuant``'s compiled path with its direct kernels called straight: the same kernels and bits, without
    the decisions and signature lookups between the quantizer and the generated code. Inside a training step every
    layer of Python between them runs with cold caches (docs/performance.md, seventh round)."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, prepared, steady):  # type: ignore[override]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(x, scale, zero_point)
            ctx.prepared, ctx.steady = prepared, steady
        return steady.forward((x, scale, zero_point, prepared.qmin, prepared.qmax, prepared.round_method))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, scale, zero_point = ctx.saved_tensors
        p = ctx.prepared
        args = (grad, x, scale, zero_point, p.qmin, p.qmax, p.round_method)
        return ctx.steady.backward_call(_int_grad, args), None, None, None, None


_steady_int_fake_quant = fast_apply(_SteadyIntFakeQuant)


@dataclass(frozen=True, eq=False)
class PreparedInt:
    """``fake_quantize_int`` per tensor or per channel with its qparams cast and shaped once, for inputs of one rank:
    a quantizer whose qparams stay as they are (QAT with observers off) keeps one and skips that bookkeeping on
    every call (``ScaledFakeQuantize``: 20-25 us of Python per quantizer forward on 2 cores). ``fake_quantize_int``
    runs through it too, so both give the same bits."""

    scale: torch.Tensor  #: float32, broadcastable to the input (0-dim per tensor, ``channel_view`` per channel)
    zero_point: torch.Tensor  #: int32 (or a float zero point), the same layout
    flat_scale: torch.Tensor  #: 1-D, for torch's per-channel kernel
    flat_zero_point: torch.Tensor
    axis: int | None  #: the channel axis, non-negative (None: per tensor)
    qmin: int
    qmax: int
    round_method: RoundType
    torch_kernel: bool  #: whether torch's fused kernels may serve small inputs eagerly
    #: the steady path of an object its caller keeps (``of(..., keep=True)``; None: off): the direct kernels found per
    #: input signature (``steady_key``), and the compiled calls seen per signature while none is found
    steady: dict[tuple[Any, ...], SteadyKernels] | None = field(default=None, repr=False)
    calls: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        scale: torch.Tensor,
        zero_point: torch.Tensor,
        qmin: int,
        qmax: int,
        round_method: RoundType,
        axis: int | None,
        ndim: int,
        use_torch_kernel: bool = True,
        keep: bool = False,
    ) -> PreparedInt:
        """Prepared for inputs of rank ``ndim``; ``axis`` None is per tensor, else the (possibly negative) channel
        axis. ``keep``: the caller keeps this object for many calls (a quantizer with fixed qparams), so it takes the
        steady path once its kernels are served directly."""
        scale = scale.float()
        if not zero_point.is_floating_point():
            zero_point = zero_point.to(torch.int32)
        torch_kernel = use_torch_kernel and _torch_kernel_applies(zero_point, qmin, qmax, round_method)
        if axis is None:
            s, z = scale.reshape(()), zero_point.reshape(())
            return cls(s, z, s, z, None, qmin, qmax, round_method, torch_kernel, {} if keep else None)
        s, z = channel_view(scale, ndim, axis), channel_view(zero_point, ndim, axis)
        flat_s, flat_z = scale.reshape(-1), zero_point.reshape(-1)  # torch's kernel rejects a negative axis
        axis = normalize_axis(axis, ndim)
        return cls(s, z, flat_s, flat_z, axis, qmin, qmax, round_method, torch_kernel, {} if keep else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.steady is None:
            return self._call(x)
        key = steady_key(x)
        steady = self.steady.get(key) if key is not None else None
        if steady is not None:  # a signature called often: its direct kernels, called straight
            return cast_saturating(_steady_int_fake_quant(x, self.scale, self.zero_point, self, steady), x.dtype)
        out = self._call(x)
        if key is not None and compiled_kernels_active(x, INT_MIN_NUMEL, count=False):
            self._look_for_steady(key, x)
        return out

    def _look_for_steady(self, key: tuple[Any, ...], x: torch.Tensor) -> None:
        """Take the forward's direct kernel for ``key`` once the kernel cache has built it (it builds one after
        ``kernel_cache.DIRECT_AFTER_CALLS`` compiled calls of a signature; ``look_for_steady``).
        Not where the qparams require grad (the steady Function gives them none, as ``_IntFakeQuant`` does, but its
        output would not require grad)."""
        if self.scale.requires_grad or self.zero_point.requires_grad:
            return
        args = (x, self.scale, self.zero_point, self.qmin, self.qmax, self.round_method)
        look_for_steady(self.steady, self.calls, key, int_forward, args)  # type: ignore[arg-type]

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        # torch's kernels take float32; ours read any float dtype and compute in float32 (a bfloat16 weight is not
        # cast to float32 and back around a compiled kernel: 4096x4096 bf16 per channel 23 -> 3 ms)
        if _torch_kernel_serves(x, self.torch_kernel, self.axis is not None):
            if self.axis is None:
                out = torch.fake_quantize_per_tensor_affine(
                    x.float(), self.scale, self.zero_point, self.qmin, self.qmax
                )
            else:
                out = torch.fake_quantize_per_channel_affine(
                    x.float(), self.flat_scale, self.flat_zero_point, self.axis, self.qmin, self.qmax
                )
        else:
            out = _int_fake_quant(x, self.scale, self.zero_point, self.qmin, self.qmax, self.round_method)
        return cast_saturating(out, x.dtype)  # fp16 at 65504 on a grid point past it: 65504, not inf


def fake_quantize_int(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    round_method: RoundType = RoundType.half_even,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    use_torch_kernel: bool = True,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to integers in ``[qmin, qmax]`` and back; differentiable (straight-through) in ``x``."""
    if qscheme in (QSchemeType.per_tensor, QSchemeType.per_channel):
        axis = _require_axis(axis, qscheme) if qscheme == QSchemeType.per_channel else None
        return PreparedInt.of(scale, zero_point, qmin, qmax, round_method, axis, x.ndim, use_torch_kernel)(x)
    orig_dtype = x.dtype
    scale = scale.float()
    applies = use_torch_kernel and _torch_kernel_applies(zero_point, qmin, qmax, round_method)
    fast = _torch_kernel_serves(x, applies, per_channel=True)  # per group: torch's per-channel kernel, one row a group
    xf = x.float() if fast else x
    if not zero_point.is_floating_point():
        zero_point = zero_point.to(torch.int32)

    if qscheme == QSchemeType.per_group:
        axis = _require_axis(axis, qscheme)
        xb, layout = to_blocks(xf, axis, _require_group(group_size), whole_axis=True)  # [..., G, g]
        if fast:
            rows = xb.reshape(-1, layout.block)  # every group a row: per-group == per-channel on axis 0
            outb = torch.fake_quantize_per_channel_affine(
                rows, scale.reshape(-1), zero_point.reshape(-1), 0, qmin, qmax
            ).reshape(xb.shape)
        else:
            outb = _fake_quantize_elementwise(
                xb, scale.unsqueeze(-1), zero_point.unsqueeze(-1), qmin, qmax, round_method
            )
        out = from_blocks(outb, layout, xf.shape)
    elif qscheme == QSchemeType.per_block:
        xt, tiles = to_tiles(xf, block_size)  # [n_rows, rows, n_cols, cols]; qparams [n_rows, 1, n_cols, 1]
        outt = _fake_quantize_elementwise(
            xt, tile_view(scale, tiles), tile_view(zero_point, tiles), qmin, qmax, round_method
        )
        out = from_tiles(outt, tiles)
    else:
        raise ValueError(f"qscheme={qscheme!r} is not one of {QSchemeType.choices()}")
    return cast_saturating(out, orig_dtype)  # fp16 at 65504 on a grid point past it: 65504, not inf


def fake_quantize_int_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    round_method: RoundType = RoundType.half_even,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The gradient ``fake_quantize_int`` gives ``x`` for ``grad`` (straight-through inside ``[qmin, qmax]``), for a
    caller that computed the forward itself (the quantizers' fused observe-and-quantize pass)."""
    xv, back = _qparam_layout(x, qscheme, axis, group_size, block_size)
    gv, _ = _qparam_layout(grad, qscheme, axis, group_size, block_size)
    s, z = _broadcast_qparams(x, scale.float(), zero_point, qscheme, axis, group_size, block_size)
    return back(_int_grad(gv, xv, s, z, qmin, qmax, round_method))


def int_gradient_passes(
    values: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    round_method: RoundType = RoundType.half_even,
) -> torch.Tensor:
    """Whether the straight-through gradient passes at every one of ``values`` (a 0-dim bool tensor): ``values`` hold
    elementwise to ``scale`` / ``zero_point`` (an observer's statistics and their qparams), and the codes are
    ``_int_grad``'s, the same arithmetic. The codes never decrease as a value grows, so where a range's two ends pass,
    every value between them does."""
    zp = zero_point if zero_point.is_floating_point() else zero_point.to(torch.int32)
    q = _int_codes(values.float(), scale.float(), zp, round_method)
    return within(q, qmin, qmax, torch.float32).all()  # ``_int_grad``'s own mask


def quantize_int(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qmin: int,
    qmax: int,
    *,
    round_method: RoundType = RoundType.half_even,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The integer codes ``clamp(round(x / scale) + zp)`` in x's layout, as int32 (the export form)."""
    xf = x.float()
    xv, back = _qparam_layout(xf, qscheme, axis, group_size, block_size)
    s, z = _broadcast_qparams(xf, scale.float(), zero_point, qscheme, axis, group_size, block_size)
    return back(_int_codes(xv, s, z, round_method).clamp(qmin, qmax)).to(torch.int32)


def dequantize_int(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    *,
    qscheme: QSchemeType = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """``(q - zp) * scale``: the inverse of ``quantize_int`` (equal to ``fake_quantize_int`` of the same input)."""
    qf = q.float()
    qv, back = _qparam_layout(qf, qscheme, axis, group_size, block_size)
    s, z = _broadcast_qparams(qf, scale.float(), zero_point, qscheme, axis, group_size, block_size)
    return back((qv - z) * s).to(dtype)


def _qparam_layout(
    x: torch.Tensor, qscheme: QSchemeType, axis: int | None, group_size: int | None, block_size: Sequence[int] | None
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``x`` in the layout its qparams broadcast over (groups, tiles or as is), and the way back to x's shape."""
    if qscheme == QSchemeType.per_group:
        xb, layout = to_blocks(x, _require_axis(axis, qscheme), _require_group(group_size), whole_axis=True)
        return xb, lambda y: from_blocks(y, layout, x.shape)
    if qscheme == QSchemeType.per_block:
        xt, tiles = to_tiles(x, block_size)
        return xt, lambda y: from_tiles(y, tiles)
    return x, lambda y: y


def _broadcast_qparams(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    qscheme: QSchemeType,
    axis: int | None,
    group_size: int | None,
    block_size: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    zp = zero_point if zero_point.is_floating_point() else zero_point.to(torch.int32)
    if qscheme == QSchemeType.per_tensor:
        return scale.reshape(()), zp.reshape(())
    if qscheme == QSchemeType.per_channel:
        axis = _require_axis(axis, qscheme)
        return channel_view(scale, x.ndim, axis), channel_view(zp, x.ndim, axis)
    if qscheme == QSchemeType.per_group:
        _require_axis(axis, qscheme)
        _require_group(group_size)
        return scale.unsqueeze(-1), zp.unsqueeze(-1)
    if qscheme == QSchemeType.per_block:
        tiles = tile_layout(x.shape, block_size)
        return tile_view(scale, tiles), tile_view(zp, tiles)
    raise ValueError(f"qscheme={qscheme!r} is not one of {QSchemeType.choices()}")


def _require_axis(axis: int | None, qscheme: QSchemeType) -> int:
    if axis is None:
        raise ValueError(f"qscheme={qscheme.name} needs ch_axis (an int), got None")
    return axis


def _require_group(group_size: int | None) -> int:
    if group_size is None or group_size <= 0:
        raise ValueError(f"qscheme=per_group needs a positive group_size, got {group_size}")
    return group_size
