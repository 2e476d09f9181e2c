"""Observers: statistics of a tensor -> (scale, zero_point). One class per entry of Quark's observer doc.

Conventions (Quark's): symmetric integer scale = max(|min|, |max|) / ((qmax - qmin) / 2); asymmetric scale =
(max - min) / (qmax - qmin) with zero point ``qmin - round(min / scale)`` (int32, clamped) or ``qmin - min / scale``
(float32); minifloat scale = amax / max_normal. Ranges always include 0; a constant or all-zero tensor gives a finite
positive scale (>= eps); NaN or Inf in an observed tensor raises ValueError naming the layer and role (``where``,
set with the observer's quantizer). Every finite input up to float32's largest gives a finite scale: spans and
errors that would overflow float32 are computed in float64, histograms over the range normalised to [-1, 1], and
float16 / bfloat16 scales saturate (``apply_scale_type``). Static observers keep running statistics across batches;
dynamic ones (``is_dynamic=True``) recompute them on every call.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quark.torch.quantization.buffers import ResizableBuffersMixin
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType, ZeroPointType
from quark.torch.quantization.formats import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    FloatFormat,
    IntFormat,
    aminmax_along,
    apply_scale_type,
    bfp_codes,
    fake_quantize_int,
    fake_quantize_minifloat,
    format_of,
    mx_shared_exponent,
    to_blocks,
    to_tiles,
)
from quark.torch.quantization.observer.registry import OBSERVER_MAP, register_observer

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = [
    "ObserverBase",
    "PlaceholderObserver",
    "UniformScalingObserver",
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerBlockMXObserver",
    "PerBlockBFPObserver",
    "PerGroupMinMaxObserver",
    "PerBlock2DMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "TQTObserver",
    "LSQObserver",
    "threshold_3sd",
    "threshold_kl_j",
    "OBSERVER_CLASSES",
    "OBSERVER_MAP",
]

_EPS = torch.finfo(torch.float32).eps
_MAX_STAT_DIMS = 8  # the most dimensions statistics of min-max observers have (per group of a high-rank tensor)


def _is_scaled(dtype: Dtype) -> bool:
    return isinstance(format_of(dtype), IntFormat | FloatFormat)


def _check_finite(who: str, *values: torch.Tensor) -> None:
    """Raise when statistics carry NaN/Inf (cheap: checks reduced values, not the whole tensor); ``who`` names the
    observer and, once its quantizer is placed, the layer and role (``ObserverBase.who``)."""
    for v in values:
        finite = math.isfinite(v.item()) if v.numel() == 1 else bool(torch.isfinite(v).all())
        if not finite:
            _raise_non_finite(who)


def _raise_non_finite(who: str) -> None:
    raise ValueError(
        f"{who} observed a tensor containing NaN or Inf (or float64 values past float32's range, the statistics' "
        "type); its scale would be NaN or Inf. "
        "Check the inputs and activations of this layer (e.g. torch.isfinite(x).all())."
    )


def minmax_qparams(
    min_val: torch.Tensor,
    max_val: torch.Tensor,
    fmt: IntFormat | FloatFormat,
    symmetric: bool | None,
    eps: float,
    scale_type: ScaleType | None,
    zero_point_type: ZeroPointType | None,
    model_dtype: torch.dtype,
    who: str = "a quantizer",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of the range [min_val, max_val] extended to include 0 (the conventions above), held as
    ``scale_type`` says. Pure tensor arithmetic: the observers' ``calculate_qparams`` and the fused observe-and-quantize
    kernel (which traces it) share it."""
    min_neg = torch.clamp(min_val.float(), max=0.0)
    max_pos = torch.clamp(max_val.float(), min=0.0)
    if isinstance(fmt, FloatFormat):
        amax = torch.maximum(-min_neg, max_pos)
        scale = apply_scale_type(torch.clamp(amax / fmt.max_normal, min=eps), scale_type, model_dtype, who)
        return scale, torch.zeros_like(scale, dtype=torch.int32)
    qmin, qmax = fmt.qmin, fmt.qmax
    if symmetric:
        amax = torch.maximum(-min_neg, max_pos)
        scale = apply_scale_type(torch.clamp(amax / ((qmax - qmin) / 2), min=eps), scale_type, model_dtype, who)
        zp = 0 if fmt.signed else (qmin + qmax + 1) // 2
        return scale, torch.full_like(scale, zp, dtype=torch.int32)
    span = (max_pos - min_neg) / float(qmax - qmin)  # float32, as amd-quark computes it (bit for bit)
    # max - min overflows float32 for ranges past ~1.7e38 on both sides of 0: there, the span in float64
    span = torch.where(torch.isfinite(span), span, ((max_pos.double() - min_neg.double()) / float(qmax - qmin)).float())
    scale = apply_scale_type(torch.clamp(span, min=eps), scale_type, model_dtype, who)
    if zero_point_type == ZeroPointType.float32:
        return scale, qmin - min_neg / scale
    zp = qmin - torch.round(min_neg / scale)
    return scale, zp.clamp(qmin, qmax).to(torch.int32)


