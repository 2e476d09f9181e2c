"""The autograd Functions of the learnable quantizers: TQT's and LSQ's fake quantization and their gradients."""

from __future__ import annotations

import math

import torch

from quark.torch.compat import fake_quantize_learnable_backward
from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.formats.grouping import channel_view, round_to_int

__all__ = ["TQTFunction", "LSQFunction"]


class TQTFunction(torch.autograd.Function):
    """TQT forward ``clamp(round(x / s), n, p) * s`` with ``s = 2^ceil(log2 t) / 2^(b-1)``; the paper's gradients:
    x: 1 inside [n, p], else 0; log2 t: ``s ln2 (round(x/s) - x/s)`` inside, ``s ln2 n`` / ``s ln2 p`` when clipped,
    summed over the tensor (per tensor) or over everything but ``axis`` (one threshold per channel).

    Only ``x`` and ``s`` are saved. Per tensor with half-even rounding the backward is torch's fused learnable
    fake-quant backward (its scale gradient is ``round(x/s) - x/s`` inside and n / p when clipped, exactly the paper's
    term before the factor ``s ln2``; ``x / s`` and ``x * (1/s)`` agree because ``s`` is a power of two); the other
    cases recompute the same terms here.
    """

    @staticmethod
    def forward(ctx, x, log2_t, qmin, qmax, frac_bits, round_method=RoundType.half_even, axis=None):  # type: ignore[override]
        s = torch.exp2(torch.ceil(log2_t) - frac_bits)
        sv = s if axis is None else channel_view(s, x.ndim, axis)
        ctx.save_for_backward(x, s)
        ctx.meta = (qmin, qmax, round_method, axis)
        return round_to_int(x / sv, round_method).clamp_(qmin, qmax).mul_(sv)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, s = ctx.saved_tensors
        qmin, qmax, round_method, axis = ctx.meta
        # (inside torch.compile the terms below: torch's fused op has no fake-tensor kernel to be traced through)
        if axis is None and round_method == RoundType.half_even and not torch.compiler.is_compiling():
            zero = torch.zeros_like(s)
            grad_x, grad_s, _ = fake_quantize_learnable_backward(
                grad.contiguous(), x.contiguous(), s, zero, qmin, qmax, 1.0
            )
        else:
            v = x / (s if axis is None else channel_view(s, x.ndim, axis))
            r = round_to_int(v, round_method)
            inside = (r >= qmin) & (r <= qmax)
            grad_x = grad * inside
            local = torch.where(
                inside, r - v, torch.where(r < qmin, torch.full_like(v, qmin), torch.full_like(v, qmax))
            )
            g = grad * local
            grad_s = g.sum() if axis is None else g.sum(dim=[d for d in range(x.ndim) if d != axis % x.ndim])
        grad_t = grad_s.reshape_as(s) * s * math.log(2.0)
        return grad_x, grad_t, None, None, None, None, None


class LSQFunction(torch.autograd.Function):
    """LSQ with the gradients of torch's ``_fake_quantize_learnable_per_{tensor,channel}_affine``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, grad_factor, axis, round_method=RoundType.half_even):  # type: ignore[override]
        s = scale if axis is None else channel_view(scale, x.ndim, axis)
        z = zero_point if axis is None else channel_view(zero_point, x.ndim, axis)
        inv = torch.reciprocal(s)
        xq = round_to_int(x * inv, round_method) + z
        xfq = (xq.clamp(qmin, qmax) - z) * s
        ctx.save_for_backward(x, xq, xfq, inv, z)
        ctx.meta = (qmin, qmax, grad_factor, axis)
        return xfq

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, xq, xfq, inv, z = ctx.saved_tensors
        qmin, qmax, grad_factor, axis = ctx.meta
        below, above = xq < qmin, xq > qmax
        grad_x = grad * ~(below | above)
        local = torch.where(below, qmin - z, torch.where(above, qmax - z, (xfq - x) * inv))
        g = grad * local * grad_factor
        if axis is None:
            grad_s = g.sum().reshape(1)
        else:
            dims = [d for d in range(x.ndim) if d != axis % x.ndim]
            grad_s = g.sum(dim=dims)
        return grad_x, grad_s, None, None, None, None, None, None
