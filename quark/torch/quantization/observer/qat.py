"""QAT: TQT's threshold initialisations (3SD, KL-J) and the marker observers amd-quark's QAT specs name (TQT, LSQ)."""

from __future__ import annotations

import math

import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import IntFormat, format_of
from quark.torch.quantization.observer.minmax import PerTensorMinMaxObserver, UniformScalingObserver

__all__ = ["threshold_3sd", "threshold_kl_j", "TQTObserver", "LSQObserver"]


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
