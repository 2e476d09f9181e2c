"""Observers' common ground: the base class and registration hook, the placeholder observer, and the min-max
arithmetic (qparams of a range, per-channel and per-group statistics, ``MinMaxPlan``) the fused pass traces too.
Conventions: see ``observer.py``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quark.torch.quantization import late_flag
from quark.torch.quantization.buffers import ResizableBuffersMixin
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType, ZeroPointType
from quark.torch.quantization.formats import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    FloatFormat,
    IntFormat,
    aminmax_along,
    apply_scale_type,
    format_of,
    to_blocks,
)
from quark.torch.quantization.observer.registry import register_observer

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = [
    "EPS",
    "is_scaled",
    "check_finite",
    "raise_non_finite",
    "minmax_qparams",
    "channel_minmax",
    "group_minmax",
    "MinMaxPlan",
    "ObserverBase",
    "PlaceholderObserver",
    "reset_observers",
    "ObserverResets",
]

#: the default floor of scales (float32's machine epsilon): a constant or all-zero tensor still gets a positive scale
EPS = torch.finfo(torch.float32).eps


def is_scaled(dtype: Dtype) -> bool:
    """Whether ``dtype`` quantizes with a scale (an integer or minifloat format): what min-max observers serve."""
    return isinstance(format_of(dtype), IntFormat | FloatFormat)


def check_finite(who: str, *values: torch.Tensor) -> None:
    """Raise when statistics carry NaN/Inf (cheap: checks reduced values, not the whole tensor); ``who`` names the
    observer and, once its quantizer is placed, the layer and role (``ObserverBase.who``)."""
    for v in values:
        if not all_finite(v):
            raise_non_finite(who)


def all_finite(v: torch.Tensor) -> bool:
    """``bool(torch.isfinite(v).all())`` in one reduction: the smallest and largest value are finite exactly when
    every value is (a NaN makes both NaN). On CPU statistics of 32-65536 values 3-12x faster than ``isfinite``,
    which runs as five elementwise ops; an observer checks its batch's statistics every observing step."""
    if not v.is_floating_point() or v.numel() == 0:
        return True
    if v.numel() == 1:
        return math.isfinite(v.item())
    lo, hi = torch.aminmax(v)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def raise_non_finite(who: str) -> None:
    """Raise the ValueError of statistics that carry NaN or Inf, naming the observer (``who``)."""
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
    """Scale and zero point of the range [min_val, max_val] extended to include 0 (the conventions of ``observer.py``),
    held as ``scale_type`` says. Pure tensor arithmetic: the observers' ``calculate_qparams`` and the fused
    observe-and-quantize kernel (which traces it) share it."""
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
    xb, _ = to_blocks(x, ch_axis, group_size, whole_axis=True)  # [..., G, g]
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

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_late_nonfinite", None)  # pending device copies belong to this object and process
        return state

    def late_check(self) -> late_flag.LateFlag:
        """This observer's NaN / Inf checks of its batches, read late where a host read waits for the device."""
        late = self.__dict__.get("_late_nonfinite")
        if late is None:
            late = self.__dict__["_late_nonfinite"] = late_flag.LateFlag()
        return late

    def refuse_non_finite(self, identities: tuple[float, ...], *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A batch's statistics ``values`` as the fold may take them. On the CPU checked at once (``check_finite``:
        ValueError naming the layer). Where a host read waits for the device (CUDA, ``late_flag.defers``) the check
        is read late (the error comes some forwards later) and a batch that is not finite is replaced by the fold's
        ``identities`` (one per value: +inf for a running minimum, 0 for a maximum of magnitudes), so the running
        statistics stay as they were."""
        if not late_flag.defers(values[0].device):
            late = self.__dict__.get("_late_nonfinite")
            if late is not None and late.read_traced():  # a batch a compiled forward saw, eagerly now
                raise_non_finite(self.who)
            check_finite(self.who, *values)
            return values
        finite = torch.stack([torch.isfinite(v).all() for v in values]).all()
        if self.late_check().failed(finite):
            raise_non_finite(self.who)
        # the identities as Python scalars: a tensor made from one on CUDA is a pageable copy, which waits for the stream
        return tuple(torch.where(finite, v, i) for v, i in zip(values, identities, strict=True))

    def read_late_checks(self) -> None:
        """Wait for the NaN / Inf checks still on their way (CUDA) and raise where one found a bad batch: before the
        qparams are fixed or read, a late error must not be lost."""
        late = self.__dict__.get("_late_nonfinite")
        if late is not None and late.wait():
            raise_non_finite(self.who)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Quark's name for ``calculate_qparams()``."""
        return self.calculate_qparams()

    def reset_state(self) -> None:
        """Forget every statistic."""

    def reset_fills(self) -> tuple[tuple[str, float], ...] | None:
        """What ``reset_state()`` does, where that is only filling buffers in place: (buffer name, value) pairs,
        which ``reset_observers`` writes for many observers in one call. None (the default) where a reset does more."""
        return None

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


def reset_observers(observers: Iterable[ObserverBase]) -> None:
    """``reset_state()`` of every observer. Resets that are only in-place fills (``reset_fills``) are written
    together, one ``torch._foreach_copy_`` per device and dtype. ``ObserverResets`` does the same for a list of
    observers reset again and again."""
    ObserverResets(observers)()


class ObserverResets:
    """``reset_observers`` of a fixed list of observers, called again and again: QAT's warm-up resets each weight's
    observer before every batch, and gathering the buffers costs more than writing them (width-512 MLP under
    ``Trainer.fit``, 3 weight observers: 70-80 us a batch one observer at a time, see docs/performance.md). The
    buffers are gathered once, each with a source of its own shape holding its reset value (so on CUDA the copy
    takes torch's one-launch path, which needs equal shapes), and gathered again where a buffer is no longer the
    one gathered: rebound (its first statistics of a new shape, a state_dict loaded), or given other storage or
    shape in place (``swap_tensors``, ``.data =``)."""

    __slots__ = ("_observers", "_held", "_groups", "_others")

    def __init__(self, observers: Iterable[ObserverBase]) -> None:
        self._observers = tuple(observers)
        self._held: list[tuple[dict[str, Any], str, torch.Tensor, int, torch.Size]] | None = None
        self._groups: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._others: list[ObserverBase] = []

    def __call__(self) -> None:
        """Reset every observer (``reset_state()``)."""
        if self._held is None or not all(
            d.get(name) is t and t.data_ptr() == ptr and t.shape == shape for d, name, t, ptr, shape in self._held
        ):
            self._gather()
        for observer in self._others:
            observer.reset_state()
        with torch.no_grad():  # (a statistic loaded with requires_grad is still filled, as reset_state does)
            for dsts, srcs in self._groups:
                torch._foreach_copy_(dsts, srcs)

    def _gather(self) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._held, self._others = [], []
        for observer in self._observers:
            fills = observer.reset_fills()
            if fills is None:
                self._others.append(observer)
                continue
            for name, value in fills:
                buf = observer._buffers[name]
                self._held.append((observer._buffers, name, buf, buf.data_ptr(), buf.shape))
                dsts, srcs = groups.setdefault((buf.device, buf.dtype), ([], []))
                dsts.append(buf)
                srcs.append(torch.full_like(buf, value))
        self._groups = list(groups.values())


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
