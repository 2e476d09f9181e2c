"""amd-quark's weight layouts (the table in ``quark_format``): which rule stores a weight of a spec
(``weight_layout``), its encoding into codes and companions and the decoding back."""

from __future__ import annotations

import torch

from quark.torch.export.codec import int_codes, scale_view
from quark.torch.export.packing import (
    pack_int4,
    pack_nibbles,
    pack_sextets,
    unpack_int4,
    unpack_nibbles,
    unpack_sextets,
)
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    FloatFormat,
    IntFormat,
    decode,
    dequantize_int,
    encode,
    format_of,
    microexponent_codes,
    quantize_mx,
    round_to_grid,
    to_blocks,
)
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

SUPPORTED = (
    "integer weights (2-16 bits) per tensor, channel (axis 0), group (axis 1 of a 2-D weight) or block; fp8 e4m3/e5m2 "
    "per tensor, channel or block; fp6/fp4 per tensor or channel; OCP MX fp4/fp6/fp8/int8 and mx6/mx9 with blocks "
    "along the input features of a 2-D weight; bf16/fp16"
)


# ----------------------------------------------------------------------------------------------- weights
def unsupported_layout(where: str, spec: QuantizationSpec) -> ValueError:
    return ValueError(
        f"{where}: {spec.dtype.name} {spec.qscheme.name if spec.qscheme else ''} weights have no amd-quark "
        f"style layout; supported: {SUPPORTED}. custom_mode=None writes this project's single-file "
        "format, which stores every format of the engine"
    )


def int_container(fmt: IntFormat) -> torch.dtype:
    """The dtype integer codes other than 4-bit ones are stored in (one code per element)."""
    if fmt.bits <= 8:
        return torch.int8 if fmt.signed else torch.uint8
    return torch.int16 if fmt.signed else torch.int32


def _along_inputs(spec: QuantizationSpec, w: torch.Tensor) -> bool:
    """Groups / blocks run along the input features of a 2-D weight (ch_axis None means the last axis)."""
    return w.ndim == 2 and (-1 if spec.ch_axis is None else spec.ch_axis) in (-1, 1)


def weight_layout(spec: QuantizationSpec, w: torch.Tensor) -> str | None:
    """Which layout rule stores a weight of ``spec`` (None: none does)."""
    fmt = format_of(spec.dtype)
    if spec.is_dynamic and spec.dtype not in (Dtype.bfloat16, Dtype.float16):
        return None
    if spec.dtype == Dtype.mx:
        return "mx" if _along_inputs(spec, w) and spec.mx_element_dtype in _MX_ELEMENTS else None
    if spec.dtype in (Dtype.mx6, Dtype.mx9):  # not bfp16: re-quantizing its grid values can move a block's step
        return "block" if _along_inputs(spec, w) else None
    if spec.dtype in (Dtype.bfloat16, Dtype.float16):
        return "cast"
    scheme = spec.qscheme
    per_tensor_or_channel = scheme == QSchemeType.per_tensor or (
        scheme == QSchemeType.per_channel and spec.ch_axis == 0
    )
    if isinstance(fmt, FloatFormat) and spec.dtype in TORCH_FLOAT8:
        return "float8" if per_tensor_or_channel or scheme == QSchemeType.per_block else None
    if isinstance(fmt, FloatFormat):  # fp6 / fp4 codes, packed per output channel
        rest = int(torch.Size(w.shape[1:]).numel())
        return "minifloat" if per_tensor_or_channel and (fmt.bits == 4 or rest % 4 == 0) else None
    if isinstance(fmt, IntFormat):
        if scheme == QSchemeType.per_group:
            return "int_group" if spec.ch_axis is not None and _along_inputs(spec, w) else None
        return "int" if per_tensor_or_channel or scheme == QSchemeType.per_block else None
    return None


_MX_ELEMENTS = (Dtype.fp4, Dtype.fp6_e3m2, Dtype.fp6_e2m3, Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.int8)


def _pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Minifloat codes [rows, n] packed per row: fp4 two per byte (an odd row padded), fp6 four per three bytes."""
    if bits == 4:
        codes = torch.cat([codes, codes.new_zeros(codes.shape[0], codes.shape[1] % 2)], dim=1)  # each row packs alone
        return pack_nibbles(codes).reshape(codes.shape[0], -1)
    return pack_sextets(codes)


def _unpack_rows(stored: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The inverse of ``_pack_rows``: [rows, count] codes."""
    if bits == 4:
        return unpack_nibbles(stored, stored.numel() * 2, signed=False).reshape(stored.shape[0], -1)[:, :count]
    return unpack_sextets(stored)


