"""amd-quark 0.13's export directory, both ways: ``config.json`` (the model's config, for a Hugging Face model, plus
``quantization_config`` with ``quant_method: "quark"``) and ``model.safetensors`` with amd-quark's key names, dtypes and
packing. This is what amd-quark's ``import_model_from_safetensors`` and vLLM's quark loader read.

Per quantized layer (a twin with a ``weight`` slot), for ``weight_format="real_quantized"``. Rows marked (ext.) are
formats amd-quark 0.13 does not export; they follow the same rules (codes under the weight's name, ``_scale`` /
``_zero_point`` beside them, per-group weights transposed, 4-bit codes packed eight per int32):

| weight spec | ``<layer>.weight`` | ``weight_scale`` | ``weight_zero_point`` |
|---|---|---|---|
| int8 / uint8, per tensor or channel (axis 0) | int8 / uint8 codes, the weight's shape | float32, () or [out] | int8 / uint8, same shape |
| int8 / uint8 per group (axis 1) | int8 / uint8 [in, out]: transposed | float32 [in/g, out] | int8 / uint8 [in/g, out] |
| int4 / uint4 per channel | int32 [out, in/8], 8 nibbles each | float32 [out] | int32 [out/8], packed |
| int4 / uint4 per group (axis 1) | int32 [in, out/8]: transposed, packed | float32 [in/g, out] | int32 [in/g, out/8] |
| fp8 e4m3 / e5m2, per tensor or channel | float8 values, the weight's shape | float32, () or [out] | none |
| OCP MX fp4 (blocks along in) | uint8 [out, in/2], element 2k in the low nibble | uint8 E8M0 [out, in/32] | none |
| OCP MX fp6 e3m2 / e2m3 | uint8 [out, 3 in/4]: 4 codes per 24-bit little-endian word | uint8 E8M0 [out, in/32] | none |
| (ext.) OCP MX fp8 / int8 | float8 / int8 (element x 64) [out, in] | uint8 E8M0 [out, in/32] | none |
| (ext.) fp8 or integer per_block [r, c] | as per tensor | float32 [out/r, in/c] | integers: [out/r, in/c] |
| (ext.) int2/3/5-7 (int8 / uint8), int9-16 (int16), uint9-16 (int32) | codes as the 8-bit rows | as the 8-bit rows | as the codes |
| (ext.) int4 per tensor / channel of a conv | int32 [out, k/8]: the weight flattened per output channel | float32 | int32 / int8 |
| (ext.) bf16 / fp16 | the rounded weight in that dtype | none | none |
| (ext.) mx6 / mx9 (blocks along in) | int8 sign-magnitude codes [out, in] | float32 step per block [out, in/b] | ``weight_shift`` uint8 0/1 per pair [out, in/2] |
| (ext.) fp6 / fp4 per tensor or channel | uint8 codes per output channel: fp6 as MX fp6, fp4 two per byte | float32, () or [out] | none |

4-bit packing puts element ``8c + order[i]`` in bits ``4i..4i+3`` of int32 ``c``, with ``order = 0 2 4 6 1 3 5 7``
for ``pack_method="reorder"`` (amd-quark's default) and ``0..7`` for ``"order"``. Static activation quantizers
store ``input_scale`` (float32) and ``input_zero_point`` (integer formats, in the codes' dtype); ``output_*``
likewise; dynamic and MX activations store nothing. A transformers ``Conv1D`` (GPT-2; weight kept [in, out]) is
stored as the equivalent ``nn.Linear``: the rows above apply to its transposed weight, [out, in]. Everything else of
the state_dict is stored as it is. Not
expressible here (a ValueError before anything is written; ``custom_mode=None`` stores them): bfp16, per-group
minifloats, quantized biases and the extra slots of LSTMs and attention.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.export.packing import pack_nibbles, pack_sextets, unpack_nibbles, unpack_sextets
from quark.torch.export.safetensors import (
    _Checker,
    _described,
    _require_safetensors,
    _scale_view,
    check_header,
    check_model_tensors,
    decoded_weight_quantizer,
    first_of_its_storage,
    stored_quantizer,
)
from quark.torch.export.skeleton import materialize
from quark.torch.quantization.api import ModelQuantizer, uncalibrated_layers
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    decode,
    dequantize_int,
    encode,
    format_of,
    microexponent_codes,
    quantize_int,
    quantize_mx,
    round_to_grid,
    to_blocks,
)
from quark.torch.quantization.formats.grouping import tile_layout
from quark.torch.quantization.formats.table import MXINT8_QMAX, FloatFormat, IntFormat
from quark.torch.quantization.hf import is_hf_conv1d, linear_weight, transpose_weight_spec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import DEFAULT_SLOTS, shared_tensors, slot_label
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, FrozenScaledFakeQuantize

__all__ = ["export_quark_dir", "import_quark_dir", "is_quark_dir", "to_quark_dict", "from_quark_dict", "pack_int4", "unpack_int4"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
QUARK_VERSION = "0.13"
PACK_ORDER = {"reorder": (0, 2, 4, 6, 1, 3, 5, 7), "order": (0, 1, 2, 3, 4, 5, 6, 7)}
SUPPORTED = (
    "integer weights (2-16 bits) per tensor, channel (axis 0), group (axis 1 of a 2-D weight) or block; fp8 e4m3/e5m2 "
    "per tensor, channel or block; fp6/fp4 per tensor or channel; OCP MX fp4/fp6/fp8/int8 and mx6/mx9 with blocks "
    "along the input features of a 2-D weight; bf16/fp16"
)
_SPEC_KEYS = ("dtype", "is_dynamic", "observer_cls", "qscheme", "ch_axis", "group_size", "symmetric", "round_method",
              "scale_type", "mx_element_dtype", "zero_point_type", "scale_format", "scale_calculation_mode", "block_size")  # fmt: skip


# ----------------------------------------------------------------------------------------------- 4-bit packing
def pack_int4(codes: torch.Tensor, pack_method: str = "reorder") -> torch.Tensor:
    """amd-quark's 4-bit packing along the last axis: [..., n] integer codes -> [..., ceil(n/8)] int32."""
    order = torch.tensor(PACK_ORDER[pack_method])
    n = codes.shape[-1]
    flat = codes.to(torch.int64) & 0xF
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(*flat.shape[:-1], pad)], dim=-1)
    groups = flat.reshape(*flat.shape[:-1], -1, 8)[..., order]  # nibble i holds element 8c + order[i]
    word = (groups << (4 * torch.arange(8))).sum(dim=-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def unpack_int4(packed: torch.Tensor, count: int, signed: bool, pack_method: str = "reorder") -> torch.Tensor:
    """The inverse of ``pack_int4``: [..., m] int32 -> [..., count] int32 codes (sign-extended when ``signed``)."""
    order = torch.tensor(PACK_ORDER[pack_method])
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF  # [..., m, 8], position i
    out = torch.empty_like(nibbles)
    out[..., order] = nibbles
    out = out.reshape(*packed.shape[:-1], -1)[..., :count]
    if signed:
        out = torch.where(out >= 8, out - 16, out)
    return out.to(torch.int32)


# ----------------------------------------------------------------------------------------------- the config
def _spec_to_quark(spec: QuantizationSpec | None) -> dict[str, Any] | None:
    """One QuantizationSpec as amd-quark 0.13 writes a QTensorConfig (MX with its element dtype and e8m0)."""
    if spec is None:
        return None
    d = {k: v for k, v in spec.to_dict().items() if k in _SPEC_KEYS}
    if spec.dtype == Dtype.mx and spec.mx_element_dtype != Dtype.int8:
        d.update(dtype=spec.mx_element_dtype.name, mx_element_dtype=None, scale_format="e8m0",  # type: ignore[union-attr]
                 scale_calculation_mode=spec.mx_scale_mode)  # fmt: skip
    d.setdefault("block_size", None)
    d.update(enable_buffer_reuse=False, is_scale_quant=False, max_input_numel=4 * 1024 * 1024)
    d.pop("qat_spec", None)
    return dict(sorted(d.items()))


def _layer_to_quark(qc: QuantizationConfig) -> dict[str, Any]:
    return {role: _spec_to_quark(getattr(qc, role)) for role in QuantizationConfig.ROLES} | {"target_device": None}


def to_quark_dict(config: Config, weight_format: str = "real_quantized", pack_method: str = "reorder") -> dict[str, Any]:
    """The ``quantization_config`` amd-quark 0.13 writes into config.json for ``config``."""
    return {
        "algo_config": None,  # already applied to the weights
        "exclude": list(config.exclude),
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": pack_method, "weight_format": weight_format,
                   "weight_merge_groups": None},  # fmt: skip
        "global_quant_config": _layer_to_quark(config.global_quant_config),
        "kv_cache_post_rope": False,
        "kv_cache_quant_config": {},
        "layer_quant_config": {k: _layer_to_quark(v) for k, v in config.layer_quant_config.items()},
        "layer_type_quant_config": {k: _layer_to_quark(v) for k, v in config.layer_type_quant_config.items()},
        "quant_method": "quark",
        "quant_mode": config.quant_mode.name,
        "softmax_quant_spec": None,
        "version": QUARK_VERSION,
    }


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a ValueError naming the key ``where`` of config.json."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, found {type(value).__name__} {value!r}")
    return value


