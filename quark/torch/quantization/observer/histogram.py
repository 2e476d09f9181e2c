"""Histogram observers: the running histogram, the percentile and MSE range choices made from it, and the wrap of
torch's HistogramObserver (``PerTensorHistogramObserverPro``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    IntFormat,
    apply_scale_type,
    dequantize_int,
    format_of,
    quantize_int,
    round_to_grid,
)
from quark.torch.quantization.observer.base import is_scaled
from quark.torch.quantization.observer.minmax import UniformScalingObserver

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = [
    "PerTensorHistogramObserver",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
    "PerTensorHistogramObserverPro",
]


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
        return is_scaled(dtype) and qscheme in cls.qschemes

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
        e = edges.double()
        filled = hist > 0  # empty bins add nothing: only the filled ones are quantized (a fraction on small data)
        counts, centers = hist.double()[filled], ((e[1:] + e[:-1]) / 2).float()[filled]
        mins, maxs = self._candidate_ranges(hist, edges, idx)
        scale, zp = super().calculate_qparams(mins, maxs)  # [K]
        q = self._quantize_candidates(centers, scale, zp)
        # float64 from the difference on: its square overflows float32 once |x| passes ~1.8e19 (every candidate
        # then ties at inf and the first, the narrowest, wins)
        mse = (((q.double() - centers.double()) ** 2) * counts).sum(dim=1)
        return int(idx[int(torch.argmin(mse))])

    def _quantize_candidates(self, centers: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor) -> torch.Tensor:
        """``centers`` [n] fake-quantized with each candidate's ``scale``/``zp`` [K]: [K, n], always eagerly.

        The grid is K x n (65 x 2048 here, whatever the model's size), past the format kernels' compile threshold, but
        it is evaluated once per search: compiling the fake-quant kernel for it took seconds on the first calibration
        in a process, against about a millisecond eagerly. Quantize-then-dequantize (integers) and the grid rounding
        (minifloats, the only other formats ``is_scaled`` serves) are the eager bodies of those kernels: same values.
        """
        grid = centers.expand(scale.numel(), centers.numel())  # every candidate quantizes every centre
        fmt = self.fmt
        if isinstance(fmt, IntFormat):
            codes = quantize_int(
                grid,
                scale,
                zp,
                fmt.qmin,
                fmt.qmax,
                round_method=self.qspec.round_method,
                qscheme=QSchemeType.per_channel,
                axis=0,
            )
            return dequantize_int(codes, scale, zp, qscheme=QSchemeType.per_channel, axis=0)
        s = scale.float().reshape(-1, 1)
        return round_to_grid(grid / s, fmt).mul_(s)


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
            if self.is_dynamic:
                self._reset_histogram()
            self.histogram(x_orig.detach().float())
        return x_orig

    def reset_state(self) -> None:
        """Forget the statistics and the wrapped observer's histogram (its qparams come from the histogram)."""
        super().reset_state()
        self._reset_histogram()

    def _reset_histogram(self) -> None:
        # torch's HistogramObserver has no reset_min_max_vals (it raises NotImplementedError)
        with torch.no_grad():
            self.histogram.histogram.zero_()
            self.histogram.min_val.fill_(float("inf"))
            self.histogram.max_val.fill_(float("-inf"))

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