def _encode_mx(w: torch.Tensor, spec: QuantizationSpec) -> dict[str, torch.Tensor]:
    """MX weights, blocks along the input features: packed elements [out, ...] and E8M0 scales uint8 [out, in/block]."""
    element = Dtype(spec.mx_element_dtype)
    elements, e8m0 = quantize_mx(w, element, spec.group_size or 32, -1, spec.mx_scale_mode or "floor")
    elements = elements.reshape(w.shape[0], -1)[:, : w.shape[1]] + 0.0  # -0 -> +0: amd-quark stores zeros unsigned
    scale = e8m0.reshape(w.shape[0], -1)
    if element == Dtype.int8:
        return {"": torch.round(elements * 64).to(torch.int8), "_scale": scale}
    if element in TORCH_FLOAT8:
        return {"": elements.to(TORCH_FLOAT8[element]), "_scale": scale}
    efmt = FLOAT_FORMATS[element]
    return {"": _pack_rows(encode(elements, efmt), efmt.bits), "_scale": scale}


MANTISSA_BITS = {Dtype.mx6: 4, Dtype.mx9: 7}
BLOCK_DTYPES = (Dtype.mx, Dtype.mx6, Dtype.mx9, Dtype.bfp16)  # scales per block, no qparams to check or store


def _encode_block(w: torch.Tensor, spec: QuantizationSpec) -> dict[str, torch.Tensor]:
    """mx6 / mx9 of a 2-D weight, blocks along the input features: int8 codes [out, in], the float32 power-of-two
    step of each block [out, in/b] and the 0/1 micro-exponent shift of each pair [out, in/2]; an element is
    ``code * step * 2^-shift``."""
    xb, _ = to_blocks(w, -1, spec.group_size or 16)
    codes, step_exp = microexponent_codes(xb, MANTISSA_BITS[spec.dtype])
    base = step_exp.amax(dim=-1)  # the block's step: elements of a shifted pair have one exponent less
    shift = (base.unsqueeze(-1) - step_exp)[..., ::2]
    return {
        "": codes.to(torch.int8).reshape(w.shape[0], -1)[:, : w.shape[1]].contiguous(),
        "_scale": torch.exp2(base.float()),
        "_shift": shift.to(torch.uint8).reshape(w.shape[0], -1)[:, : (w.shape[1] + 1) // 2].contiguous(),
    }


def _decode_block(t: dict[str, torch.Tensor], key: str, shape: torch.Size, spec: QuantizationSpec) -> torch.Tensor:
    block, n = spec.group_size or 16, int(shape[1])
    values = t[key].float() * t[key + "_scale"].float().repeat_interleave(block, dim=1)[:, :n]
    return torch.ldexp(values, -t[key + "_shift"].to(torch.int32).repeat_interleave(2, dim=1)[:, :n])


def encode_quark_weight(w: torch.Tensor, q: FakeQuantizeBase, pack_method: str, where: str) -> dict[str, torch.Tensor]:
    """One weight in amd-quark's layout (the table in the module docstring): ``{suffix: tensor}``."""
    spec = q.spec
    w = w.detach().float()
    layout = weight_layout(spec, w)
    if layout is None:
        raise unsupported_layout(where, spec)
    if layout == "mx":
        return _encode_mx(w, spec)
    if layout == "cast":
        return {"": q(w).to(torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16)}
    if layout == "block":
        return _encode_block(w, spec)
    scale, zp = q.calculate_qparams()
    scale = scale.detach().float()
    if layout in ("minifloat", "float8"):
        ffmt = FLOAT_FORMATS[spec.dtype]
        view = scale_view(scale, w, spec.qscheme, spec.ch_axis, spec.block_size)
        if layout == "float8":
            return {
                "": (w / view).clamp(-ffmt.max_normal, ffmt.max_normal).to(TORCH_FLOAT8[spec.dtype]),
                "_scale": scale,
            }
        rows = round_to_grid(q(w).float() / view, ffmt).reshape(w.shape[0], -1)
        return {"": _pack_rows(encode(rows, ffmt), ffmt.bits), "_scale": scale}
    fmt = _int_format(spec, where)
    codes = int_codes(w, q, scale, zp, fmt)
    if layout == "int_group":  # transposed: [in, out], scales and zero points [in / g, out]
        codes, scale, zp = codes.t(), scale.t().contiguous(), zp.t()
        if fmt.bits == 4:
            return {"": pack_int4(codes, pack_method), "_scale": scale, "_zero_point": pack_int4(zp, pack_method)}
        return {
            "": codes.to(int_container(fmt)).contiguous(),
            "_scale": scale,
            "_zero_point": zp.to(int_container(fmt)).contiguous(),
        }
    if fmt.bits == 4:
        packed = pack_int4(codes.reshape(w.shape[0], -1), pack_method)
        if spec.qscheme == QSchemeType.per_channel:
            return {"": packed, "_scale": scale, "_zero_point": pack_int4(zp.reshape(1, -1), pack_method)[0]}
        return {"": packed, "_scale": scale, "_zero_point": zp.to(int_container(fmt))}
    return {"": codes.to(int_container(fmt)), "_scale": scale, "_zero_point": zp.to(int_container(fmt))}


def _int_format(spec: QuantizationSpec, where: str) -> IntFormat:
    fmt = format_of(spec.dtype)
    if not isinstance(fmt, IntFormat):
        raise unsupported_layout(where, spec)
    return fmt


def _decode_mx(stored: torch.Tensor, scale: torch.Tensor, shape: torch.Size, spec: QuantizationSpec) -> torch.Tensor:
    element = Dtype(spec.mx_element_dtype)
    if element == Dtype.int8:
        values = stored.float() / 64
    elif element in TORCH_FLOAT8:
        values = stored.float()
    else:
        efmt = FLOAT_FORMATS[element]
        values = decode(_unpack_rows(stored, efmt.bits, int(shape[1])), efmt)
    exp = scale.to(torch.int32) - 127
    return values * torch.exp2(exp.float()).repeat_interleave(spec.group_size or 32, dim=1)[:, : shape[1]]


def decode_quark_weight(
    t: dict[str, torch.Tensor], key: str, shape: torch.Size, spec: QuantizationSpec, pack_method: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dequantized weight, scale, zero point in our layout; None for formats without qparams) of one stored weight."""
    stored, scale = t[key], t.get(key + "_scale")
    layout = weight_layout(spec, torch.empty(shape, device="meta"))
    if layout == "mx":
        return _decode_mx(stored, scale, shape, spec), None, None  # type: ignore[arg-type]
    if layout == "cast":
        return stored.float(), None, None
    if layout == "block":
        return _decode_block(t, key, shape, spec), None, None
    if scale is None:
        raise ValueError(f"tensor '{key}_scale' is missing (the config quantizes '{key}' as {spec.dtype.name})")
    scale = scale.float()
    if layout in ("minifloat", "float8"):
        ffmt = FLOAT_FORMATS[spec.dtype]
        count = int(torch.Size(shape[1:]).numel())
        values = (
            stored.float()
            if layout == "float8"
            else decode(_unpack_rows(stored, ffmt.bits, count), ffmt).reshape(shape)
        )
        view = scale_view(scale, values, spec.qscheme, spec.ch_axis, spec.block_size)
        return values * view, scale, torch.zeros_like(scale, dtype=torch.int32)
    fmt = format_of(spec.dtype)
    if not isinstance(fmt, IntFormat):
        raise ValueError(f"tensor '{key}': stored as {stored.dtype}, which no {spec.dtype.name} weight is stored as")
    zp_stored = t.get(key + "_zero_point")
    if layout == "int_group":
        if fmt.bits == 4:
            codes = unpack_int4(stored, shape[0], fmt.signed, pack_method).t()
            zp = unpack_int4(zp_stored, shape[0], fmt.signed, pack_method).t() if zp_stored is not None else None
        else:
            codes, zp = stored.to(torch.int32).t(), None if zp_stored is None else zp_stored.to(torch.int32).t()
        scale = scale.t().contiguous()
    elif fmt.bits == 4:
        count = int(torch.Size(shape[1:]).numel())
        codes = unpack_int4(stored, count, fmt.signed, pack_method).reshape(shape)
        if zp_stored is not None and spec.qscheme == QSchemeType.per_channel:
            zp = unpack_int4(zp_stored.reshape(1, -1), shape[0], fmt.signed, pack_method)[0]
        else:
            zp = None if zp_stored is None else zp_stored.to(torch.int32)
    else:
        codes, zp = stored.to(torch.int32), None if zp_stored is None else zp_stored.to(torch.int32)
    zp = torch.zeros_like(scale, dtype=torch.int32) if zp is None else zp.to(torch.int32)
    values = dequantize_int(
        codes,
        scale,
        zp,
        qscheme=spec.qscheme,
        axis=spec.ch_axis,
        group_size=spec.group_size,
        block_size=spec.block_size,
    )
    return values.float(), scale, zp
