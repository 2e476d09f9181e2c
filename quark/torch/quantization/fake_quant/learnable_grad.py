"""The autograd Functions of the learnable quantizers: TQT's and LSQ's fake quantization and their gradients."""

from __future__ import annotations

import math

import torch

from quark.torch.compat import fake_quantize_learnable_backward
from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.formats.grouping import (
    channel_view,
    compilable,
    compiled_kernels_active,
    look_for_steady,
    round_to_int,
    steady_key,
)

#: The TQT / LSQ kernels compile in auto mode from ``Backend.min_numel`` elements, as most kernels do. Forward and
#: backward through autograd, per tensor, 2 cores: at 2^15 elements 247 / 308 us eagerly (TQT / LSQ) against 148 / 135
#: compiled, at 2^19 2.0 / 4.9 ms against 0.43 / 0.46 (docs/performance.md, fifteenth round). A short run (the digits
#: CNN's ``w4a8_tqt``) stays eager through the run plan (``grouping.plan_step_end``).

__all__ = ["TQTFunction", "LSQFunction"]


@compilable
def _tqt_forward(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int, round_method: RoundType) -> torch.Tensor:
    """``clamp(round(x / s), qmin, qmax) * s`` with ``s`` (powers of two) broadcastable to ``x``: one pass when
    compiled (eagerly four; the division and the product by a power of two are exact either way)."""
    return round_to_int(x / s, round_method).clamp(qmin, qmax) * s


