"""Observe and fake-quantize in one compiled pass: a min-max observer's statistics, their fold into the running ones,
the qparams and the quantize -> dequantize of the same tensor.

While observers are on (QAT warm-up, dynamic quantization) a quantizer otherwise makes two kernel calls (the
statistics, then the rounding) with some 30 small eager ops between them to fold the statistics and turn them into
qparams. Traced as one ``torch.compile``d kernel they are three loops of one call: the small ops cost no dispatch
(see README, *Performance*, for what it measured). The input is still read twice: inductor does not fuse a row's
reduction with its rounding here. The arithmetic is the observers' (``MinMaxPlan``)
and the formats' (``fake_quantize``), traced, so the bits are the eager path's
(tests/quark/quantization/test_observe_quantize.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from quark.torch.quantization import late_flag
from quark.torch.quantization.config.type import Dtype, RoundType
from quark.torch.quantization.formats import fake_quantize, fake_quantize_grad, gradient_passes, scale_dtype
from quark.torch.quantization.formats.grouping import (
    Backend,
    SteadyKernels,
    compilable,
    compiled_kernels_active,
    fast_apply,
    look_for_steady,
    steady_key,
)
from quark.torch.quantization.observer.observer import MinMaxPlan

__all__ = [
    "FusedPlan",
    "FUSED_FRACTION",
    "fused_pass_active",
    "fused_plan",
    "observe_fake_quantize",
    "scale_may_have_saturated",
    "steady_fused",
]

#: in auto mode the fused pass runs for inputs of at least ``Backend.min_numel // FUSED_FRACTION`` elements (4096 by
#: default; smaller ones take the eager path). It replaces some 30 eager ops, so it pays well below the single format
#: kernels' threshold: per-tensor int8 on 2 cores, 4096 elements 141 against 136 us, 16384: 141 against 204 us
FUSED_FRACTION = 8


@dataclass(frozen=True)
class FusedPlan:
    """The observer's plan and the format's rounding: everything the fused kernel depends on besides the tensors."""

    observer: MinMaxPlan
    dtype: Dtype
    round_method: RoundType | None

    def quantize_kwargs(self) -> dict[str, Any]:
        """``fake_quantize``'s layout and rounding arguments."""
        o = self.observer
        return {"qscheme": o.qscheme, "axis": o.ch_axis, "group_size": o.group_size, "round_method": self.round_method}


@cache
def fused_plan(observer: MinMaxPlan, dtype: Dtype, round_method: RoundType | None) -> FusedPlan:
    """One ``FusedPlan`` object per distinct plan, so a compiled kernel's guards see the same object for every layer."""
    return FusedPlan(observer, dtype, round_method)


