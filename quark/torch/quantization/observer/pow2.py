"""Quark's power-of-two observers (its ONNX tools' ``compute_scale_zp``): min-max and min-MSE with scales rounded
to powers of two, the most frequent qparams winning."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import IntFormat
from quark.torch.quantization.observer.base import EPS
from quark.torch.quantization.observer.minmax import PerChannelMinMaxObserver, PerTensorMinMaxObserver

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = ["PerTensorPowOf2MinMaxObserver", "PerTensorPowOf2MinMSEObserver", "PerChannelPowOf2MinMaxObserver"]

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

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
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

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device, eps)
        self._init_pow2(qspec)