@compilable
def _tqt_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    s: torch.Tensor,
    qmin: int,
    qmax: int,
    round_method: RoundType,
    dims: tuple[int, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TQT's gradients before the factor ``s ln2``: ``grad`` where ``round(x / s)`` is inside [qmin, qmax] (else 0),
    and the sum of ``grad * (round(x/s) - x/s)`` inside, ``grad * qmin`` / ``grad * qmax`` where clipped, over
    everything (``dims`` None) or over ``dims``. One pass when compiled: torch's fused learnable backward writes three
    tensors of ``x``'s size and reduces two of them (7.7 against 0.19 ms at 2^20 elements, 2 cores)."""
    v = x / s
    r = round_to_int(v, round_method)
    inside = (r >= qmin) & (r <= qmax)
    grad_x = grad * inside  # (-0.0 where a negative gradient is masked, as torch's fused backward gives)
    local = torch.where(inside, r - v, torch.where(r < qmin, torch.full_like(v, qmin), torch.full_like(v, qmax)))
    g = grad * local
    return grad_x, (g.sum() if dims is None else g.sum(dim=dims))


def _reduce_dims(ndim: int, axis: int | None) -> tuple[int, ...] | None:
    """The dimensions a learned value's gradient is summed over: all (None) per tensor, all but ``axis`` per channel."""
    return None if axis is None else tuple(d for d in range(ndim) if d != axis % ndim)


class TQTFunction(torch.autograd.Function):
    """TQT forward ``clamp(round(x / s), n, p) * s`` with ``s = 2^ceil(log2 t) / 2^(b-1)``; the paper's gradients:
    x: 1 inside [n, p], else 0; log2 t: ``s ln2 (round(x/s) - x/s)`` inside, ``s ln2 n`` / ``s ln2 p`` when clipped,
    summed over the tensor (per tensor) or over everything but ``axis`` (one threshold per channel).

    Only ``x`` and ``s`` are saved. Where the compiled kernels run (``Backend``: tensors of at least
    ``Backend.min_numel`` elements, after auto mode's warm-up) forward and backward are one compiled pass each
    (``_tqt_forward``, ``_tqt_grad``); given ``steady`` (the caller's dicts of direct kernels and call counts per input
    signature, as ``look_for_steady`` keeps them), a signature the kernel cache serves directly has its direct kernels
    called straight, without the cache's signature lookup. Eagerly, per tensor with half-even rounding the backward is torch's fused
    learnable fake-quant backward (its scale gradient is ``round(x/s) - x/s`` inside and n / p when clipped, exactly
    the paper's term before the factor ``s ln2``; ``x / s`` and ``x * (1/s)`` agree because ``s`` is a power of two);
    the other cases compute the same terms eagerly. Every path gives the same forward and input gradient bits; the
    threshold's gradient is a sum, whose rounding depends on the order each path adds in.
    """

    @staticmethod
    def forward(ctx, x, log2_t, qmin, qmax, frac_bits, round_method=RoundType.half_even, axis=None, steady=None):  # type: ignore[override]
        s = torch.exp2(torch.ceil(log2_t) - frac_bits)
        sv = s if axis is None else channel_view(s, x.ndim, axis)
        ctx.save_for_backward(x, s)
        ctx.meta = (qmin, qmax, round_method, axis)
        ctx.steady = None
        args = (x, sv, qmin, qmax, round_method)
        key = None if steady is None else steady_key(x)
        if key is None:
            return _tqt_forward(*args)
        key = (*key, sv.shape, sv.stride(), sv.dtype)
        found = steady[0].get(key)
        if found is not None:  # a signature called often: its direct kernels, called straight
            ctx.steady = found
            return found.forward(args)
        out = _tqt_forward(*args)
        if compiled_kernels_active(x, count=False):
            look_for_steady(steady[0], steady[1], key, _tqt_forward, args)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, s = ctx.saved_tensors
        qmin, qmax, round_method, axis = ctx.meta
        # with create_graph the backward is itself differentiated: its terms as eager ops (a compiled kernel's graph
        # cannot be differentiated twice), which see x and treat the saved scale as a constant, as before
        higher_order = torch.is_grad_enabled()
        sv = s if axis is None else channel_view(s, x.ndim, axis)
        dims = _reduce_dims(x.ndim, axis)
        if ctx.steady is not None and not higher_order:
            grad_x, grad_s = ctx.steady.backward_call(_tqt_grad, (grad, x, sv, qmin, qmax, round_method, dims))
        elif (
            axis is None
            and round_method == RoundType.half_even
            and not torch.compiler.is_compiling()  # torch's fused op has no fake-tensor kernel to be traced through
            and not compiled_kernels_active(x)
        ):
            zero = torch.zeros_like(s)
            grad_x, grad_s, _ = fake_quantize_learnable_backward(
                grad.contiguous(), x.contiguous(), s, zero, qmin, qmax, 1.0
            )
        else:
            kernel = _tqt_grad.__wrapped__ if higher_order else _tqt_grad  # type: ignore[attr-defined]
            grad_x, grad_s = kernel(grad, x, sv, qmin, qmax, round_method, dims)
        grad_t = grad_s.reshape_as(s) * s * math.log(2.0)
        return grad_x, grad_t, None, None, None, None, None, None


@compilable
def _lsq_forward(
    x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int, round_method: RoundType
) -> torch.Tensor:
    """``(clamp(round(x * (1/s)) + z) - z) * s`` with ``s`` and ``z`` broadcastable to ``x``: one pass when compiled."""
    xq = round_to_int(x * torch.reciprocal(s), round_method) + z
    return (xq.clamp(qmin, qmax) - z) * s


@compilable
def _lsq_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    s: torch.Tensor,
    z: torch.Tensor,
    qmin: int,
    qmax: int,
    round_method: RoundType,
    dims: tuple[int, ...] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LSQ's gradients before the factor ``grad_factor``, the codes recomputed from ``x`` (``LSQFunction``'s terms):
    ``grad`` where the code is inside [qmin, qmax], and the sum of ``grad * ((xfq - x) / s)`` inside, ``grad * (qmin
    - z)`` / ``grad * (qmax - z)`` where clipped, over everything (``dims`` None) or over ``dims``. One pass when
    compiled."""
    inv = torch.reciprocal(s)
    xq = round_to_int(x * inv, round_method) + z
    xfq = (xq.clamp(qmin, qmax) - z) * s
    below, above = xq < qmin, xq > qmax
    grad_x = grad * ~(below | above)
    local = torch.where(below, qmin - z, torch.where(above, qmax - z, (xfq - x) * inv))
    g = grad * local
    return grad_x, (g.sum() if dims is None else g.sum(dim=dims))


class LSQFunction(torch.autograd.Function):
    """LSQ with the gradients of torch's ``_fake_quantize_learnable_per_{tensor,channel}_affine``.

    Where the compiled kernels run (``Backend``: tensors of at least ``Backend.min_numel`` elements, after auto mode's
    warm-up) forward and backward are one compiled pass each (``_lsq_forward``, ``_lsq_grad``), and only ``x`` is kept
    for the backward (the codes are recomputed from it); eagerly the codes and the fake-quantized tensor are kept.
    Both give the same forward and input-gradient bits; the scale's gradient is a sum, whose rounding depends on the
    order each path adds in (and the compiled one applies ``grad_factor`` to the sum, not to each term).
    """

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, grad_factor, axis, round_method=RoundType.half_even):  # type: ignore[override]
        s = scale if axis is None else channel_view(scale, x.ndim, axis)
        z = zero_point if axis is None else channel_view(zero_point, x.ndim, axis)
        ctx.meta = (qmin, qmax, grad_factor, axis, round_method)
        ctx.fused = compiled_kernels_active(x)
        if ctx.fused:
            ctx.save_for_backward(x, s, z)
            return _lsq_forward(x, s, z, qmin, qmax, round_method)
        inv = torch.reciprocal(s)
        xq = round_to_int(x * inv, round_method) + z
        # (the output is not saved: an in-place op on it, ReLU(inplace=True), must not change what the backward reads)
        ctx.save_for_backward(x, xq, s, inv, z)
        return (xq.clamp(qmin, qmax) - z) * s

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        qmin, qmax, grad_factor, axis, round_method = ctx.meta
        dims = _reduce_dims(grad.ndim, axis)
        if ctx.fused and not torch.is_grad_enabled():
            x, s, z = ctx.saved_tensors
            grad_x, grad_s = _lsq_grad(grad, x, s, z, qmin, qmax, round_method, dims)
            return grad_x, _lsq_scale_grad(grad_s * grad_factor, axis), None, None, None, None, None, None
        # eagerly, or with create_graph (a compiled kernel's graph cannot be differentiated twice): the terms as ops,
        # the codes, the reciprocal and the fake-quantized values constants (computed in the forward, as before)
        if ctx.fused:
            x, s, z = ctx.saved_tensors
            with torch.no_grad():
                inv = torch.reciprocal(s)
                xq = round_to_int(x * inv, round_method) + z
        else:
            x, xq, s, inv, z = ctx.saved_tensors
        with torch.no_grad():
            xfq = (xq.clamp(qmin, qmax) - z) * s
        below, above = xq < qmin, xq > qmax
        grad_x = grad * ~(below | above)
        local = torch.where(below, qmin - z, torch.where(above, qmax - z, (xfq - x) * inv))
        g = grad * local * grad_factor
        grad_s = g.sum() if dims is None else g.sum(dim=dims)
        return grad_x, _lsq_scale_grad(grad_s, axis), None, None, None, None, None, None


def _lsq_scale_grad(grad_s: torch.Tensor, axis: int | None) -> torch.Tensor:
    """The scale's gradient in the learned Parameter's shape: (1,) per tensor, (channels,) per channel."""
    return grad_s.reshape(1) if axis is None else grad_s
