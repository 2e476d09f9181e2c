"""Independent references for the algorithm tests (not collected: no test_ prefix): specs, round-to-nearest with
torch's own fake-quant kernel, output errors. Quark's integer conventions: symmetric scale = amax / ((qmax - qmin) / 2),
asymmetric scale = (max(x, 0) - min(x, 0)) / (qmax - qmin) with zero point qmin - round(min / scale)."""

from __future__ import annotations

from typing import Any

import torch

from quark.torch.quantization.config.config import QuantizationSpec

EPS = torch.finfo(torch.float32).eps


def spec_dict(
    bits: int = 4, qscheme: str = "per_channel", group_size: int | None = None, sym: bool = True
) -> dict[str, Any]:
    """A static weight spec as the dict Config.from_dict takes: int<bits> symmetric or uint<bits> asymmetric."""
    d: dict[str, Any] = {
        "dtype": f"int{bits}" if sym else f"uint{bits}",
        "qscheme": qscheme,
        "observer_cls": {
            "per_channel": "PerChannelMinMaxObserver",
            "per_group": "PerGroupMinMaxObserver",
            "per_tensor": "PerTensorMinMaxObserver",
        }[qscheme],
        "symmetric": sym,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }
    if qscheme == "per_channel":
        d["ch_axis"] = 0
    if qscheme == "per_group":
        d["ch_axis"], d["group_size"] = 1, group_size
    return d


def make_spec(
    bits: int = 4, qscheme: str = "per_channel", group_size: int | None = None, sym: bool = True
) -> QuantizationSpec:
    return QuantizationSpec.from_dict(spec_dict(bits, qscheme, group_size, sym))


def int_range(bits: int, sym: bool) -> tuple[int, int]:
    return (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if sym else (0, 2**bits - 1)


def ref_qparams(
    w: torch.Tensor, bits: int, sym: bool, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max qparams per output row ([rows]) or per row and input group ([rows, columns / group_size])."""
    qmin, qmax = int_range(bits, sym)
    rows = w.shape[0]
    wg = w.float().reshape(rows, -1, group_size) if group_size else w.float().reshape(rows, 1, -1)
    mn = wg.amin(dim=-1).clamp(max=0.0)
    mx = wg.amax(dim=-1).clamp(min=0.0)
    if sym:
        scale = torch.clamp(torch.maximum(-mn, mx) / ((qmax - qmin) / 2), min=EPS)
        zp = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = torch.clamp((mx - mn) / float(qmax - qmin), min=EPS)
        zp = (qmin - torch.round(mn / scale)).clamp(qmin, qmax).to(torch.int32)
    if not group_size:
        scale, zp = scale.squeeze(1), zp.squeeze(1)
    return scale, zp


def requantize(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, bits: int, sym: bool) -> torch.Tensor:
    """torch.fake_quantize_per_channel_affine of a [rows, columns] weight with per-row or per-(row, group) qparams."""
    qmin, qmax = int_range(bits, sym)
    rows, columns = w.shape
    if scale.ndim == 2:  # per group: every (row, group) one channel
        groups = scale.shape[1]
        flat = w.float().reshape(rows * groups, columns // groups)
        out = torch.fake_quantize_per_channel_affine(
            flat, scale.reshape(-1).float(), zp.reshape(-1).int(), 0, qmin, qmax
        )
        return out.reshape(rows, columns)
    return torch.fake_quantize_per_channel_affine(
        w.float(), scale.reshape(-1).float(), zp.reshape(-1).int(), 0, qmin, qmax
    )


def ref_rtn(w: torch.Tensor, bits: int, sym: bool, group_size: int | None = None) -> torch.Tensor:
    """Round-to-nearest with min-max qparams (weights of any rank: columns are everything after dim 0)."""
    w2 = w.reshape(w.shape[0], -1)
    scale, zp = ref_qparams(w2, bits, sym, group_size)
    return requantize(w2, scale, zp, bits, sym).reshape(w.shape)


def output_error(x: torch.Tensor, w_q: torch.Tensor, w: torch.Tensor) -> float:
    """||X (Wq - W)^T||^2 for input rows X [m, columns]."""
    return float(((x.double() @ (w_q.double() - w.double()).T) ** 2).sum())


def correlated_inputs(rows: int, columns: int, rank: int = 12, noise: float = 0.05, seed: int = 0) -> torch.Tensor:
    """Inputs [rows, columns] that live mostly in a low-rank subspace (strongly correlated columns), with uneven
    column magnitudes (so a descending-activation order differs from the natural one)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, rank, generator=g)
    mix = torch.randn(rank, columns, generator=g)
    gains = torch.linspace(0.3, 3.0, columns)[torch.randperm(columns, generator=g)]
    return (z @ mix + noise * torch.randn(rows, columns, generator=g)) * gains