def _spec_from_quark(d: Any, where: str) -> QuantizationSpec | None:
    """One QTensorConfig of amd-quark's config.json (None: not quantized); a ValueError names its key otherwise."""
    if d is None:
        return None
    fields = {k: v for k, v in _mapping(d, where).items() if k in _SPEC_KEYS}
    try:
        return QuantizationSpec.from_dict(fields)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: {err}") from None


def _layer_from_quark(d: Any, where: str) -> QuantizationConfig:
    """One layer entry of amd-quark's config.json (a spec per role)."""
    roles = _mapping(d, where)
    return QuantizationConfig(**{role: _spec_from_quark(roles.get(role), f"{where}.{role}") for role in QuantizationConfig.ROLES})


def _entries_from_quark(q: dict[str, Any], key: str) -> dict[str, QuantizationConfig]:
    """``layer_quant_config`` / ``layer_type_quant_config``: name -> layer entry (absent or null: none)."""
    where = f"quantization_config.{key}"
    return {str(k): _layer_from_quark(v, f"{where}.{k}") for k, v in _mapping(q.get(key) or {}, where).items()}


def check_export_options(weight_format: Any, pack_method: Any, where: str = "") -> None:
    """The export options this layout reads and writes (one rule for export and import): real_quantized weights,
    ``pack_method`` one of PACK_ORDER."""
    if weight_format != "real_quantized":
        raise ValueError(f"{where}weight_format={weight_format!r}; allowed here: 'real_quantized'")
    if not isinstance(pack_method, str) or pack_method not in PACK_ORDER:
        raise ValueError(f"{where}pack_method={pack_method!r}; allowed: {list(PACK_ORDER)}")


