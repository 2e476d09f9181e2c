"""The gradient of an absmax scale for rotation training.

The engine's quantizers compute their qparams from detached statistics (observers), so a quantized forward passes
the straight-through gradient of the rounding only: for a loss of a quantized model whose float function does not
depend on the rotation, that gradient carries no information on how the rotation changes the ranges. SpinQuant's
quantizers compute the scale ``s = absmax(x) / qmax`` from ``x`` itself; with a straight-through rounding,
``d(s round(x / s)) / ds = (q - x) / s``. This hook replaces a symmetric quantizer's output (per tensor, per channel,
or per group spanning its whole axis, as per-token activations are) by ``x + (q - x).detach() * r`` with
``r = absmax(x) / absmax(x).detach()``: the same value, the gradient of ``s * STE(clamp(round(x / s)))`` with ``s``
differentiated (straight through the rounding and the clamp, gradient 1 to ``x`` everywhere). Other schemes keep the
quantizer's own gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase

__all__ = ["reduce_dims", "add_scale_gradient"]


def reduce_dims(quantizer: FakeQuantizeBase, x: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions the quantizer's absmax runs over for ``x``, None where the scale is not such an absmax."""
    spec = quantizer.spec
    if not spec.symmetric or x.dim() == 0:
        return None
    if spec.qscheme == QSchemeType.per_tensor:
        return tuple(range(x.dim()))
    axis = None if spec.ch_axis is None else spec.ch_axis % x.dim()
    if spec.qscheme == QSchemeType.per_channel and axis is not None:
        return tuple(d for d in range(x.dim()) if d != axis)
    if spec.qscheme == QSchemeType.per_group and axis is not None and (spec.group_size or 0) >= x.shape[axis]:
        return (axis,)
    return None


def add_scale_gradient(quantizer: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    """A forward hook of a quantizer (see the module): ``out`` with the absmax scale's gradient added."""
    if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    x = args[0]
    if not x.requires_grad or not isinstance(quantizer, FakeQuantizeBase) or not quantizer.flag("fake_quant_enabled"):
        return None
    dims = reduce_dims(quantizer, x)
    if dims is None:
        return None
    absmax = x.abs().amax(dim=dims, keepdim=True)
    ratio = absmax / absmax.detach().clamp_min(torch.finfo(absmax.dtype).tiny)
    return x + (out - x).detach() * ratio
