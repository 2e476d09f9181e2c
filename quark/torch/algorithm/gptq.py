"""GPTQ (Frantar et al. 2022): quantize a weight column by column, spreading each column's rounding error over the
columns not yet quantized through the inverse Hessian of the layer's inputs, so the layer's *output* error is small.

``gptq_quantize`` is the pure tensor algorithm (one 2-D weight and its Hessian); ``HessianAccumulator`` builds the
Hessian from a layer's inputs. The model-level driver (sequential over decoder layers) is in ``algorithm.api``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.formats import BLOCK_FORMATS, CAST_FORMATS, fake_quantize


class HessianAccumulator:
    """Running ``H = 2/n * sum x x^T`` over the rows of a layer's inputs, in float32 (the GPTQ objective's Hessian)."""

    def __init__(self, columns: int, device: torch.device | None = None) -> None:
        self.hessian = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        """Add inputs given as a [m, columns] matrix (one row per token / output position)."""
        rows = rows.detach().reshape(-1, rows.shape[-1]).float()
        m = rows.shape[0]
        if m == 0:
            return
        self.hessian *= self.count / (self.count + m)
        self.count += m
        rows = rows * (2.0 / self.count) ** 0.5
        self.hessian += rows.T @ rows


def layer_input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of a Linear or Conv2d as the [m, columns] matrix its weight multiplies (im2col for convolutions)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(f"GPTQ supports Conv2d with groups=1, got groups={module.groups}")
        if isinstance(module.padding, str):
            raise ValueError(f"GPTQ needs numeric Conv2d padding, got padding={module.padding!r}")
        padding = module.padding
        if module.padding_mode != "zeros":  # reflect / replicate / circular: pad as the layer itself does
            x, padding = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), 0
        cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    raise ValueError(f"GPTQ supports Linear and Conv2d layers, got {type(module).__name__}")


@dataclass
class GPTQResult:
    """The quantized weight (on the format's grid, dequantized), its qparams, and the GPTQ loss (sum of the squared
    column errors weighted by the inverse Hessian: what GPTQ minimises, comparable between methods on one layer)."""

    weight: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor
    loss: float
    damp: float


def check_gptq_spec(spec: QuantizationSpec, where: str) -> None:
    """GPTQ needs a scaled element format with per-tensor, per-output-channel or per-input-group scales."""
    if spec.dtype in BLOCK_FORMATS or spec.dtype in CAST_FORMATS:
        raise ValueError(f"{where}: GPTQ needs an integer or minifloat weight dtype with scales, got {spec.dtype.name}")
    if spec.is_dynamic:
        raise ValueError(f"{where}: GPTQ fixes the weight qparams; the weight spec must have is_dynamic=False")
    if spec.qscheme == QSchemeType.per_block:
        raise ValueError(f"{where}: GPTQ quantizes column by column and does not support qscheme=per_block; use per_channel or per_group")
    if spec.qscheme == QSchemeType.per_channel and spec.ch_axis not in (0,):
        raise ValueError(f"{where}: GPTQ needs per-channel weight scales along the output channels (ch_axis=0), got {spec.ch_axis}")
    if spec.qscheme == QSchemeType.per_group and spec.ch_axis not in (1, -1):
        raise ValueError(f"{where}: GPTQ needs weight groups along the input features (ch_axis=1 or -1), got {spec.ch_axis}")


def observer_qparams(spec: QuantizationSpec, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's own observer on ``weight``: the scales the quantizer would compute (same conventions, same shape)."""
    observer = spec.observer_cls(spec, weight.device)  # type: ignore[misc]
    observer(weight)
    scale, zero_point = observer.calculate_qparams()
    return scale.to(weight.device), zero_point.to(weight.device)