def fused_pass_active(x: torch.Tensor) -> bool:
    """Whether the fused pass runs for ``x`` now: where the compiled kernels run (``Backend``, with this pass's own
    auto-mode threshold), not inside a caller's ``torch.compile`` (there the eager path is traced and fuses anyway)."""
    return compiled_kernels_active(x, Backend.min_numel // FUSED_FRACTION)


#: a scale held in bfloat16 / float16 is used in float32 arithmetic in the same kernel: by default inductor would skip
#: that rounding (it keeps fused intermediates in float32), giving other bits than eager
@compilable(min_numel=0, options={"emulate_precision_casts": True})  # fused_pass_active chose already
def _observe_fake_quantize(
    x: torch.Tensor, min_val: torch.Tensor, max_val: torch.Tensor, plan: FusedPlan
) -> tuple[torch.Tensor, ...]:
    """(fake-quantized x, scale, zero point, whether this batch's statistics are finite, the running minimum and
    maximum after observing ``x``: as they were when the batch is not finite, and the qparams theirs; whether the
    straight-through gradient passes unchanged at every element of ``x``). A pure function of its tensors (the
    caller writes the statistics back), so a signature called often can be served directly (``direct_kernel``)."""
    obs = plan.observer
    mn, mx = obs.statistics(x)
    finite = torch.isfinite(mn).all() & torch.isfinite(mx).all()
    new_min, new_max = obs.fold(min_val, max_val, mn, mx)
    # a batch with NaN or Inf leaves the statistics as they were, and the qparams follow them: on CUDA the caller
    # reads ``finite`` a few forwards late (``LateFlag``), so nothing this batch computed may outlive its forward
    new_min, new_max = torch.where(finite, new_min, min_val), torch.where(finite, new_max, max_val)
    scale, zp = obs.qparams(new_min, new_max, x.dtype)
    out = fake_quantize(x, plan.dtype, scale, zp, **plan.quantize_kwargs())
    # every element of a finite x lies between the folded extremes of its own cell, which hold the same qparams: where
    # both extremes are inside the format's range, so is all of x, and its gradient is the incoming one unchanged
    passes = gradient_passes(new_min, plan.dtype, scale, zp, plan.round_method)
    passes = finite & passes & gradient_passes(new_max, plan.dtype, scale, zp, plan.round_method)
    return out, scale, zp, finite, new_min, new_max, passes


@compilable(min_numel=0, options={"emulate_precision_casts": True})  # the forward was fused: so is its gradient
def _observe_fake_quantize_grad(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, plan: FusedPlan
) -> torch.Tensor:
    """``fake_quantize``'s straight-through gradient, recomputed from the saved input in one compiled pass at every
    size the forward was fused for: eagerly, the mask and the layout of the qparams are some ten ops, which cost
    more than the pass itself below ``Backend.min_numel`` (a 32x1024 activation: 47 against 28 us a backward)."""
    return fake_quantize_grad(grad, x, plan.dtype, scale, zp, **plan.quantize_kwargs())


class _ObserveFakeQuant(torch.autograd.Function):
    """The fused forward; the gradient is ``fake_quantize``'s straight-through one, recomputed from the saved input
    in a compiled pass of its own. With ``steady`` (``SteadyKernels``), both are its direct kernels, called straight
    (the caller's steady path, ``steady_fused``). On CPU, where the kernel found the whole input inside the format's
    range (``passes``: a host read there costs no wait), the gradient is the incoming one as it is: no backward pass,
    and the input is not kept for one. An fp8 per-tensor quantizer's input lies inside about nine batches in ten
    (scale = amax / 448 maps the extreme onto 448 or an ulp past it); a symmetric int8 per-channel weight's rarely
    (each row's positive extreme maps onto 127.5, which rounds to 128)."""

    @staticmethod
    def forward(ctx, x, min_val, max_val, plan, steady):  # type: ignore[override]
        # a Parameter goes in as it is: dynamo pins its shape, and a kernel built for a weight's static shape is
        # faster than the dynamic one (4096x1024 int8 per channel: 3.0 against 3.4 ms from DRAM)
        if steady is not None:
            out, scale, zp, finite, new_min, new_max, passes = steady.forward((x, min_val, max_val, plan))
        else:
            out, scale, zp, finite, new_min, new_max, passes = _observe_fake_quantize(x, min_val, max_val, plan)
        min_val.copy_(new_min)
        max_val.copy_(new_max)
        ctx.mark_non_differentiable(scale, zp, finite)
        ctx.plan, ctx.steady = plan, steady
        # on CPU only (on an accelerator the read would wait for the device: there the mask is recomputed, which costs
        # little bandwidth); not for float64, whose masked gradient goes through float32 and so is not ``grad`` itself
        ctx.unchanged = (
            ctx.needs_input_grad[0]
            and x.device.type == "cpu"
            and not late_flag.defers(x.device)
            and x.dtype != torch.float64
            and bool(passes)
        )
        if ctx.needs_input_grad[0] and not ctx.unchanged:
            ctx.save_for_backward(x, scale, zp)
        return out, scale, zp, finite

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        if ctx.unchanged:  # the mask is all ones: grad * 1 is grad, bit for bit
            return grad, None, None, None, None
        x, scale, zp = ctx.saved_tensors
        args = (grad, x, scale, zp, ctx.plan)
        if ctx.steady is not None:
            return ctx.steady.backward_call(_observe_fake_quantize_grad, args), None, None, None, None
        return _observe_fake_quantize_grad(*args), None, None, None, None


_observe_fake_quant = fast_apply(_ObserveFakeQuant)


def observe_fake_quantize(
    x: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    plan: FusedPlan,
    steady: SteadyKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Observe ``x`` into the running statistics ``min_val`` / ``max_val`` (updated in place; left as they were where
    this batch has NaN or Inf) and fake-quantize it with the qparams that gives: (out, scale, zero point, finite: a
    bool tensor the caller checks). Differentiable in ``x`` (straight-through). ``steady``: the direct kernels of
    this call's signature (``steady_fused``), called straight."""
    return _observe_fake_quant(x, min_val, max_val, plan, steady)


def steady_fused(
    kernels: dict[tuple[Any, ...], SteadyKernels],
    calls: dict[tuple[Any, ...], int],
    x: torch.Tensor,
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    plan: FusedPlan,
) -> SteadyKernels | None:
    """The direct kernels serving this fused call, kept in the caller's ``kernels`` (a quantizer observes tensors of
    one signature every step of a QAT warm-up): found once the kernel cache serves the signature directly (looked
    for as ``look_for_steady`` says, counting in ``calls``). None where the call takes the normal path."""
    key = steady_key(x)
    if key is None:
        return None
    # the plan by identity (``fused_plan`` keeps one object per plan alive; hashing its fields costs more)
    key = (
        *key,
        id(plan),
        min_val.shape,
        min_val.stride(),
        min_val.dtype,
        max_val.shape,
        max_val.stride(),
        max_val.dtype,
    )
    found = kernels.get(key)
    if found is None:  # (one found now serves from the next call)
        look_for_steady(kernels, calls, key, _observe_fake_quantize, (x, min_val, max_val, plan))
    return found


def scale_may_have_saturated(plan: FusedPlan, scale: torch.Tensor, model_dtype: torch.dtype) -> bool:
    """Whether a scale held in a narrower float than float32 reached that type's largest value, where the eager path
    would have warned (the traced kernel cannot): the caller then recomputes the qparams eagerly, which warns."""
    held = scale_dtype(plan.observer.scale_type, model_dtype)
    return held != torch.float32 and bool((scale >= torch.finfo(held).max).any())
