"""GPTQ (Frantar et al. 2022): quantize a weight column by column, spreading each column's rounding error over the
columns not yet quantized through the inverse Hessian of the layer's inputs, so the layer's *output* error is small.

``gptq_quantize`` is the pure tensor algorithm (one 2-D weight and its Hessian): ``prepare_hessian`` (the column
order and the Cholesky factor of the damped inverse, shareable by layers with one input) then ``gptq_sweep`` (the
column loop); ``HessianAccumulator`` builds the Hessian from a layer's inputs. The model-level driver (sequential over
decoder layers) is in ``algorithm.api``. ``tests/quark/algorithm/test_gptq_reference.py`` checks the result bit for
bit against the straightforward column-major loop of the paper.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.formats import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    ElementwiseQuantizer,
    FloatFormat,
    IntFormat,
    elementwise_quantizer,
    format_of,
)
from quark.torch.quantization.hf import is_linear

logger = logging.getLogger(__name__)


class HessianAccumulator:
    """Running ``H = 2/n * sum x x^T`` over the rows of a layer's inputs, in float32 (the GPTQ objective's Hessian)."""

    def __init__(self, columns: int, device: torch.device | None = None) -> None:
        self.hessian: torch.Tensor | None = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, rows: torch.Tensor) -> None:
        """Add inputs given as a [m, columns] matrix (one row per token / output position)."""
        if self.hessian is None:
            raise RuntimeError("HessianAccumulator: its Hessian was taken (take()); no inputs can be added")
        rows = rows.detach().reshape(-1, rows.shape[-1]).float()
        m = rows.shape[0]
        if m == 0:
            return
        self.hessian *= self.count / (self.count + m)
        self.count += m
        rows = rows * (2.0 / self.count) ** 0.5
        self.hessian += rows.T @ rows

    def take(self) -> torch.Tensor:
        """The Hessian, handed over: the accumulator keeps no reference to it (its memory goes with the caller's).

        Raises:
            RuntimeError: taken before.
        """
        if self.hessian is None:
            raise RuntimeError("HessianAccumulator: its Hessian was already taken")
        hessian, self.hessian = self.hessian, None
        return hessian


def layer_input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input of a Linear or Conv2d as the [m, columns] matrix its weight multiplies (im2col for convolutions)."""
    if is_linear(module):  # nn.Linear, transformers' Conv1D
        return x.reshape(-1, x.shape[-1])
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(f"GPTQ supports Conv2d with groups=1, got groups={module.groups}")
        if isinstance(module.padding, str):
            raise ValueError(f"GPTQ needs numeric Conv2d padding, got padding={module.padding!r}")
        padding = module.padding
        if module.padding_mode != "zeros":  # reflect / replicate / circular: pad as the layer itself does
            pads = tuple(p for p in reversed(module.padding) for _ in range(2))  # F.pad's order: last dimension first
            x, padding = F.pad(x, pads, mode=module.padding_mode), 0
        cols = F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    raise ValueError(f"GPTQ supports Linear, transformers' Conv1D and Conv2d layers, got {type(module).__name__}")


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
        raise ValueError(
            f"{where}: GPTQ quantizes column by column and does not support qscheme=per_block; use per_channel or per_group"
        )
    if spec.qscheme == QSchemeType.per_channel and spec.ch_axis not in (0,):
        raise ValueError(
            f"{where}: GPTQ needs per-channel weight scales along the output channels (ch_axis=0), got {spec.ch_axis}"
        )
    if spec.qscheme == QSchemeType.per_group and spec.ch_axis not in (1, -1):
        raise ValueError(
            f"{where}: GPTQ needs weight groups along the input features (ch_axis=1 or -1), got {spec.ch_axis}"
        )


def observer_qparams(spec: QuantizationSpec, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's own observer on ``weight``: the scales the quantizer would compute (same conventions, same shape)."""
    observer = spec.observer_cls(spec, weight.device)  # type: ignore[misc]
    observer(weight)
    scale, zero_point = observer.calculate_qparams()
    return scale.to(weight.device), zero_point.to(weight.device)


def column_quantizer(spec: QuantizationSpec) -> ElementwiseQuantizer:
    """``fn(column, scale, zero_point)``: the spec's format on one weight column, qparams broadcastable to it, eagerly
    and without autograd: one column is far below the size where a compiled kernel pays, and GPTQ calls it once per
    column."""
    if not isinstance(format_of(spec.dtype), (IntFormat, FloatFormat)):
        raise ValueError(f"GPTQ needs an integer or minifloat weight dtype with scales, got {spec.dtype}")
    return elementwise_quantizer(spec.dtype, spec.round_method)


def _column_qparams(
    spec: QuantizationSpec, scale: torch.Tensor, zero_point: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row qparams of one column as contiguous vectors [rows] (0-d for one scale), in the dtypes ``fake_quantize``
    uses: float32 scales, int32 zero points (a float zero point stays float)."""
    scale = scale.float().reshape(()) if scale.numel() == 1 else scale.float().reshape(-1).contiguous()
    zero_point = zero_point.reshape(()) if zero_point.numel() == 1 else zero_point.reshape(-1).contiguous()
    if not zero_point.is_floating_point():
        zero_point = zero_point.to(torch.int32)
    return scale, zero_point


#: a Hessian at least this large (float32 bytes; 4096 columns) is kept in a temporary file, not in memory, while it is
#: factorized: it is read back only if a factorization fails and is retried with more damping
SPILL_BYTES = 64 * 2**20


class _Spilled:
    """A CPU tensor written to an anonymous temporary file (removed when closed), read back bit for bit."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.file = tempfile.TemporaryFile()
        torch.save(tensor, self.file)

    def load(self) -> torch.Tensor:
        self.file.seek(0)
        return torch.load(self.file, weights_only=True)

    def close(self) -> None:
        self.file.close()


def _spill(hessian: torch.Tensor) -> _Spilled | None:
    """``hessian`` in a temporary file when it is large and on the CPU (None: keep it in memory)."""
    if hessian.device.type != "cpu" or hessian.numel() * hessian.element_size() < SPILL_BYTES:
        return None
    try:
        return _Spilled(hessian)
    except OSError as error:  # no room in the temporary folder: the memory it would have saved is used instead
        logger.debug("GPTQ: Hessian kept in memory while factorized (%s)", error)
        return None


def _inverse_hessian_factor(box: list[torch.Tensor], damp_percent: float, retries: int) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)^-1; the damping grows 10x per retry when H is not positive definite.

    ``box`` holds the only reference to H (the caller's own copy, taken out here): it is damped in place and its
    diagonal put back bit for bit before a retry. Once its Cholesky factor exists, a large H goes to a temporary file
    (``SPILL_BYTES``) until the factorization is done, so the peak is two [columns, columns] matrices (three for a
    smaller or non-CPU H): GPTQ of a decoder layer streamed from disk is bounded by this."""
    hessian = box.pop()
    diagonal = torch.diag(hessian).clone()
    diag_mean = float(diagonal.mean())
    damp = damp_percent
    for attempt in range(retries + 1):
        hessian.diagonal().add_(damp * diag_mean)  # the same float32 sum as H + (damp * mean) * I, without the eye
        spilled = None
        try:
            lower = torch.linalg.cholesky(hessian)
            spilled = _spill(hessian)
            if spilled is not None:
                del hessian
            inverse = torch.cholesky_inverse(lower)
            del lower
            if inverse.device.type == "cpu":  # LAPACK's inverse mirrors its triangle: exactly symmetric, and its
                inverse = inverse.mT  # transpose is column-major, so the factorization copies it without transposing
            return torch.linalg.cholesky(inverse, upper=True), damp
        except torch.linalg.LinAlgError:
            if spilled is not None:
                inverse = None  # freed before H is read back
                hessian = spilled.load()
            hessian.diagonal().copy_(diagonal)
            if attempt == retries:
                raise ValueError(
                    f"GPTQ: the Hessian is not positive definite even with damp_percent={damp:g}; "
                    "give more calibration data or a larger damp_percent"
                ) from None
            damp *= 10
        finally:
            if spilled is not None:
                spilled.close()
    raise AssertionError("unreachable")


@dataclass
class InverseHessian:
    """What GPTQ takes from a Hessian, computed once per Hessian (layers that read the same input share it):
    the sweep order ``perm`` (position -> input column), the dead input columns (zero diagonal), the upper Cholesky
    factor of the damped inverse Hessian in sweep order, and the damping that made it positive definite."""

    perm: torch.Tensor
    dead: torch.Tensor
    factor: torch.Tensor
    damp: float


@torch.no_grad()
def prepare_hessian(
    hessian: torch.Tensor, *, damp_percent: float = 0.01, desc_act: bool = True, retries: int = 4
) -> InverseHessian:
    """The ``InverseHessian`` of an input Hessian [columns, columns] (float32 Cholesky factorizations); ``hessian``
    is not changed."""
    return _prepare([hessian.detach()], False, damp_percent, desc_act, retries)


@torch.no_grad()
def prepare_accumulated(
    accumulator: HessianAccumulator, *, damp_percent: float = 0.01, desc_act: bool = True, retries: int = 4
) -> InverseHessian:
    """``prepare_hessian`` of an accumulator's Hessian, which it takes (``HessianAccumulator.take``): no copy of it is
    made, so the factorization holds one matrix fewer."""
    box = [accumulator.take()]
    return _prepare(box, True, damp_percent, desc_act, retries)


def _prepare(box: list[torch.Tensor], owned: bool, damp_percent: float, desc_act: bool, retries: int) -> InverseHessian:
    """``prepare_hessian`` on the Hessian in ``box`` (taken out); ``owned``: ours to change and to free early."""
    hessian = box.pop()
    columns = hessian.shape[0]
    diagonal = torch.diag(hessian).float()
    dead = diagonal == 0
    diagonal[dead] = 1.0  # a dead column's diagonal is 1 (set in the matrix below, once it is our copy)
    if desc_act:
        perm = torch.argsort(diagonal, descending=True)
        rows = hessian.float().index_select(0, perm)
        del hessian  # owned: freed here, before the second copy
        box.append(rows.index_select(1, perm))  # our copy, in sweep order
        del rows
    else:
        perm = torch.arange(columns, device=hessian.device)
        own = owned and hessian.dtype == torch.float32
        box.append(hessian if own else hessian.float().clone())
        del hessian
    moved = dead.index_select(0, perm)  # the dead columns' positions in sweep order
    box[0][moved, moved] = 1.0
    factor, damp = _inverse_hessian_factor(box, damp_percent, retries)
    return InverseHessian(perm, dead, factor, damp)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor | None,
    spec: QuantizationSpec,
    *,
    damp_percent: float = 0.01,
    desc_act: bool = True,
    static_groups: bool = False,
    block_size: int = 128,
    retries: int = 4,
    inverse: InverseHessian | None = None,
) -> GPTQResult:
    """Quantize a [rows, columns] weight with GPTQ for the input Hessian [columns, columns].

    Scales come from the spec's observer: per tensor / per channel on the original weight; per group either all up
    front (``static_groups``) or when the sweep reaches a group's first column (from the weights as updated so far).
    ``desc_act`` visits columns by descending Hessian diagonal (the most active inputs first); groups always stay the
    format's contiguous input groups, so the result is an ordinary per-group weight.

    ``inverse``: ``prepare_hessian(hessian, damp_percent=..., desc_act=..., retries=...)`` computed beforehand, to
    factorize a Hessian once for several layers that read the same input (``hessian`` is then not read, and may be
    None).
    """
    if inverse is None:
        if hessian is None:
            raise ValueError("gptq_quantize needs the Hessian or its prepared inverse (inverse=), got neither")
        inverse = prepare_hessian(hessian, damp_percent=damp_percent, desc_act=desc_act, retries=retries)
    return gptq_sweep(weight, inverse, spec, static_groups=static_groups, block_size=block_size)


@torch.no_grad()
def gptq_sweep(
    weight: torch.Tensor,
    inverse: InverseHessian,
    spec: QuantizationSpec,
    *,
    static_groups: bool = False,
    block_size: int = 128,
) -> GPTQResult:
    """GPTQ's column sweep for a prepared ``InverseHessian`` (see ``gptq_quantize``).

    The weight is held transposed ([columns, rows], one input column per contiguous row): the column being quantized,
    its error and the rank-1 update of the rest of its block are contiguous. Within a block of ``block_size`` columns
    the updates are applied column by column, then the later columns get the block's error in one matmul (the lazy
    batch update of the paper); every value is the float result of the straightforward column-major loop.
    """
    rows, columns = weight.shape
    perm, factor = inverse.perm, inverse.factor
    w = weight.detach().float().clone()
    w[:, inverse.dead] = 0.0

    grouped = spec.qscheme == QSchemeType.per_group
    group_size = int(spec.group_size or columns) if grouped else columns
    if grouped and columns % group_size:
        raise ValueError(f"GPTQ: group_size={group_size} does not divide the {columns} input columns")
    n_groups = columns // group_size if grouped else 1
    quantize = column_quantizer(spec)
    # qparams per group (one "group", the whole row or tensor, without groups): as given, and as column vectors
    scales: list[torch.Tensor | None] = [None] * n_groups
    zps: list[torch.Tensor | None] = [None] * n_groups
    vectors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_groups
    if not grouped or static_groups:
        full_scale, full_zp = observer_qparams(spec, w)
        for g in range(n_groups):
            s, z = (full_scale[:, g : g + 1], full_zp[:, g : g + 1]) if grouped else (full_scale, full_zp)
            scales[g], zps[g], vectors[g] = s, z, _column_qparams(spec, s, z)

    wt = w.index_select(1, perm).T.contiguous()  # [columns, rows] in sweep order
    del w
    position = torch.argsort(perm)  # input column -> sweep position
    group_of = (perm // group_size).tolist() if grouped else [0] * columns
    qt = torch.empty_like(wt)
    losses = torch.zeros(rows, dtype=torch.float32, device=wt.device)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        count = i2 - i1
        w1 = wt[i1:i2]  # updated in place: the sweep reads unvisited columns from wt, inside this block or after it
        h1 = factor[i1:i2, i1:i2]
        diag = h1.diagonal()
        h_rows, d_values = h1.unbind(0), diag.unbind(0)
        qs, diffs, errs = [], [], []
        for i, column in enumerate(w1.unbind(0)):
            g = group_of[i1 + i]
            qparams = vectors[g]
            if qparams is None:  # the first column of this group the sweep reaches: its scales, from now
                current = wt.index_select(0, position[g * group_size : (g + 1) * group_size]).T.contiguous()
                s, z = observer_qparams(spec, current)  # current: [rows, group_size], one group per row
                scales[g], zps[g] = s.reshape(-1, 1), z.reshape(-1, 1)
                qparams = vectors[g] = _column_qparams(spec, s, z)
            q = quantize(column, *qparams)
            diff = torch.sub(column, q)
            err = torch.div(diff, d_values[i])
            if (
                i + 1 < count
            ):  # the rest of the block: one exact product per element, subtracted (no fused multiply-add)
                w1[i + 1 :].sub_(torch.outer(h_rows[i][i + 1 :], err))
            qs.append(q)
            diffs.append(diff)
            errs.append(err)
        torch.stack(qs, out=qt[i1:i2])
        block_losses = torch.stack(diffs).pow_(2).div_(diag.pow(2).unsqueeze(1)).div_(2)
        for row in block_losses.unbind(0):  # column after column, as a running sum per weight row
            losses += row
        if i2 < columns:
            wt[i2:].sub_(factor[i1:i2, i2:].T @ torch.stack(errs))

    q = qt.index_select(0, position).T.contiguous().to(weight.dtype)
    if grouped:
        scale, zero_point = torch.cat(scales, dim=1), torch.cat(zps, dim=1)  # type: ignore[arg-type]
    else:
        scale, zero_point = full_scale, full_zp
    return GPTQResult(q, scale, zero_point, float(losses.sum()), inverse.damp)