def _quantize_column(column: torch.Tensor, spec: QuantizationSpec, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """Fake-quantize one weight column [rows] with per-row qparams (or a scalar one), as the spec's format does."""
    if scale.numel() == 1:
        return fake_quantize(column, spec.dtype, scale.reshape(()), zero_point.reshape(()), qscheme=QSchemeType.per_tensor, round_method=spec.round_method)
    out = fake_quantize(
        column.unsqueeze(1), spec.dtype, scale, zero_point, qscheme=QSchemeType.per_channel, axis=0, round_method=spec.round_method
    )
    return out.squeeze(1)


def _inverse_hessian_factor(hessian: torch.Tensor, damp_percent: float, retries: int) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)^-1; the damping grows 10x per retry when H is not positive definite."""
    diag_mean = float(torch.diag(hessian).mean())
    damp = damp_percent
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    for attempt in range(retries + 1):
        try:
            lower = torch.linalg.cholesky(hessian + damp * diag_mean * eye)
            inverse = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inverse, upper=True), damp
        except torch.linalg.LinAlgError:
            if attempt == retries:
                raise ValueError(
                    f"GPTQ: the Hessian is not positive definite even with damp_percent={damp:g}; "
                    "give more calibration data or a larger damp_percent"
                ) from None
            damp *= 10
    raise AssertionError("unreachable")


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    spec: QuantizationSpec,
    *,
    damp_percent: float = 0.01,
    desc_act: bool = True,
    static_groups: bool = False,
    block_size: int = 128,
    retries: int = 4,
) -> GPTQResult:
    """Quantize a [rows, columns] weight with GPTQ for the input Hessian [columns, columns].

    Scales come from the spec's observer: per tensor / per channel on the original weight; per group either all up
    front (``static_groups``) or when the sweep reaches a group's first column (from the weights as updated so far).
    ``desc_act`` visits columns by descending Hessian diagonal (the most active inputs first); groups always stay the
    format's contiguous input groups, so the result is an ordinary per-group weight.
    """
    rows, columns = weight.shape
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    grouped = spec.qscheme == QSchemeType.per_group
    group_size = int(spec.group_size or columns) if grouped else columns
    if grouped and columns % group_size:
        raise ValueError(f"GPTQ: group_size={group_size} does not divide the {columns} input columns")
    n_groups = columns // group_size if grouped else 1
    if not grouped:
        scale, zero_point = observer_qparams(spec, w)
        scales, zps = [scale.reshape(-1, 1)], [zero_point.reshape(-1, 1)]  # one "group": the whole row (or tensor)
    else:
        scales, zps = [None] * n_groups, [None] * n_groups  # type: ignore[list-item]
        if static_groups:
            full_scale, full_zp = observer_qparams(spec, w)
            for g in range(n_groups):
                scales[g], zps[g] = full_scale[:, g : g + 1], full_zp[:, g : g + 1]

    perm = torch.argsort(torch.diag(h), descending=True) if desc_act else torch.arange(columns, device=w.device)
    w = w[:, perm]
    h = h[perm][:, perm]
    h_inv, damp = _inverse_hessian_factor(h, damp_percent, retries)

    q = torch.zeros_like(w)
    losses = torch.zeros(rows, dtype=torch.float32, device=w.device)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        h1 = h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            original = int(perm[i1 + i])
            g = original // group_size if grouped else 0
            if scales[g] is None:  # the first column of this group the sweep reaches: its scales, from now
                cols = torch.arange(g * group_size, (g + 1) * group_size, device=w.device)
                current = _current_columns(w, w1, perm, cols, i1, i2)
                s, z = observer_qparams(spec, current)  # current: [rows, group_size], one group per row
                scales[g], zps[g] = s.reshape(-1, 1), z.reshape(-1, 1)
            column = w1[:, i]
            d = h1[i, i]
            qcol = _quantize_column(column, spec, scales[g].squeeze(1), zps[g].squeeze(1))
            q[:, i1 + i] = qcol
            losses += (column - qcol) ** 2 / d**2 / 2
            err = (column - qcol) / d
            w1[:, i:] -= err.unsqueeze(1) @ h1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i1:i2] = w1
        w[:, i2:] -= err1 @ h_inv[i1:i2, i2:]

    inverse = torch.argsort(perm)
    q = q[:, inverse]
    if grouped:
        scale, zero_point = torch.cat(scales, dim=1), torch.cat(zps, dim=1)  # type: ignore[arg-type]
    return GPTQResult(q.to(weight.dtype), scale, zero_point, float(losses.sum()), damp)


def _current_columns(w: torch.Tensor, w1: torch.Tensor, perm: torch.Tensor, cols: torch.Tensor, i1: int, i2: int) -> torch.Tensor:
    """Original columns ``cols`` as the sweep sees them now: from the block being processed when they are in it."""
    position = torch.argsort(perm)[cols]
    out = w[:, position].clone()
    inside = (position >= i1) & (position < i2)
    if bool(inside.any()):
        out[:, inside] = w1[:, position[inside] - i1]
    return out