def from_quark_dict(q: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """Our Config from amd-quark's ``quantization_config``, and its ``export`` block (checked); a malformed entry
    is a ValueError naming its key."""
    q = _mapping(q, "quantization_config")
    if q.get("quant_method") != "quark":
        raise ValueError(f"quantization_config.quant_method={q.get('quant_method')!r}; only 'quark' directories are read")
    for key in ("kv_cache_quant_config", "softmax_quant_spec"):
        if q.get(key):
            raise ValueError(f"quantization_config.{key} is set; KV-cache and softmax quantization are not supported here")
    if "global_quant_config" not in q:
        raise ValueError("quantization_config.global_quant_config is missing (amd-quark writes it in every export)")
    exclude = q.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise ValueError(f"quantization_config.exclude must be a list of layer names, found {exclude!r}")
    export = dict(_mapping(q.get("export") or {}, "quantization_config.export"))
    export.setdefault("weight_format", "real_quantized")
    export.setdefault("pack_method", "reorder")
    check_export_options(export["weight_format"], export["pack_method"], "quantization_config.export.")
    layers = {
        "global_quant_config": _layer_from_quark(q["global_quant_config"], "quantization_config.global_quant_config"),
        "layer_quant_config": _entries_from_quark(q, "layer_quant_config"),
        "layer_type_quant_config": _entries_from_quark(q, "layer_type_quant_config"),
    }
    try:
        return Config(**layers, exclude=list(exclude), quant_mode=q.get("quant_mode", "eager_mode")), export
    except (ValueError, TypeError, KeyError) as err:  # the Config's own checks name the field
        raise ValueError(f"quantization_config: {err}") from None


# ----------------------------------------------------------------------------------------------- weights
def _unsupported(where: str, spec: QuantizationSpec) -> ValueError:
    return ValueError(f"{where}: {spec.dtype.name} {spec.qscheme.name if spec.qscheme else ''} weights have no amd-quark "
                      f"style layout; supported: {SUPPORTED}. custom_mode=None writes this project's single-file "
                      "format, which stores every format of the engine")  # fmt: skip


def _container(fmt: IntFormat) -> torch.dtype:
    """The dtype integer codes other than 4-bit ones are stored in (one code per element)."""
    if fmt.bits <= 8:
        return torch.int8 if fmt.signed else torch.uint8
    return torch.int16 if fmt.signed else torch.int32


def _along_inputs(spec: QuantizationSpec, w: torch.Tensor) -> bool:
    """Groups / blocks run along the input features of a 2-D weight (ch_axis None means the last axis)."""
    return w.ndim == 2 and (-1 if spec.ch_axis is None else spec.ch_axis) in (-1, 1)


def _layout(spec: QuantizationSpec, w: torch.Tensor) -> str | None:
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
    per_tensor_or_channel = scheme == QSchemeType.per_tensor or (scheme == QSchemeType.per_channel and spec.ch_axis == 0)
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


_MANTISSA_BITS = {Dtype.mx6: 4, Dtype.mx9: 7}
_BLOCK_DTYPES = (Dtype.mx, Dtype.mx6, Dtype.mx9, Dtype.bfp16)  # scales per block, no qparams to check or store


def _encode_block(w: torch.Tensor, spec: QuantizationSpec) -> dict[str, torch.Tensor]:
    """mx6 / mx9 of a 2-D weight, blocks along the input features: int8 codes [out, in], the float32 power-of-two
    step of each block [out, in/b] and the 0/1 micro-exponent shift of each pair [out, in/2]; an element is
    ``code * step * 2^-shift``."""
    xb, _ = to_blocks(w, -1, spec.group_size or 16)
    codes, step_exp = microexponent_codes(xb, _MANTISSA_BITS[spec.dtype])
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


def _encode_weight(w: torch.Tensor, q: FakeQuantizeBase, pack_method: str, where: str) -> dict[str, torch.Tensor]:
    """One weight in amd-quark's layout (the table in the module docstring): ``{suffix: tensor}``."""
    spec = q.spec
    w = w.detach().float()
    layout = _layout(spec, w)
    if layout is None:
        raise _unsupported(where, spec)
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
        view = _scale_view(scale, w, spec.qscheme, spec.ch_axis, spec.block_size)
        if layout == "float8":
            return {"": (w / view).clamp(-ffmt.max_normal, ffmt.max_normal).to(TORCH_FLOAT8[spec.dtype]), "_scale": scale}
        rows = round_to_grid(q(w).float() / view, ffmt).reshape(w.shape[0], -1)
        return {"": _pack_rows(encode(rows, ffmt), ffmt.bits), "_scale": scale}
    fmt = _int_format(spec, where)
    codes = quantize_int(w, scale, zp, fmt.qmin, fmt.qmax, round_method=q.round_method, qscheme=spec.qscheme,
                         axis=spec.ch_axis, group_size=spec.group_size, block_size=spec.block_size)  # fmt: skip
    if layout == "int_group":  # transposed: [in, out], scales and zero points [in / g, out]
        codes, scale, zp = codes.t(), scale.t().contiguous(), zp.t()
        if fmt.bits == 4:
            return {"": pack_int4(codes, pack_method), "_scale": scale, "_zero_point": pack_int4(zp, pack_method)}
        return {"": codes.to(_container(fmt)).contiguous(), "_scale": scale, "_zero_point": zp.to(_container(fmt)).contiguous()}
    if fmt.bits == 4:
        packed = pack_int4(codes.reshape(w.shape[0], -1), pack_method)
        if spec.qscheme == QSchemeType.per_channel:
            return {"": packed, "_scale": scale, "_zero_point": pack_int4(zp.reshape(1, -1), pack_method)[0]}
        return {"": packed, "_scale": scale, "_zero_point": zp.to(_container(fmt))}
    return {"": codes.to(_container(fmt)), "_scale": scale, "_zero_point": zp.to(_container(fmt))}


def _int_format(spec: QuantizationSpec, where: str) -> IntFormat:
    fmt = format_of(spec.dtype)
    if not isinstance(fmt, IntFormat):
        raise _unsupported(where, spec)
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


def _decode_weight(t: dict[str, torch.Tensor], key: str, shape: torch.Size, spec: QuantizationSpec, pack_method: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dequantized weight, scale, zero point in our layout; None for formats without qparams) of one stored weight."""
    stored, scale = t[key], t.get(key + "_scale")
    layout = _layout(spec, torch.empty(shape, device="meta"))
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
        values = stored.float() if layout == "float8" else decode(_unpack_rows(stored, ffmt.bits, count), ffmt).reshape(shape)
        view = _scale_view(scale, values, spec.qscheme, spec.ch_axis, spec.block_size)
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
    values = dequantize_int(codes, scale, zp, qscheme=spec.qscheme, axis=spec.ch_axis, group_size=spec.group_size,
                            block_size=spec.block_size)  # fmt: skip
    return values.float(), scale, zp


# ----------------------------------------------------------------------------------------------- export / import
def _layers(model: nn.Module) -> list[tuple[str, QuantMixin]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, QuantMixin)]


def export_quark_dir(model: nn.Module, output_dir: str | Path, weight_format: str = "real_quantized", pack_method: str = "reorder") -> Path:
    """Write amd-quark 0.13's export directory for a model prepared and calibrated (or frozen) by ModelQuantizer.
    Returns the directory. Each file is written atomically."""
    st = _require_safetensors()
    check_export_options(weight_format, pack_method)
    config: Config | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("export needs a model prepared by ModelQuantizer (it has no quant_config)")
    check_quark_exportable(model)
    floated = _unreached_for_export(model)
    tensors: dict[str, torch.Tensor] = {}
    for name, m in _layers(model):
        if name in floated:
            continue  # its float weights go out with the rest of the state dict; the config excludes it
        prefix = f"{name}." if name else ""
        wq = _stored_weight_quantizer(m)
        if wq is not None:
            weight, wq = _as_linear(m, wq)
            for suffix, value in _encode_weight(weight, wq, pack_method, f"layer '{name}'").items():  # type: ignore[arg-type]
                tensors[prefix + "weight" + suffix] = value.detach().contiguous()
        for role in ("input", "output"):
            q = getattr(m, f"_{role}_quantizer", None)
            if q is None or q.is_dynamic or not hasattr(q, "calculate_qparams") or q.spec.dtype in _BLOCK_DTYPES:
                continue
            scale, zp = q.calculate_qparams()
            tensors[f"{prefix}{role}_scale"] = scale.detach().float().clone()
            fmt = format_of(q.spec.dtype)
            if isinstance(fmt, IntFormat):
                tensors[f"{prefix}{role}_zero_point"] = zp.detach().to(_container(fmt)).clone()
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, value in model.state_dict(keep_vars=True).items():  # the rest as it is (quantized weights are stored)
        if key in tensors or "_quantizer." in key:  # quantizer state is never stored
            continue
        if first_of_its_storage(value, seen):  # a tied tensor (an lm_head sharing the input embedding): stored once
            tensors[key] = value.detach().contiguous()
    hf = getattr(model, "config", None)
    document = hf.to_dict() if hasattr(hf, "to_dict") else {}
    if document and not document.get("architectures") and type(model).__module__.startswith("transformers."):
        document["architectures"] = [type(model).__name__]  # what save_pretrained writes: import with model=None builds it
    stored = _as_amd_quark(config, model)
    if floated:
        stored = dataclasses.replace(stored, exclude=list(stored.exclude) + [n for n in floated if n not in stored.exclude])
    document["quantization_config"] = to_quark_dict(stored, weight_format, pack_method)
    out = Path(output_dir)
    write_atomically(out, WEIGHTS_FILE, lambda tmp: st.save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata={"format": "pt"}))
    write_atomically(out, CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n"))
    return out


def unreached_layers(model: nn.Module) -> list[str]:
    """Quantized layers that calibration never reached: ``uncalibrated_layers``, or run in float by
    ``ModelQuantizer.freeze``. Both exports write them in float and add them to the stored config's ``exclude``."""
    return sorted(uncalibrated_layers(model) | {
        name for name, m in _layers(model) if getattr(m, "_quant_unreached", False) and not list(m.quantizer_slots())
    })  # fmt: skip


def _unreached_for_export(model: nn.Module) -> list[str]:
    """``unreached_layers``, with a warning naming them: amd-quark and vLLM load them as float rather than with a
    placeholder input scale."""
    floated = unreached_layers(model)
    if floated:
        warnings.warn(
            f"layer(s) that no calibration forward reached are exported in float and excluded in the stored config: "
            f"{floated}. vLLM quantizes a fused MoE layer's experts alike, whatever exclude says of one "
            "expert: calibrate with data that reaches every expert before serving such a model there.",
            stacklevel=3,
        )
    return floated


_STORED_SLOTS = {"_weight_quantizer", "_input_quantizer", "_output_quantizer"}


class _TransposedQuantizer:
    """A transformers ``Conv1D``'s weight quantizer seen from the equivalent ``nn.Linear``: its spec transposed back,
    called on [out, in]. Its qparams already have Linear's layout."""

    def __init__(self, quantizer: FakeQuantizeBase) -> None:
        self.quantizer = quantizer
        self.spec = transpose_weight_spec(quantizer.spec)
        self.fake_quant_enabled = quantizer.fake_quant_enabled
        self.round_method = quantizer.round_method

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantizer.calculate_qparams()

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return self.quantizer(w.t()).t()


def _as_linear(m: nn.Module, wq: Any) -> tuple[torch.Tensor, Any]:
    """(weight, quantizer) as for ``nn.Linear``: a ``Conv1D`` is stored as the equivalent Linear ([out, in] weight,
    amd-quark's Linear layouts), so every layout rule and reader of Linear weights applies to it unchanged."""
    if is_hf_conv1d(m):
        return linear_weight(m), _TransposedQuantizer(wq)
    return m.weight, wq


_WEIGHT_SLOT = next(s for s in DEFAULT_SLOTS if s.attr == "_weight_quantizer")


def _stored_weight_quantizer(m: QuantMixin) -> FakeQuantizeBase | None:
    """The quantizer whose codes the directory stores for ``m``'s weight (``stored_quantizer``: with fake quant
    switched off, a pass-through one when the weight is on its grid); None: no quantized weight to store."""
    wq = getattr(m, "_weight_quantizer", None)
    if wq is None or not isinstance(getattr(m, "weight", None), torch.Tensor):
        return None
    return stored_quantizer(m.weight, wq)


def _switched_off(where: str, what: str) -> ValueError:
    """A quantizer with fake quant off, which config.json cannot express: the model runs that tensor in float."""
    return ValueError(
        f"{where}: its quantizer's fake quant is switched off, so the model computes with the float {what}, but "
        "amd-quark's config.json would say it is quantized (and the import would quantize it). Switch it back on "
        "(quantizer.enable_fake_quant()) to export it quantized, or exclude the layer (Config.exclude) or give it a "
        "layer_quant_config entry without that tensor and quantize again to export it in float; custom_mode=None "
        "writes this project's single file, which stores what the model computes"
    )


def check_quark_exportable(model: nn.Module) -> None:
    """Before anything is written: every quantized tensor of ``model`` has a layout here, and every quantizer
    config.json names is applied by the model: fake quant on, or a weight on its quantizer's grid, which is stored as
    its codes (a ValueError names the first layer and slot that fails)."""
    for name, m in _layers(model):
        for slot, q in m.quantizer_slots():
            where = f"layer '{name}' ({slot_label(slot)})"
            if slot.attr not in _STORED_SLOTS:
                raise ValueError(f"{where}: amd-quark's layout stores the weight, input and output quantizers of a layer "
                                 "only; custom_mode=None writes this project's single-file format, which stores every slot")  # fmt: skip
            stored = _stored_weight_quantizer(m) if slot.attr == "_weight_quantizer" else q
            if not bool(q.fake_quant_enabled) and stored is q:
                raise _switched_off(where, f"{slot.role.removesuffix('_tensors')}s")
            if stored is None:
                raise _switched_off(where, "weight, which is not on the grid of its quantizer's qparams")
            if slot.attr == "_weight_quantizer":
                weight, wq = _as_linear(m, stored)
                if _layout(wq.spec, weight) is None:
                    raise _unsupported(where, wq.spec)


def _as_amd_quark(config: Config, model: nn.Module) -> Config:
    """``config`` under amd-quark's rule (an entry is a layer's whole config). With ``inherit_roles`` the per-layer
    and per-type entries become, for each layer whose config differs from the global one, the config it got."""
    if not config.inherit_roles or not (config.layer_quant_config or config.layer_type_quant_config):
        return config
    own = {name: m.quant_config for name, m in _layers(model) if m.quant_config != config.global_quant_config}
    return Config(global_quant_config=config.global_quant_config, layer_quant_config=own, exclude=list(config.exclude),
                  quant_mode=config.quant_mode)  # fmt: skip


def is_quark_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds an amd-quark style export (config.json with a quark quantization_config)."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("quantization_config", {}).get("quant_method") == "quark"
    except (json.JSONDecodeError, AttributeError):
        return False


def _read_quark_config(path: Path) -> tuple[Config, dict[str, Any]]:
    """``from_quark_dict`` of config.json's ``quantization_config``; any problem is a ValueError naming the file."""
    try:
        document = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    try:
        return from_quark_dict(_mapping(document, "the document").get("quantization_config"))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def import_quark_dir(model: nn.Module, model_dir: str | Path, device: str | torch.device | None = None) -> nn.Module:
    """Rebuild a quantized model from amd-quark's export directory and a float ``model`` of the same architecture:
    prepared with the stored Config, weights set to their dequantized values with the quantizer
    ``decoded_weight_quantizer`` gives (pass-through: they are on the grid), static activation quantizers frozen with
    the stored qparams, in eval mode. Meta Parameters (a skeleton) are given storage on ``device`` first."""
    st = _require_safetensors()
    root = Path(model_dir)
    config, export = _read_quark_config(root / CONFIG_FILE)
    pack_method = export["pack_method"]
    check_header(root / WEIGHTS_FILE)  # a tensor whose bytes do not match its dtype and shape, by name
    try:
        with st.safe_open(str(root / WEIGHTS_FILE), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
    except Exception as err:  # a truncated or corrupt file: the reader's own errors vary
        raise ValueError(f"{root / WEIGHTS_FILE} is not a readable safetensors file: {err}") from err
    _check_before_import(model, config, t, root / WEIGHTS_FILE)  # every problem found before the model is touched
    materialize(model, device, set(t))  # a skeleton's meta Parameters get storage (every one is filled below)
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        ModelQuantizer(config).prepare(model)
    plain = {k: v for k, v in t.items() if not k.endswith(("_scale", "_zero_point", "weight_shift"))}
    shared = shared_tensors(model)
    with torch.no_grad():
        for name, m in _layers(model):
            prefix = f"{name}." if name else ""
            wq = getattr(m, "_weight_quantizer", None)
            key = prefix + "weight"
            if wq is not None and key in t:
                weight, as_linear = _as_linear(m, wq)
                values, scale, zp = _decode_weight(t, key, weight.shape, as_linear.spec, pack_method)
                weight.copy_(values.to(weight.dtype))  # a Conv1D's weight through its [out, in] view
                plain.pop(key, None)
                quantizer = decoded_weight_quantizer(m, _WEIGHT_SLOT, wq.spec, scale, zp, shared)
                if quantizer is not None:
                    m.set_quantizer(_WEIGHT_SLOT, quantizer)
            for role in ("input", "output"):
                aq = getattr(m, f"_{role}_quantizer", None)
                if aq is not None and f"{prefix}{role}_scale" in t:
                    s = t[f"{prefix}{role}_scale"].float()
                    z = t.get(f"{prefix}{role}_zero_point", torch.zeros_like(s)).to(torch.int32)
                    setattr(m, f"_{role}_quantizer", FrozenScaledFakeQuantize(aq.spec, s, z))
    model.load_state_dict(plain, strict=False)  # _check_before_import made sure every key has its place
    return ModelQuantizer.freeze(model).eval()


def _stored_weight(spec: QuantizationSpec, shape: torch.Size) -> tuple[tuple[torch.dtype, ...], tuple[int, ...]] | None:
    """The dtype(s) and shape a weight of ``shape`` quantized with ``spec`` is stored in (None: no layout)."""
    layout = _layout(spec, torch.empty(shape, device="meta"))
    dims = tuple(int(d) for d in shape)
    out, rest = dims[0], int(torch.Size(dims[1:]).numel())
    if layout == "mx":
        element = Dtype(spec.mx_element_dtype)
        if element == Dtype.fp4:
            return (torch.uint8,), (out, (rest + 1) // 2)
        if element in (Dtype.fp6_e3m2, Dtype.fp6_e2m3):
            return (torch.uint8,), (out, rest * 3 // 4)
        return ((TORCH_FLOAT8[element] if element in TORCH_FLOAT8 else torch.int8),), dims
    if layout == "cast":
        return (torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16,), dims
    if layout == "block":
        return (torch.int8,), dims
    if layout == "float8":
        return (TORCH_FLOAT8[spec.dtype],), dims
    fmt = format_of(spec.dtype)
    if layout == "minifloat":
        return (torch.uint8,), (out, (rest + 1) // 2 if fmt.bits == 4 else rest * 3 // 4)
    if layout is None or not isinstance(fmt, IntFormat):
        return None
    if layout == "int_group":
        return ((torch.int32,), (rest, (out + 7) // 8)) if fmt.bits == 4 else ((_container(fmt),), (rest, out))
    return ((torch.int32,), (out, (rest + 7) // 8)) if fmt.bits == 4 else ((_container(fmt),), dims)


def _check_before_import(model: nn.Module, config: Config, t: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor a quantized layer needs is there with amd-quark's dtype and shape, scales finite and positive
    (with the shape of their qscheme), zero points and codes inside the format's range, no companion a layout does
    not have (a zero point of fp8 weights), then the rest by the single-file import's rule (``check_model_tensors``:
    float tensors as the model's, nothing extra); raises a ValueError naming the tensor otherwise."""
    check = _Checker(str(path), t)
    owned: set[str] = set()
    for plan in ModelQuantizer(config).resolve(model):
        module = model.get_submodule(plan.name)
        prefix = f"{plan.name}." if plan.name else ""
        spec = plan.qconfig.weight  # as configured: for Linear's [out, in] view, which a Conv1D is stored as
        weight = linear_weight(module) if isinstance(getattr(module, "weight", None), torch.Tensor) else None
        if spec is not None and isinstance(weight, torch.Tensor):
            key = prefix + "weight"
            expected = _stored_weight(spec, weight.shape)
            if expected is None:
                raise _unsupported(f"{path}: '{key}'", spec)
            for need in (key, key + "_scale") if spec.dtype not in (Dtype.bfloat16, Dtype.float16) else (key,):
                if need not in t:
                    raise ValueError(f"{path}: tensor '{need}' is missing (the config quantizes '{plan.name}' as {spec.dtype.name})")
            dtypes, shape = expected
            if t[key].dtype not in dtypes or tuple(t[key].shape) != shape:
                raise ValueError(f"{path}: tensor '{key}': expected {[str(d) for d in dtypes]} of shape {list(shape)}, found {t[key].dtype} of shape {list(t[key].shape)}")
            if spec.dtype not in (*_BLOCK_DTYPES, Dtype.bfloat16, Dtype.float16):
                _check_scale(path, key + "_scale", t[key + "_scale"])
            check.expected.add(key)
            _check_weight_values(check, key, spec, weight.shape)  # reads (and expects) the companions it has
            owned.add(key)
        for role, spec_a in (("input", plan.qconfig.input_tensors), ("output", plan.qconfig.output_tensors)):
            if spec_a is None or spec_a.is_dynamic or spec_a.dtype in _BLOCK_DTYPES:
                continue
            key = f"{prefix}{role}_scale"
            if key not in t:
                raise ValueError(f"{path}: tensor '{key}' is missing (the config quantizes the {role} of '{plan.name}' statically)")
            _check_scale(path, key, t[key])
            _check_activation_qparams(check, f"{prefix}{role}", spec_a)
    check_model_tensors(check, model, owned)  # the float tensors and nothing extra: the single-file import's rule


def _check_scale(path: Path, key: str, scale: torch.Tensor) -> None:
    if not scale.is_floating_point():
        raise ValueError(f"{path}: tensor '{key}': expected a float scale, found {_described(scale)}")
    s = scale.float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"{path}: tensor '{key}': expected finite scales > 0, found min {float(s.min())}, max {float(s.max())}")


_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # amd-quark writes float32; the others widen exactly


def _scale_shape(spec: QuantizationSpec, shape: tuple[int, ...], transposed: bool) -> list[int] | None:
    """The stored scale / zero-point shape of a weight of ``shape`` (None: one element). Per-group qparams are
    stored transposed, [in/g, out], as the codes."""
    if spec.qscheme == QSchemeType.per_channel:
        return [shape[0]]
    if spec.qscheme == QSchemeType.per_block:
        return list(tile_layout(shape, spec.block_size).n_tiles)
    if spec.qscheme == QSchemeType.per_group:
        groups = -(-shape[1] // (spec.group_size or 32))
        return [groups, shape[0]] if transposed else [shape[0], groups]
    return None


def _check_weight_values(check: _Checker, key: str, spec: QuantizationSpec, shape: torch.Size) -> None:
    """The values of a weight whose codes have amd-quark's dtype and shape, and its companion tensors: float8 / cast
    values finite, integer codes in the format's range, MX E8M0 bytes below 255 (NaN), mx6 / mx9 codes, steps and
    shifts, each scale's shape and the zero points (present for integers, their dtype, shape and range)."""
    dims = tuple(int(d) for d in shape)
    layout = _layout(spec, torch.empty(dims, device="meta"))
    stored = check.tensors[key]
    if layout in ("cast", "float8"):
        check.finite(key, stored, f"{spec.dtype.name} values")
    if layout == "cast":
        return
    if layout == "mx":
        element = Dtype(spec.mx_element_dtype)
        e8m0 = check.get(key + "_scale", (torch.uint8,), [dims[0], -(-dims[1] // (spec.group_size or 32))], "E8M0 block scales")
        check.in_range(key + "_scale", e8m0, 0, 254, "E8M0 block scales (255 is NaN)")
        if element == Dtype.int8:
            check.in_range(key, stored, -MXINT8_QMAX, MXINT8_QMAX, "MX int8 elements")
        elif element in TORCH_FLOAT8:
            check.finite(key, stored, f"MX {element.name} elements")
        return
    if layout == "block":
        limit = 2 ** _MANTISSA_BITS[spec.dtype] - 1
        check.in_range(key, stored, -limit, limit, f"{spec.dtype.name} codes")
        step = check.get(key + "_scale", (torch.float32,), [dims[0], -(-dims[1] // (spec.group_size or 16))], "block steps")
        check.finite(key + "_scale", step, "block steps")
        if bool((step <= 0).any()) or bool((torch.frexp(step).mantissa != 0.5).any()):
            check.fail(key + "_scale", "block steps that are powers of two", f"min {step.min().item()}")
        shift = check.get(key + "_shift", (torch.uint8,), [dims[0], -(-dims[1] // 2)], "micro-exponent shifts")
        check.in_range(key + "_shift", shift, 0, 1, "micro-exponent shifts")
        return
    check.get(key + "_scale", _SCALE_DTYPES, _scale_shape(spec, dims, layout == "int_group"), "a scale")
    fmt = format_of(spec.dtype)
    if not isinstance(fmt, IntFormat):
        return
    packed = fmt.bits == 4
    if not packed:
        check.in_range(key, stored, fmt.qmin, fmt.qmax, f"{spec.dtype.name} codes")
    zp_key = key + "_zero_point"
    if packed and layout == "int_group":
        zp = check.get(zp_key, (torch.int32,), [-(-dims[1] // (spec.group_size or 32)), (dims[0] + 7) // 8], "packed zero points")
    elif packed and spec.qscheme == QSchemeType.per_channel:
        zp = check.get(zp_key, (torch.int32,), [(dims[0] + 7) // 8], "packed zero points")
    else:
        zp = check.get(zp_key, (_container(fmt),), _scale_shape(spec, dims, layout == "int_group"), "zero points")
    if not (packed and zp.dtype == torch.int32):  # packed nibbles are in range by construction
        check.in_range(zp_key, zp, fmt.qmin, fmt.qmax, f"{spec.dtype.name} zero points")


def _check_activation_qparams(check: _Checker, name: str, spec: QuantizationSpec) -> None:
    """``<name>_scale`` (float, one element, or one per channel) and, for integer formats, ``<name>_zero_point`` in
    the codes' dtype, the scale's shape and the format's range."""
    scale = check.tensors[name + "_scale"]
    shape = None if spec.qscheme != QSchemeType.per_channel else (list(scale.shape) if scale.ndim == 1 else [-1])
    check.get(name + "_scale", _SCALE_DTYPES, shape, "a scale")
    fmt = format_of(spec.dtype)
    if isinstance(fmt, IntFormat):
        zp = check.get(name + "_zero_point", (_container(fmt),), shape, "a zero point")
        check.in_range(name + "_zero_point", zp, fmt.qmin, fmt.qmax, f"{spec.dtype.name} zero points")