def channel_minmax(x: torch.Tensor, ch_axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum of each slice of ``x`` along ``ch_axis`` (shape [C])."""
    y = x.reshape(1) if x.ndim == 0 else x
    y = y.movedim(ch_axis, 0).reshape(y.shape[ch_axis], -1)  # [C, rest]
    return aminmax_along(y, 1)


def group_minmax(x: torch.Tensor, ch_axis: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum and maximum of each group of ``group_size`` along ``ch_axis`` (shape [..., n_groups])."""
    xb, _ = to_blocks(x, ch_axis, group_size)  # [..., G, g]
    return aminmax_along(xb, -1)


@dataclass(frozen=True)
class MinMaxPlan:
    """What a min-max observer's statistics and qparams depend on besides the data, as pure functions: the quantizer's
    fused observe-and-quantize kernel traces them (equal plans share one compiled kernel, whatever the layer)."""

    qscheme: QSchemeType
    ch_axis: int | None
    group_size: int | None
    dynamic: bool
    fmt: IntFormat | FloatFormat
    symmetric: bool | None
    eps: float
    scale_type: ScaleType | None
    zero_point_type: ZeroPointType | None

    def statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's (min, max) in the observer's granularity, float32."""
        if self.qscheme == QSchemeType.per_channel:
            mn, mx = channel_minmax(x, self.ch_axis)  # type: ignore[arg-type]
        elif self.qscheme == QSchemeType.per_group:
            mn, mx = group_minmax(x, self.ch_axis, self.group_size)  # type: ignore[arg-type]
        else:
            mn, mx = torch.aminmax(x)
        return mn.float(), mx.float()

    def statistics_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The shape ``statistics`` gives for a tensor of ``shape``."""
        if self.qscheme == QSchemeType.per_channel:
            return (shape[self.ch_axis],) if len(shape) else (1,)  # type: ignore[index]
        if self.qscheme == QSchemeType.per_group:
            dims = list(shape) or [1]
            length = dims.pop(self.ch_axis)  # type: ignore[arg-type]
            return (*dims, -(-length // self.group_size))  # type: ignore[operator]
        return ()

    def fold(
        self, prev_min: torch.Tensor, prev_max: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics after this batch: running extremes, or this batch's alone when dynamic."""
        if self.dynamic:
            return mn, mx
        return torch.minimum(prev_min, mn), torch.maximum(prev_max, mx)

    def qparams(
        self, min_val: torch.Tensor, max_val: torch.Tensor, model_dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return minmax_qparams(
            min_val, max_val, self.fmt, self.symmetric, self.eps, self.scale_type, self.zero_point_type, model_dtype
        )


class ObserverBase(ResizableBuffersMixin, nn.Module):
    """Base of every observer: ``forward(x)`` records statistics and returns ``x``; ``calculate_qparams()``.

    Buffers whose shape depends on the data (per-channel statistics) are resized when a state_dict is loaded.
    """

    #: qschemes this observer can serve (None: also block formats without a qscheme)
    qschemes: frozenset[QSchemeType] = frozenset()
    #: the layer and role observed (set with its quantizer's ``where`` by ModelQuantizer.prepare; "" standalone)
    where: str = ""

    def __init_subclass__(cls, method: str | None = None, **kwargs: Any) -> None:
        """Register every public subclass by class name (``method``: amd-quark's ``observer_method`` name for it)."""
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):
            register_observer(cls, method)

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__()
        self.qspec = qspec
        self.dtype = qspec.dtype

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        """Whether this observer can determine qparams for ``dtype`` with ``qscheme``."""
        return False

    @property
    def who(self) -> str:
        """This observer in error messages: ``"layer 'fc1' (Linear, input_tensors): PerTensorMinMaxObserver"``."""
        return f"{self.where}: {type(self).__name__}" if self.where else type(self).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def minmax_plan(self) -> MinMaxPlan | None:
        """The pure form of this observer's statistics and qparams, for the fused observe-and-quantize pass; None
        (the default) where there is none."""
        return None

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's name for ``calculate_qparams()``."""
        return self.calculate_qparams()

    def reset_state(self) -> None:
        """Forget every statistic."""

    def sync(self, group: Any = None) -> None:
        """Reduce the statistics across the ranks of ``group`` so every rank computes the same qparams.

        No-op unless torch.distributed is initialized; statistics-free observers have nothing to reduce.
        """

    @staticmethod
    def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(tensor, op=op, group=group)
        return tensor


class PlaceholderObserver(ObserverBase):
    """Observer only passes its configuration on: for casts (float16, bfloat16) and block formats, whose scales
    come from the data itself."""

    qschemes = frozenset(QSchemeType)

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype in CAST_FORMATS or dtype in BLOCK_FORMATS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(()), torch.zeros((), dtype=torch.int32)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype.name}"


class UniformScalingObserver(ObserverBase):
    """Observer for uniform scaling quantizers (integers of any width, minifloats with a scale).

    Holds running ``min_val`` / ``max_val`` buffers; subclasses decide their granularity.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device)
        self.symmetric = qspec.symmetric
        self.scale_type = qspec.scale_type
        self.qscheme = qspec.qscheme
        self.is_dynamic = bool(qspec.is_dynamic)
        self.zero_point_type = qspec.zero_point_type
        self.eps = eps
        self.fmt = format_of(qspec.dtype)
        self.model_dtype = torch.float32
        self.register_buffer("min_val", torch.tensor(float("inf"), device=device))
        self.register_buffer("max_val", torch.tensor(float("-inf"), device=device))

    def _update(self, min_val: torch.Tensor, max_val: torch.Tensor, x: torch.Tensor) -> None:
        """Fold new statistics into the running ones (or replace them when dynamic)."""
        min_val, max_val = min_val.float(), max_val.float()  # float64 past float32's range becomes inf: refused
        _check_finite(self.who, min_val, max_val)
        self.model_dtype = x.dtype
        if self.min_val.shape != min_val.shape:  # first statistics of this shape (e.g. per channel): rebind once
            self.min_val, self.max_val = min_val.clone(), max_val.clone()
        elif self.is_dynamic:
            self.min_val.copy_(min_val)
            self.max_val.copy_(max_val)
        else:  # in place: running statistics without re-registering buffers on every batch
            torch.minimum(self.min_val, min_val, out=self.min_val)
            torch.maximum(self.max_val, max_val, out=self.max_val)

    def _apply(self, fn: Any, recurse: bool = True) -> UniformScalingObserver:
        """``.to(torch.bfloat16)`` (Lightning's ``precision="bf16-true"``) moves the statistics but keeps them float32:
        a range rounded to bfloat16 could come out narrower than the data and clip its extremes."""
        super()._apply(fn, recurse)
        for name in ("min_val", "max_val"):
            buf = self._buffers.get(name)
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                self._buffers[name] = buf.float()
        return self

    def fused_observed(self, x: torch.Tensor, finite: torch.Tensor) -> None:
        """Book a batch the quantizer's fused pass folded into the statistics (``observe_quantize``): raises
        ValueError naming the layer, as ``forward`` does, where it had NaN or Inf (the pass then left them as they
        were)."""
        if not bool(finite):
            _raise_non_finite(self.who)
        self.model_dtype = x.dtype

    @property
    def has_statistics(self) -> bool:
        return bool(torch.isfinite(self.min_val).all())

    def calculate_qparams(
        self, min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point of the range [min_val, max_val] (by default the observed one), extended to include 0."""
        if min_val is None or max_val is None:
            if not self.has_statistics:
                raise RuntimeError(f"{self.who} has observed no data yet; run calibration batches first")
            min_val, max_val = self.min_val, self.max_val
        return minmax_qparams(
            min_val,
            max_val,
            self.fmt,
            self.symmetric,
            self.eps,
            self.scale_type,
            self.zero_point_type,
            self.model_dtype,
            self.who,
        )

    def minmax_plan(self) -> MinMaxPlan | None:
        """This observer as a ``MinMaxPlan`` when its forward is exactly the plan's statistics and fold (the per-tensor,
        per-channel and per-group min-max observers; not subclasses, which may observe differently), else None."""
        qscheme = _PLANNED.get(type(self))
        if qscheme is None:
            return None
        return _minmax_plan(
            qscheme,
            getattr(self, "ch_axis", None),
            getattr(self, "group_size", None),
            self.is_dynamic,
            self.fmt,
            self.symmetric,
            self.eps,
            self.scale_type,
            self.zero_point_type,
        )

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._agree_on_shape(group)
        self._all_reduce(self.min_val, dist.ReduceOp.MIN, group)
        self._all_reduce(self.max_val, dist.ReduceOp.MAX, group)

    def _agree_on_shape(self, group: Any) -> None:
        """Give the statistics of a rank that has observed nothing (a scalar placeholder) the shape the others'
        have, so the reductions line up: an MoE expert, say, that only some ranks' batches reached. Ranks that
        observed differently shaped statistics are refused, naming the observer."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        own = tuple(self.min_val.shape) if self.has_statistics else None
        if own is not None and len(own) > _MAX_STAT_DIMS:
            raise ValueError(f"{self.who}: statistics of {len(own)} dimensions; at most {_MAX_STAT_DIMS} can be synced")
        # one MAX reduction gives the largest and (negated) the smallest [ndim, dims...] of the ranks that observed
        packed = torch.full((2, _MAX_STAT_DIMS + 1), -1, dtype=torch.int64, device=self.min_val.device)
        packed[1] = -(2**62)  # a rank without statistics takes no part in the minimum
        if own is not None:
            packed[0, : len(own) + 1] = torch.tensor([len(own), *own])
            packed[1] = -packed[0]
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        largest, smallest = packed[0].tolist(), (-packed[1]).tolist()
        if largest[0] < 0:
            return  # no rank has observed anything
        if largest != smallest:
            raise ValueError(
                f"{self.who}: the ranks observed statistics of different shapes ({largest} / {smallest} as "
                "[ndim, dims...]); every rank must quantize the same tensor layout"
            )
        shape = tuple(largest[1 : largest[0] + 1])
        if own is None and tuple(self.min_val.shape) != shape:
            self.min_val = torch.full(shape, float("inf"), device=self.min_val.device)
            self.max_val = torch.full(shape, float("-inf"), device=self.max_val.device)

    def reset_min_max_vals(self) -> None:
        """Resets the min/max values."""
        self.min_val = torch.tensor(float("inf"), device=self.min_val.device)
        self.max_val = torch.tensor(float("-inf"), device=self.max_val.device)

    def reset_state(self) -> None:
        self.reset_min_max_vals()

    def extra_repr(self) -> str:
        return f"dtype={self.dtype.name}, symmetric={self.symmetric}, dynamic={self.is_dynamic}"


class PerTensorMinMaxObserver(UniformScalingObserver, method="min_max"):
    """Running minimum and maximum of the whole tensor."""

    qschemes = frozenset({QSchemeType.per_tensor})

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return _is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Records the running minimum and maximum of ``x``."""
        if x_orig.numel():
            mn, mx = torch.aminmax(x_orig.detach())
            self._update(mn, mx, x_orig)
        return x_orig


class PerChannelMinMaxObserver(UniformScalingObserver):
    """Running minimum and maximum of each slice along ``ch_axis``."""

    qschemes = frozenset({QSchemeType.per_channel})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = qspec.ch_axis

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return _is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            mn, mx = channel_minmax(x_orig.detach(), self.ch_axis)
            self._update(mn, mx, x_orig)
        return x_orig


class PerGroupMinMaxObserver(UniformScalingObserver):
    """Minimum and maximum of each group of ``group_size`` along ``ch_axis`` (qparams [..., n_groups])."""

    qschemes = frozenset({QSchemeType.per_group})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = qspec.ch_axis
        self.group_size = qspec.group_size

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return _is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            mn, mx = group_minmax(x_orig.detach(), self.ch_axis, self.group_size)
            self._update(mn, mx, x_orig)
        return x_orig


#: the observers whose forward is ``MinMaxPlan``'s statistics and fold, and the qscheme it computes them for
_PLANNED: dict[type, QSchemeType] = {
    PerTensorMinMaxObserver: QSchemeType.per_tensor,
    PerChannelMinMaxObserver: QSchemeType.per_channel,
    PerGroupMinMaxObserver: QSchemeType.per_group,
}


@functools.cache
def _minmax_plan(*fields: Any) -> MinMaxPlan:
    return MinMaxPlan(*fields)  # one object per distinct plan: a compiled kernel's guards see the same one


class PerBlock2DMinMaxObserver(UniformScalingObserver):
    """Running minimum and maximum of each ``block_size = [rows, cols]`` tile of a 2-D tensor (``qscheme=per_block``,
    e.g. DeepSeek-V3's fp8 weights in 128 x 128 tiles): qparams of shape ``[ceil(R / rows), ceil(C / cols)]``, edge
    tiles partial.

    The qparams follow the per-tensor rules tile by tile: symmetric scale = amax / max_normal (minifloats) or
    amax / ((qmax - qmin) / 2) (integers); asymmetric integers get scale = (max - min) / (qmax - qmin) and a zero
    point per tile. amd-quark 0.13 has this class as a placeholder that raises on use.
    """

    qschemes = frozenset({QSchemeType.per_block})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self.block_size = qspec.block_size

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return _is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.ndim != 2:
            raise ValueError(
                f"{self.who}: qscheme=per_block (block_size={self.block_size}) needs a 2-D tensor "
                f"[rows, cols], got shape {tuple(x_orig.shape)}"
            )
        if x_orig.numel():
            xt, _ = to_tiles(x_orig.detach(), self.block_size)  # [n_rows, rows, n_cols, cols], zero-padded
            self._update(xt.amin(dim=(1, 3)), xt.amax(dim=(1, 3)), x_orig)
        return x_orig

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"


class PerBlockMXObserver(ObserverBase):
    """Block maxima of the MX formats (mx, mx6, mx9); qparams are the blocks' shared exponents.

    The block formats derive their scales from each block's data, so this observer only records them.
    """

    qschemes = frozenset({QSchemeType.per_group})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device)
        self.block_size = qspec.group_size
        self.axis = qspec.ch_axis
        self.is_dynamic = bool(qspec.is_dynamic)
        self.register_buffer("amax", torch.zeros((), device=device))

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype in (Dtype.mx, Dtype.mx6, Dtype.mx9) and qscheme in (None, QSchemeType.per_group)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            xb, _ = to_blocks(x_orig.detach().float(), self.axis, self.block_size)
            amax = xb.abs().amax(dim=-1)
            _check_finite(self.who, amax)
            if not self.is_dynamic and self.amax.shape == amax.shape:
                amax = torch.maximum(self.amax, amax)
            self.amax = amax
        return x_orig

    def reset_state(self) -> None:
        self.amax = torch.zeros((), device=self.amax.device)

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._all_reduce(self.amax, dist.ReduceOp.MAX, group)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared scales ``2^e`` per block (E8M0 exponents of OCP MX for dtype=mx) and zero points of 0."""
        element = self.qspec.mx_element_dtype if self.dtype == Dtype.mx else Dtype.int8
        exp = mx_shared_exponent(self.amax.unsqueeze(-1), element, self.qspec.mx_scale_mode).squeeze(-1)
        scale = torch.exp2(exp.float())
        return scale, torch.zeros_like(scale, dtype=torch.int32)


class PerBlockBFPObserver(PerBlockMXObserver):
    """Block steps of BFP16: ``2^(floor(log2 amax) - 6)``, doubled where a code would overflow int8, exactly as
    the format computes them (static: the largest step seen per block)."""

    step_exp: torch.Tensor

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self.register_buffer("step_exp", torch.full((), -127, dtype=torch.int32, device=device))

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype == Dtype.bfp16 and qscheme in (None, QSchemeType.per_group)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        super().forward(x_orig)
        if x_orig.numel():
            xb, _ = to_blocks(x_orig.detach().float(), self.axis, self.block_size)
            step_exp = bfp_codes(xb)[1].squeeze(-1)
            if not self.is_dynamic and self.step_exp.shape == step_exp.shape:
                step_exp = torch.maximum(self.step_exp, step_exp)
            self.step_exp = step_exp
        return x_orig

    def reset_state(self) -> None:
        super().reset_state()
        self.step_exp = torch.full((), -127, dtype=torch.int32, device=self.step_exp.device)

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        super().sync(group)
        self._all_reduce(self.step_exp, dist.ReduceOp.MAX, group)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.exp2(self.step_exp.float())
        return scale, torch.zeros_like(scale, dtype=torch.int32)


# ----------------------------------------------------------------------------------------------- histogram family
class PerTensorHistogramObserver(UniformScalingObserver, method="histogram"):
    """Running histogram of the tensor (positive and negative magnitudes, exact zeros counted apart).

    Bins are uniform over [0, R]; when data exceed R, R doubles as often as needed and adjacent bins merge, so
    earlier counts are never redistributed approximately. The qparams of this class use the full observed range;
    the percentile and MSE subclasses choose a narrower one from the histogram.
    """

    qschemes = frozenset({QSchemeType.per_tensor})
    num_bins = 2048

    calib_pos: torch.Tensor
    calib_neg: torch.Tensor
    calib_range: torch.Tensor

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(qspec, device)
        self.register_buffer("calib_pos", torch.zeros(self.num_bins, dtype=torch.float64, device=device))
        self.register_buffer("calib_neg", torch.zeros(self.num_bins, dtype=torch.float64, device=device))
        self.register_buffer("calib_range", torch.zeros((), dtype=torch.float64, device=device))

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return _is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Records the running histogram of ``x_orig``."""
        if not x_orig.numel():
            return x_orig
        x = x_orig.detach().float().reshape(-1)
        mn, mx = torch.aminmax(x)
        self._update(mn, mx, x_orig)
        if self.is_dynamic:
            self.calib_pos.zero_()
            self.calib_neg.zero_()
            self.calib_range.zero_()
        amax = float(torch.maximum(-mn, mx))
        if amax > 0:
            self._grow(amax)
            r = float(self.calib_range)
            # one pass over [-R, R]: bins [:B] are the negatives (reversed), [B:] the positives; exact zeros,
            # which land in bin B, are taken out (they are exact in every format and would dilute percentiles)
            # over x / R in [-1, 1] (R a power of two: exact): histc's (x + R) * bins overflows float32 past ~1e34
            hist = torch.histc(x * (1.0 / r), 2 * self.num_bins, -1.0, 1.0).double()
            hist[self.num_bins] -= float((x == 0).sum())
            self.calib_pos += hist[self.num_bins :]
            self.calib_neg += hist[: self.num_bins].flip(0)
        return x_orig

    def _grow(self, amax: float) -> None:
        """Widen [0, R] by powers of two until it holds ``amax``, merging 2^k adjacent bins. R is a power of two."""
        r = float(self.calib_range)
        if r == 0.0:
            # a power of two, so that any two histograms (other batches, other ranks) merge exactly
            mantissa, exp = math.frexp(amax)
            self.calib_range.fill_(2.0 ** (exp - 1) if mantissa == 0.5 else 2.0**exp)
            return
        if amax <= r:
            return
        k = math.ceil(math.log2(amax / r))
        while r * 2**k < amax:  # float safety
            k += 1
        factor = 2**k
        for name in ("calib_pos", "calib_neg"):
            h: torch.Tensor = getattr(self, name)
            if factor >= self.num_bins:
                merged = h.sum().reshape(1)
            else:
                merged = h.reshape(-1, factor).sum(dim=1)
            setattr(self, name, torch.cat([merged, h.new_zeros(self.num_bins - merged.numel())]))
        self.calib_range.fill_(r * factor)

    def sync(self, group: Any = None) -> None:
        """Min/max by min/max; histograms brought to the widest rank's range (exact: ranges are powers of two), summed."""
        import torch.distributed as dist

        super().sync(group)
        widest = self._all_reduce(self.calib_range.clone(), dist.ReduceOp.MAX, group)
        if float(widest) > 0:
            self._grow(float(widest))
        self._all_reduce(self.calib_pos, dist.ReduceOp.SUM, group)
        self._all_reduce(self.calib_neg, dist.ReduceOp.SUM, group)

    def histogram(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The observed histogram: of |x| over [0, R] when symmetric, of x over [-R, R] otherwise (zeros left out)."""
        r = float(self.calib_range)
        if self.symmetric is False:
            hist = torch.cat([self.calib_neg.flip(0), self.calib_pos])
            edges = torch.linspace(-r, r, 2 * self.num_bins + 1, dtype=torch.float64)
        else:
            hist = self.calib_pos + self.calib_neg
            edges = torch.linspace(0.0, r, self.num_bins + 1, dtype=torch.float64)
        return hist, edges

    def _within_observed(self, min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip a range chosen on bin edges (which can lie past the data) to the observed one: never wider than min-max."""
        if self.symmetric is False:
            return torch.maximum(min_val, self.min_val), torch.minimum(max_val, self.max_val)
        amax = torch.maximum(-self.min_val, self.max_val)
        return min_val, torch.minimum(max_val, amax)

    def reset_state(self) -> None:
        super().reset_state()
        self.calib_pos.zero_()
        self.calib_neg.zero_()
        self.calib_range.zero_()


def _quantile(hist: torch.Tensor, edges: torch.Tensor, q: float) -> torch.Tensor:
    """Value below which a fraction ``q`` of the histogram's mass lies (linear inside the bin)."""
    cdf = torch.cumsum(hist, 0) / hist.sum()
    q = min(max(q, 0.0), 1.0)
    i = int(torch.searchsorted(cdf, torch.tensor([q], dtype=cdf.dtype)).clamp(max=hist.numel() - 1))
    below = float(cdf[i - 1]) if i > 0 else 0.0
    inside = float(hist[i] / hist.sum())
    frac = (q - below) / inside if inside > 0 else 1.0
    return edges[i] + (edges[i + 1] - edges[i]) * min(max(frac, 0.0), 1.0)


class PerTensorPercentileObserver(PerTensorHistogramObserver, method="percentile"):
    """Range from a percentile of the observed values (symmetric: of |x|; asymmetric: both tails).

    The default percentile, 99.99, clips the rarest values: one value in 100,000 far outside the rest does not set
    the range (Quark's 99.99999999 is the maximum in practice). 16,384 bins keep that resolution when outliers
    stretch the histogram.
    """

    num_bins = 16384

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, percentile: float = 99.99) -> None:
        super().__init__(qspec, device)
        if not 0 <= percentile <= 100:
            raise ValueError(f"percentile={percentile} must be between 0 and 100")
        self.percentile = percentile

    def calculate_qparams(
        self, min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if min_val is None or max_val is None:
            hist, edges = self.histogram()
            if hist.sum() == 0:  # only zeros (or nothing) seen
                return super().calculate_qparams()
            min_val, max_val = self.get_min_max_by_percentile(hist, edges, self.percentile)
            min_val, max_val = self._within_observed(min_val, max_val)
        return super().calculate_qparams(min_val, max_val)

    def get_min_max_by_percentile(
        self, histogram: torch.Tensor, bin_edges: torch.Tensor, percentile: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Calculate the minimum and maximum values of a histogram at a specified percentile.

        Parameters:
        - histogram (torch.Tensor): frequency of each bin.
        - bin_edges (torch.Tensor): edges of the bins, one more than ``histogram``.
        - percentile (float): between 0 and 100.

        Returns:
        - Tuple[torch.Tensor, torch.Tensor]: (min, max). Symmetric (a histogram of |x| from 0): (0, the value at
          ``percentile``); asymmetric: the values at ``(100 - percentile) / 2`` and ``100 - (100 - percentile) / 2``.

        Raises:
        - ValueError: If the `percentile` argument is not within the range 0 to 100, or there is no data.
        """
        if percentile < 0 or percentile > 100:
            raise ValueError("Percentile value must be between 0 and 100.")
        if histogram is None or bin_edges is None or histogram.numel() == 0 or float(histogram.sum()) <= 0:
            raise ValueError("no data available")
        if bin_edges.numel() != histogram.numel() + 1:
            raise ValueError(
                f"bin_edges must have one more element than histogram ({histogram.numel() + 1}), got {bin_edges.numel()}"
            )
        hist, edges = histogram.double(), bin_edges.double()
        if float(edges[0]) >= 0:  # a histogram of magnitudes
            return torch.zeros((), dtype=torch.float32), _quantile(hist, edges, percentile / 100).float()
        tail = (100 - percentile) / 200
        return _quantile(hist, edges, tail).float(), _quantile(hist, edges, 1 - tail).float()


class PerTensorMSEObserver(PerTensorHistogramObserver, method="MSE"):
    """Range that minimises the quantization MSE of the observed histogram.

    Quark searches only the top three of 2048 bins (min-max in practice); this one searches the whole range coarse
    to fine (64 candidates, then 64 around the best: the resolution of 512 evenly spaced ones at a quarter of the
    cost), so heavy-tailed data get clipped where that pays.
    """

    search_points = 64

    def calculate_qparams(
        self, min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if min_val is None or max_val is None:
            hist, edges = self.histogram()
            if hist.sum() == 0:
                return super().calculate_qparams()
            n = hist.numel()
            coarse = max(1, n // self.search_points)
            best = self._best_candidate(hist, edges, torch.arange(coarse - 1, n, coarse))
            fine = max(1, coarse // self.search_points)
            idx = torch.arange(max(0, best - coarse), min(n, best + coarse + 1), fine)
            min_val, max_val = self._candidate_ranges(
                hist, edges, torch.tensor([self._best_candidate(hist, edges, idx)])
            )
            min_val, max_val = self._within_observed(min_val[0], max_val[0])
        return super().calculate_qparams(min_val, max_val)

    def get_min_max_by_mse(
        self, calib_hist: torch.Tensor, calib_bin_edges: torch.Tensor, stride: int = 1, start_bin: int = 2045
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (min, amax) that minimises the MSE of the collected histogram.

        Candidates end at bin edges ``start_bin + 1, start_bin + 1 + stride, ...`` (scaled symmetrically about 0
        for a signed histogram); the error of each is measured by quantizing the bin centres with this observer's
        dtype and weighting by the counts.
        """
        if calib_hist is None or calib_bin_edges is None:
            raise ValueError("no data available")
        if calib_bin_edges.numel() < 2:
            raise ValueError(f"calib_bin_edges must have at least 2 elements, got {calib_bin_edges.numel()}")
        n = calib_hist.numel()
        best = self._best_candidate(calib_hist, calib_bin_edges, torch.arange(min(start_bin, n - 1), n, max(stride, 1)))
        mins, maxs = self._candidate_ranges(calib_hist, calib_bin_edges, torch.tensor([best]))
        return mins[0], maxs[0]

    @staticmethod
    def _candidate_ranges(
        hist: torch.Tensor, edges: torch.Tensor, idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mins, maxs) of the candidates ending at bin ``idx``: [0, edge] for |x| histograms; for signed ones
        the non-empty range [lo, hi] shrunk by (idx + 1) / n."""
        edges = edges.double()
        n = hist.numel()
        if float(edges[0]) < 0:
            nz = torch.nonzero(hist).flatten()
            lo, hi = float(edges[nz[0]]), float(edges[nz[-1] + 1])
            frac = (idx + 1).double() / n
            return (lo * frac).float().clamp(max=0), (hi * frac).float().clamp(min=0)
        maxs = edges[idx + 1].float()
        return torch.zeros_like(maxs), maxs

    def _best_candidate(self, hist: torch.Tensor, edges: torch.Tensor, idx: torch.Tensor) -> int:
        """The bin index among ``idx`` (plus the last bin: min-max is always a candidate) with the least MSE."""
        n = hist.numel()
        if idx.numel() == 0 or idx[-1] != n - 1:
            idx = torch.cat([idx, torch.tensor([n - 1])])
        counts, e = hist.double(), edges.double()
        centers = ((e[1:] + e[:-1]) / 2).float()
        mins, maxs = self._candidate_ranges(hist, edges, idx)
        scale, zp = super().calculate_qparams(mins, maxs)  # [K]
        grid = centers.expand(idx.numel(), n)  # every candidate quantizes every centre: [K, n]
        if isinstance(self.fmt, IntFormat):
            q = fake_quantize_int(
                grid,
                scale,
                zp,
                self.fmt.qmin,
                self.fmt.qmax,
                round_method=self.qspec.round_method,
                qscheme=QSchemeType.per_channel,
                axis=0,
            )
        else:
            q = fake_quantize_minifloat(grid, self.fmt, scale, qscheme=QSchemeType.per_channel, axis=0)
        # float64 from the difference on: its square overflows float32 once |x| passes ~1.8e19 (every candidate
        # then ties at inf and the first, the narrowest, wins)
        mse = (((q.double() - centers.double()) ** 2) * counts).sum(dim=1)
        return int(idx[int(torch.argmin(mse))])


class PerTensorHistogramObserverPro(UniformScalingObserver, method="histogrampro"):
    """A wrap of pytorch version observer: HistogramObserver (integer dtypes of at most 8 bits)."""

    qschemes = frozenset({QSchemeType.per_tensor})

    def __init__(
        self,
        qspec: QuantizationSpec,
        device: torch.device | None = None,
        bins: int = 256,
        reduce_range: bool = False,
        upsample_rate: int = 384,
    ) -> None:
        super().__init__(qspec, device)
        if qspec.qscheme != QSchemeType.per_tensor:
            raise ValueError("PerTensorHistogramObserverPro only supports per_tensor")
        fmt = self.fmt
        if not isinstance(fmt, IntFormat) or fmt.bits > 8:
            raise ValueError(
                f"PerTensorHistogramObserverPro supports integer dtypes of at most 8 bits, got {qspec.dtype.name}"
            )
        self.histogram = torch.ao.quantization.HistogramObserver(
            bins=bins,
            dtype=torch.qint8 if fmt.signed else torch.quint8,
            qscheme=torch.per_tensor_symmetric if qspec.symmetric else torch.per_tensor_affine,
            quant_min=fmt.qmin,
            quant_max=fmt.qmax,
            reduce_range=reduce_range,
        )

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        fmt = format_of(dtype)
        return isinstance(fmt, IntFormat) and fmt.bits <= 8 and qscheme in cls.qschemes

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            raise RuntimeError(
                "PerTensorHistogramObserverPro wraps torch's HistogramObserver, whose state cannot be reduced across "
                "ranks; use PerTensorHistogramObserver (or percentile / MSE) for distributed calibration"
            )

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            mn, mx = torch.aminmax(x_orig.detach())
            self._update(mn, mx, x_orig)
            if self.is_dynamic:  # torch's HistogramObserver has no reset_min_max_vals (it raises NotImplementedError)
                self.histogram.histogram.zero_()
                self.histogram.min_val.fill_(float("inf"))
                self.histogram.max_val.fill_(float("-inf"))
            self.histogram(x_orig.detach().float())
        return x_orig

    def calculate_qparams(
        self, min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if min_val is not None and max_val is not None:
            return super().calculate_qparams(min_val, max_val)
        if not self.has_statistics:
            raise RuntimeError(f"{self.who} has observed no data yet; run calibration batches first")
        scale, zp = self.histogram.calculate_qparams()
        scale = apply_scale_type(scale.reshape(()), self.scale_type, self.model_dtype, self.who)
        return scale, zp.reshape(()).to(torch.int32)


# ----------------------------------------------------------------------------------------------- TQT initialisation
def threshold_3sd(x: torch.Tensor) -> torch.Tensor:
    """TQT's 3SD threshold: ``|mean(x)| + 3 * std(x)``."""
    xf = x.detach().float()
    return xf.mean().abs() + 3 * xf.std(unbiased=False)


def threshold_kl_j(x: torch.Tensor, bits: int, bins: int | None = None) -> torch.Tensor:
    """Settle et al. 2018, algorithm 1: the threshold minimising the Jeffreys divergence J(P, Q) = sum (P-Q) ln(P/Q)
    between P, the ``|x|`` histogram clipped at the threshold (clipped mass in its last bin), and Q, the bins below
    the threshold requantised to ``2^(bits-1)`` levels (each level's mass spread over its non-empty bins)."""
    a = x.detach().float().abs().reshape(-1)
    amax = float(a.max()) if a.numel() else 0.0
    if amax == 0.0:
        return torch.tensor(0.0)
    levels = 2 ** (bits - 1)
    n_bins = bins or max(2 * levels, min(2048, math.ceil(math.sqrt(a.numel()))))
    hist = torch.histc(a, n_bins, 0.0, amax).double()
    width = amax / n_bins
    if n_bins <= levels:
        return torch.tensor(amax)
    best_j, best_i = math.inf, n_bins
    for i in range(levels, n_bins + 1):
        kept = hist[:i]
        p = kept.clone()
        p[-1] += hist[i:].sum()  # reference: the clipped mass piles up in the last bin
        # candidate: the kept bins (without the clipped mass) requantised into `levels` groups
        group = torch.div(torch.arange(i) * levels, i, rounding_mode="floor")
        nonzero = (kept > 0).double()
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, kept)
        count = torch.zeros(levels, dtype=torch.float64).index_add_(0, group, nonzero)
        q = torch.where(nonzero > 0, mass[group] / count[group].clamp(min=1), torch.zeros_like(p))
        pn, qn = p / p.sum(), q / q.sum()
        both = (pn > 0) & (qn > 0)
        j = float(((pn[both] - qn[both]) * torch.log(pn[both] / qn[both])).sum())
        if j < best_j:
            best_j, best_i = j, i
    return torch.tensor(best_i * width)


# ----------------------------------------------------------------------------------------------- power-of-two (Quark)
_POW2_DTYPES = (Dtype.int8, Dtype.uint8, Dtype.int32)


class _PowOf2Mixin:
    """Quark's power-of-two observers (its ONNX tools' ``compute_scale_zp``): after every observed tensor, the
    qparams of the running range are computed with the scale rounded to the nearest power of two in the log domain
    (``2^round(log2 s)``) and the zero point re-derived for it; the final qparams are the pair seen most often (the
    earliest among ties). int8, uint8 and int32 only, as in amd-quark."""

    fmt: IntFormat
    symmetric: bool | None
    dtype: Dtype
    min_val: torch.Tensor
    max_val: torch.Tensor

    def _init_pow2(self, qspec: QuantizationSpec) -> None:
        if qspec.dtype not in _POW2_DTYPES:
            raise ValueError(
                f"{type(self).__name__} serves {[d.name for d in _POW2_DTYPES]} only, got dtype={qspec.dtype.name}"
            )
        self.records: list[tuple[tuple[float, ...], tuple[int, ...]]] = []

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype in _POW2_DTYPES and qscheme in cls.qschemes  # type: ignore[attr-defined]

    @staticmethod
    def _scale2pos(scale: torch.Tensor) -> torch.Tensor:
        return torch.round(-torch.log2(scale.clamp(2.0**-127, 2.0**127)))

    def _pow2_qparams(self, min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qmin, qmax = self.fmt.qmin, self.fmt.qmax
        min_neg = torch.clamp(min_val.float(), max=0.0)
        max_pos = torch.clamp(max_val.float(), min=0.0)
        if self.symmetric:
            amax = torch.maximum(-min_neg, max_pos)
            min_neg, max_pos = -amax, amax
        span = max_pos - min_neg
        scale = torch.where(span > 0, span / (qmax - qmin), torch.ones_like(span))  # an empty range: scale 1
        zp = (qmin - min_neg / scale).to(torch.int32)  # truncated, as amd-quark's int32 conversion
        pof2 = torch.exp2(-self._scale2pos(scale))
        new_rmin = torch.clamp((qmin - zp) * pof2, max=0.0)
        new_zp = torch.round(qmin - new_rmin / pof2).to(torch.int32)
        if self.symmetric and self.dtype == Dtype.uint8 and bool((new_zp == 127).all()):
            new_zp = torch.full_like(new_zp, 128)
        return pof2, new_zp

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """The running range (the min/max observer after this mixin), then this tensor's pow2 qparams recorded."""
        super().forward(x_orig)  # type: ignore[misc]
        if x_orig.numel():
            self._record(*self._pow2_qparams(self.min_val, self.max_val))
        return x_orig

    def _record(self, scale: torch.Tensor, zp: torch.Tensor) -> None:
        self.records.append((tuple(scale.reshape(-1).tolist()), tuple(zp.reshape(-1).tolist())))

    def calculate_qparams(
        self, min_val: torch.Tensor | None = None, max_val: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if min_val is not None and max_val is not None:  # an explicit range: its own pow2 qparams
            return self._pow2_qparams(min_val, max_val)
        if not self.records:
            raise RuntimeError(f"{self.who} has observed no data yet; run calibration batches first")
        (scales, zps), _ = Counter(self.records).most_common(1)[0]
        shape = self.min_val.shape
        device = self.min_val.device
        return torch.tensor(scales, device=device).reshape(shape), torch.tensor(
            zps, dtype=torch.int32, device=device
        ).reshape(shape)

    def reset_state(self) -> None:
        super().reset_state()  # type: ignore[misc]
        self.records = []


class PerTensorPowOf2MinMaxObserver(_PowOf2Mixin, PerTensorMinMaxObserver):
    """Per-tensor min/max with a power-of-two scale (Quark's semantics: see ``_PowOf2Mixin``)."""

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self._init_pow2(qspec)


class PerTensorPowOf2MinMSEObserver(PerTensorPowOf2MinMaxObserver):
    """As ``PerTensorPowOf2MinMaxObserver``, then, on each observed tensor, the power of two among the five around
    it (exponent -2..+2) with the least squared error of quantizing that tensor, the zero point kept."""

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        PerTensorMinMaxObserver.forward(self, x_orig)
        if not x_orig.numel():
            return x_orig
        scale, zp = self._pow2_qparams(self.min_val, self.max_val)
        x = x_orig.detach().float()
        pos = self._scale2pos(scale)
        best, best_err = scale, float("inf")
        for offset in range(-2, 3):
            s = torch.exp2(-(pos + offset))
            err = float(
                (((torch.round(x / s) + zp).clamp(self.fmt.qmin, self.fmt.qmax) - zp) * s - x).double().pow(2).sum()
            )
            if err < best_err:
                best, best_err = s, err
        self._record(best, zp)
        return x_orig


class PerChannelPowOf2MinMaxObserver(_PowOf2Mixin, PerChannelMinMaxObserver):
    """Per-channel min/max with power-of-two scales; the most frequent whole set of channel qparams wins."""

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = _EPS) -> None:
        super().__init__(qspec, device, eps)
        self._init_pow2(qspec)


# ----------------------------------------------------------------------------------------------- QAT markers
class TQTObserver(PerTensorMinMaxObserver):
    """The observer amd-quark's QAT configs name with ``qat_spec=TQTSpec(...)`` (module ``observer.tqt_observer``):
    the threshold itself lives in the TQT fake quantizer, initialised from the first batch by the spec's
    ``threshold_init_meth``; this class marks the spec (signed integers, per tensor)."""

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        fmt = format_of(dtype)
        return isinstance(fmt, IntFormat) and fmt.signed and qscheme == QSchemeType.per_tensor


class LSQObserver(UniformScalingObserver):
    """The observer amd-quark's QAT configs name with ``qat_spec=LSQSpec()`` (module ``observer.lsq_observer``):
    the learned scale lives in the LSQ fake quantizer; this class marks the spec (integers, per tensor or channel)."""

    qschemes = frozenset({QSchemeType.per_tensor, QSchemeType.per_channel})

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return isinstance(format_of(dtype), IntFormat) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            mn, mx = torch.aminmax(x_orig.detach())
            self._update(mn, mx, x_orig)
        return x_orig


register_observer(ObserverBase)  # the base too, as amd-quark's ``observer_cls`` type
#: the observers this module defines (``OBSERVER_MAP`` also holds those registered later)
OBSERVER_CLASSES: frozenset[type[ObserverBase]] = frozenset(OBSERVER_MAP.values())
