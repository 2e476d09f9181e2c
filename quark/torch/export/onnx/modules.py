"""The export forms of frozen quantizers as torch modules: torch's fused fake quantization (``QDQ``, written as
QuantizeLinear + DequantizeLinear), and the placeholders the exporter traces as ``quark.lowbit`` nodes for what it
cannot write (``StoredWeight``: a weight's codes; ``Float8QDQ``: an fp8 activation)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from quark.torch.export.onnx.specs import FLOAT8_TYPES, PLACEHOLDER_DOMAIN
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import TORCH_FLOAT8, decode, fake_quantize, format_of, int_range, quantize_int
from quark.torch.quantization.formats.grouping import channel_view


class QDQ(nn.Module):
    """One quantizer as torch's fused fake quantization (exported as QuantizeLinear + DequantizeLinear)."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, axis: int | None) -> None:
        super().__init__()
        self.register_buffer(
            "scale", scale.detach().float().reshape(-1) if axis is not None else scale.detach().float().reshape(())
        )
        self.register_buffer("zero_point", zero_point.detach().to(torch.int32).reshape(-1 if axis is not None else ()))
        self.qmin, self.qmax, self.axis = qmin, qmax, axis
        # per tensor, torch's op takes Python numbers: read once here, not in forward (where the tracer warns about it)
        self.per_tensor = (float(self.scale), int(self.zero_point)) if axis is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_tensor is not None:
            scale, zero_point = self.per_tensor
            return torch.fake_quantize_per_tensor_affine(x, scale, zero_point, self.qmin, self.qmax)
        return torch.fake_quantize_per_channel_affine(x, self.scale, self.zero_point, self.axis, self.qmin, self.qmax)


def dequantize_linear(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, fmt: str, axis: int | None, block: int
) -> torch.Tensor:
    """ONNX DequantizeLinear in torch: ``(codes - zero_point) * scale`` with the qparams laid out as ONNX reads them
    (one value; one per index of ``axis``; with ``block``, one per block of ``axis``); fp8 codes are bit patterns."""
    dtype = Dtype(fmt)
    if dtype in FLOAT8_TYPES:
        values = decode(codes, format_of(dtype))  # type: ignore[arg-type]  # arithmetic: the tracer cannot view as fp8
    else:
        values = (codes.to(torch.int32) - _along(zero_point.to(torch.int32), codes, axis, block)).float()
    return values * _along(scale, codes, axis, block)


def _along(param: torch.Tensor, like: torch.Tensor, axis: int | None, block: int) -> torch.Tensor:
    """``param`` broadcast to ``like`` along ``axis`` as DequantizeLinear does (each value repeated over its block)."""
    if axis is None:
        return param.reshape(())
    if block:
        return param.repeat_interleave(block, dim=axis).narrow(axis, 0, like.shape[axis])
    return channel_view(param, like.ndim, axis)


def _onnx_layout(param: torch.Tensor, w: torch.Tensor, qscheme: QSchemeType, axis: int | None) -> torch.Tensor:
    """A scale or zero point in DequantizeLinear's layout: per group, the engine's [..., groups] (``w`` with ``axis``
    moved last, split into groups) with the groups moved back to ``axis``; per channel 1-D; per tensor a scalar."""
    if qscheme == QSchemeType.per_group:
        return param.reshape(*w.movedim(axis, -1).shape[:-1], -1).movedim(-1, axis).contiguous()  # type: ignore[arg-type]
    return param.reshape(()) if axis is None else param.reshape(-1)


def _codes(
    spec: Any, w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None, round_method: RoundType
) -> torch.Tensor:
    """The codes the simulation rounds ``w`` to, one byte each: integers as int8 / uint8 (rounded by the quantizer's
    ``round_method``), fp8 as bit patterns."""
    if spec.dtype in FLOAT8_TYPES:
        limit = format_of(spec.dtype).max_normal  # type: ignore[union-attr]
        s = scale.reshape(()) if axis is None else channel_view(scale, w.ndim, axis)
        return (w / s).clamp(-limit, limit).to(TORCH_FLOAT8[spec.dtype]).view(torch.uint8)
    qmin, qmax = int_range(spec.dtype)
    codes = quantize_int(
        w,
        scale,
        zero_point,
        qmin,
        qmax,
        round_method=round_method,
        qscheme=spec.qscheme,
        axis=axis,
        group_size=spec.group_size,
    )
    return codes.to(torch.int8 if qmin < 0 else torch.uint8)


