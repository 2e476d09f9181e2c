"""Min-max observers: ``UniformScalingObserver`` (running min / max, qparams, distributed sync) and its per-tensor,
per-channel, per-group and per-block (2-D tiles) min-max observers."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import format_of, to_tiles
from quark.torch.quantization.observer.base import (
    EPS,
    MinMaxPlan,
    ObserverBase,
    channel_minmax,
    group_minmax,
    is_scaled,
    minmax_qparams,
    raise_non_finite,
)

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = [
    "UniformScalingObserver",
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerBlock2DMinMaxObserver",
]

_MAX_STAT_DIMS = 8  # the most dimensions statistics of min-max observers have (per group of a high-rank tensor)


class UniformScalingObserver(ObserverBase):
    """Observer for uniform scaling quantizers (integers of any width, minifloats with a scale).

    Holds running ``min_val`` / ``max_val`` buffers; subclasses decide their granularity.
    """

    min_val: torch.Tensor
    max_val: torch.Tensor

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
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
        min_val, max_val = self.refuse_non_finite((float("inf"), float("-inf")), min_val, max_val)
        self.model_dtype = x.dtype
        if torch.compiler.is_compiling():  # dynamo cannot trace ``is_inference`` (below): always rebind, out of place
            same = self.min_val.shape == min_val.shape and not self.is_dynamic
            self.min_val = torch.minimum(self.min_val, min_val) if same else min_val.clone()
            self.max_val = torch.maximum(self.max_val, max_val) if same else max_val.clone()
            return
        # first statistics of this shape (e.g. per channel, or per token: the shape follows the batch), or buffers
        # made under inference_mode (a validation loop) now updated outside it (in-place is not allowed): rebind
        stale = self.min_val.is_inference() and not torch.is_inference_mode_enabled()
        if self.min_val.shape != min_val.shape or stale:
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
        ValueError naming the layer, as ``forward`` does, where it had NaN or Inf (on CUDA read late, for a batch
        some forwards ago: the pass left the statistics and qparams as they were)."""
        if self.late_check().failed(finite):
            raise_non_finite(self.who)
        self.__dict__["model_dtype"] = x.dtype  # a plain attribute (set per forward: no Module.__setattr__ checks)

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
        if largest[0] < 0:  # no rank has observed anything: every rank holds the scalar placeholder
            if self.min_val.ndim:  # (a reset keeps the shape in place: another rank may never have had one)
                self.min_val = torch.tensor(float("inf"), device=self.min_val.device)
                self.max_val = torch.tensor(float("-inf"), device=self.max_val.device)
            return
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
        """Resets the min/max values (+inf / -inf: no statistics), filled in place where ``reset_fills`` says so, so
        the statistics keep their shape and their tensors: QAT's warm-up resets a weight's observer before every
        batch (``QuantCallback``), and the quantizer's fused observe pass serves only statistics of the input's shape
        (per channel at width 1024 under ``Trainer.fit``: 1.43x FP32 with a scalar placeholder, which takes the
        step-by-step path). Buffers made under ``inference_mode`` cannot be written outside it: those are replaced."""
        fills = self._fills()
        if fills is not None:
            with torch.no_grad():
                for name, value in fills:
                    self._buffers[name].fill_(value)  # type: ignore[union-attr]
            return
        self.min_val = torch.tensor(float("inf"), device=self.min_val.device)
        self.max_val = torch.tensor(float("-inf"), device=self.max_val.device)

    def reset_state(self) -> None:
        self.reset_min_max_vals()

    def reset_fills(self) -> tuple[tuple[str, float], ...] | None:
        """The two in-place fills of ``reset_min_max_vals``; None where the buffers are replaced instead, or where a
        subclass resets more than the statistics."""
        cls = type(self)
        if cls.reset_state is not UniformScalingObserver.reset_state or (
            cls.reset_min_max_vals is not UniformScalingObserver.reset_min_max_vals
        ):
            return None
        return self._fills()

    def _fills(self) -> tuple[tuple[str, float], ...] | None:
        """The statistics' fills, where they can be written in place (the same shape, not inference tensors)."""
        mn, mx = self.min_val, self.max_val
        if mn.shape != mx.shape or mn.is_inference() or mx.is_inference():
            return None
        return (("min_val", float("inf")), ("max_val", float("-inf")))

    def extra_repr(self) -> str:
        return f"dtype={self.dtype.name}, symmetric={self.symmetric}, dynamic={self.is_dynamic}"


class PerTensorMinMaxObserver(UniformScalingObserver, method="min_max"):
    """Running minimum and maximum of the whole tensor."""

    qschemes = frozenset({QSchemeType.per_tensor})

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        """Records the running minimum and maximum of ``x``."""
        if x_orig.numel():
            mn, mx = torch.aminmax(x_orig.detach())
            self._update(mn, mx, x_orig)
        return x_orig


class PerChannelMinMaxObserver(UniformScalingObserver):
    """Running minimum and maximum of each slice along ``ch_axis``."""

    qschemes = frozenset({QSchemeType.per_channel})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = qspec.ch_axis

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return is_scaled(dtype) and qscheme in cls.qschemes

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            mn, mx = channel_minmax(x_orig.detach(), self.ch_axis)
            self._update(mn, mx, x_orig)
        return x_orig


class PerGroupMinMaxObserver(UniformScalingObserver):
    """Minimum and maximum of each group of ``group_size`` along ``ch_axis`` (qparams [..., n_groups])."""

    qschemes = frozenset({QSchemeType.per_group})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device, eps)
        self.ch_axis = qspec.ch_axis
        self.group_size = qspec.group_size

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return is_scaled(dtype) and qscheme in cls.qschemes

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

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device, eps)
        self.block_size = qspec.block_size

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return is_scaled(dtype) and qscheme in cls.qschemes

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