class _DequantizeCodes(torch.autograd.Function):
    """Stored codes dequantized; traced as one ``quark.lowbit::DequantizeCodes`` node carrying format and layout."""

    @staticmethod
    def forward(ctx, codes, scale, zero_point, fmt, axis, block, name):  # type: ignore[override]
        return dequantize_linear(codes, scale, zero_point, fmt, axis, block)

    @staticmethod
    def symbolic(g, codes, scale, zero_point, fmt, axis, block, name):  # type: ignore[no-untyped-def]
        attrs: dict[str, Any] = {"fmt_s": fmt, "name_s": name, "block_size_i": block}
        if axis is not None:
            attrs["axis_i"] = axis
        out = g.op(f"{PLACEHOLDER_DOMAIN}::DequantizeCodes", codes, scale, zero_point, **attrs)
        out.setType(codes.type().with_dtype(torch.float32))
        return out


class StoredWeight(nn.Module):
    """A weight (or bias) quantizer replaced by the codes it rounds the tensor to, so that the graph holds codes and
    no float copy; the codes and qparams are kept in DequantizeLinear's layout."""

    def __init__(self, quantizer: nn.Module, tensor: torch.Tensor, where: str, name: str) -> None:
        super().__init__()
        spec = quantizer.spec  # type: ignore[attr-defined]
        w = tensor.detach().float()
        scale, zero_point = (p.detach() for p in quantizer.calculate_qparams())  # type: ignore[operator]
        self.fmt, self.name = spec.dtype.name, name
        self.axis = None if spec.qscheme == QSchemeType.per_tensor else spec.ch_axis % w.ndim
        self.block = spec.group_size if spec.qscheme == QSchemeType.per_group else 0
        codes = _codes(spec, w, scale.float(), zero_point, self.axis, quantizer.round_method)  # type: ignore[arg-type]
        zero_point = torch.zeros_like(zero_point) if spec.dtype in FLOAT8_TYPES else zero_point
        self.register_buffer("codes", codes)
        self.register_buffer("scale", _onnx_layout(scale.float(), w, spec.qscheme, self.axis))
        self.register_buffer("zero_point", _onnx_layout(zero_point.to(codes.dtype), w, spec.qscheme, self.axis))
        if not torch.equal(self(w), quantizer(w).float()):  # what the graph computes is the simulation's tensor
            raise RuntimeError(f"{where}: the stored {self.fmt} codes do not reproduce the fake-quantized tensor")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():  # traced, the sizes are tensors; a weight's shape is a constant of the graph
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            mismatch = x.shape != self.codes.shape
        if mismatch:  # the layer quantizes another tensor than its Parameter: the codes would not fit
            raise RuntimeError(
                f"{self.name}: quantizer called on shape {tuple(x.shape)}, the stored codes are {tuple(self.codes.shape)}"
            )
        return _DequantizeCodes.apply(
            self.codes, self.scale, self.zero_point, self.fmt, self.axis, self.block, self.name
        )


class _QuantizeDequantizeFloat8(torch.autograd.Function):
    """fp8 fake quantization per tensor; traced as one ``quark.lowbit::QuantizeDequantize`` node."""

    @staticmethod
    def forward(ctx, x, scale, fmt, name):  # type: ignore[override]
        return fake_quantize(x, Dtype(fmt), scale)

    @staticmethod
    def symbolic(g, x, scale, fmt, name):  # type: ignore[no-untyped-def]
        out = g.op(f"{PLACEHOLDER_DOMAIN}::QuantizeDequantize", x, scale, fmt_s=fmt, name_s=name)
        out.setType(x.type())
        return out


class Float8QDQ(nn.Module):
    """An fp8 activation quantizer (per tensor), exported as QuantizeLinear to fp8 + DequantizeLinear."""

    def __init__(self, scale: torch.Tensor, fmt: str, name: str) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().float().reshape(()))
        self.fmt, self.name = fmt, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuantizeDequantizeFloat8.apply(x, self.scale, self.fmt, self.name)
