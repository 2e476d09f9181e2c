"""The single file's tensor codec: each quantized tensor as its codes (packed where sub-byte) with its
scales and zero points, and back; which quantizer a stored tensor was written with; the slot and key names both
layouts share. Used by the single file, amd-quark's directory and ONNX."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.export.packing import (
    pack_nibbles,
    unpack_nibbles,
)
from quark.torch.extras import import_extra
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    FloatFormat,
    IntFormat,
    decode,
    dequantize_int,
    encode,
    format_of,
    from_blocks,
    quantize_int,
    quantize_mx,
    round_to_grid,
    to_blocks,
)
from quark.torch.quantization.formats.grouping import channel_view, from_tiles, tile_layout, tile_view
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import (
    DEFAULT_SLOTS,
    QuantSlot,
    bakeable,
    slot_name,
)
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FakeQuantizeBase, FrozenScaledFakeQuantize


def require_safetensors() -> Any:
    return import_extra("safetensors.torch", "export", "safetensors export and import")


# ----------------------------------------------------------------------------------------------- encoding
def has_qparams(q: FakeQuantizeBase | None) -> bool:
    """A static quantizer with a scale (integers, minifloats): its qparams are part of the export."""
    return q is not None and not q.is_dynamic and isinstance(format_of(q.spec.dtype), IntFormat | FloatFormat)


def stored_quantizer(tensor: torch.Tensor, q: FakeQuantizeBase | None) -> FakeQuantizeBase | None:
    """The quantizer whose codes the exports store for ``tensor``: ``q`` while its fake quant is on. With fake quant
    switched off the model computes with ``tensor`` as it is: a pass-through ``BakedFakeQuantize`` with ``q``'s spec
    and qparams when ``tensor`` lies on their grid (a weight an algorithm or the user quantized already), else None:
    the tensor is stored in float."""
    if q is None or bool(q.fake_quant_enabled):
        return q
    if not has_qparams(q):
        return None
    scale, zp = q.calculate_qparams()
    baked = BakedFakeQuantize(q.spec, scale.detach().clone(), zp.detach().clone())
    return baked if baked.holds(tensor) else None


def decoded_weight_quantizer(
    module: nn.Module,
    slot: QuantSlot,
    spec: QuantizationSpec,
    scale: torch.Tensor | None,
    zero_point: torch.Tensor | None,
    shared: set[int],
) -> FakeQuantizeBase | None:
    """The quantizer the imports put in ``slot`` once its tensor holds the decoded values (``scale`` / ``zero_point``:
    the stored qparams, None for formats without them). The values are on the grid already: a pass-through
    ``BakedFakeQuantize`` keeps them (re-quantizing with the spec's rounding is not exact: floor can drop a value one
    step). A tensor that is not ``bakeable`` (another module holds it and loads float values into it, or it is
    computed at each forward) keeps a quantizer that quantizes it, as the exported model's did: frozen with the stored
    qparams, or None (keep the prepared one) for a format without qparams."""
    if bakeable(module, slot, shared):
        return BakedFakeQuantize(spec, scale, zero_point)
    return None if scale is None else FrozenScaledFakeQuantize(spec, scale, zero_point)


def scale_view(
    scale: torch.Tensor, x: torch.Tensor, qscheme: QSchemeType, ch_axis: int | None, block_size: list[int] | None = None
) -> torch.Tensor:
    """A per-tensor or per-channel scale shaped to broadcast over ``x``; a per-block one expanded to x's shape."""
    if qscheme == QSchemeType.per_channel:
        return channel_view(scale.float(), x.ndim, ch_axis)  # type: ignore[arg-type]
    if qscheme == QSchemeType.per_block:
        tiles = tile_layout(x.shape, block_size)
        (nr, nc), (br, bc) = tiles.n_tiles, tiles.block
        return from_tiles(tile_view(scale.float(), tiles).expand(nr, br, nc, bc), tiles)
    return scale.float().reshape(())


E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)


def _stored_scale(scale: torch.Tensor, spec: QuantizationSpec) -> torch.Tensor:
    """A weight's scale as stored: float32, or float8_e8m0fnu (1 byte, exact) for ``scale_type=float8_e8m0fnu``."""
    scale = scale.detach().float()
    if spec.scale_type == ScaleType.float8_e8m0fnu and E8M0_DTYPE is not None:
        e8m0 = scale.to(E8M0_DTYPE)
        if torch.equal(e8m0.float(), scale):  # powers of two in range, as the observer makes them
            return e8m0
    return scale


def int_codes(
    w: torch.Tensor, q: FakeQuantizeBase, scale: torch.Tensor, zp: torch.Tensor, fmt: IntFormat
) -> torch.Tensor:
    """The integer codes of weight ``w`` under quantizer ``q`` with the given qparams, in w's layout (int32)."""
    spec = q.spec
    return quantize_int(
        w.detach(),
        scale,
        zp,
        fmt.qmin,
        fmt.qmax,
        round_method=q.round_method,
        qscheme=spec.qscheme,
        axis=spec.ch_axis,
        group_size=spec.group_size,
        block_size=spec.block_size,
    )


def encode_weight(w: torch.Tensor, q: FakeQuantizeBase | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stored tensors of one weight (codes, scales) and how to read them back."""
    shape = list(w.shape)
    if q is None:
        return {"": w.detach().float()}, {"encoding": "float", "shape": shape}
    spec = q.spec
    fmt = format_of(spec.dtype)
    if has_qparams(q):
        scale, zp = q.calculate_qparams()
        info: dict[str, Any] = {
            "dtype": spec.dtype.name,
            "shape": shape,
            "qscheme": spec.qscheme.name,
            "ch_axis": spec.ch_axis,
            "group_size": spec.group_size,
        }
        if spec.block_size is not None:
            info["block_size"] = list(spec.block_size)
        stored_scale = _stored_scale(scale, spec)
        if isinstance(fmt, IntFormat):
            codes = int_codes(w, q, scale, zp, fmt)
            stored = _store_int(codes, fmt)
            info["encoding"] = "int_nibbles" if fmt.bits <= 4 else "int"
            return {"": stored, "_scale": stored_scale, "_zero_point": zp.detach()}, info
        if spec.qscheme == QSchemeType.per_group:
            raise ValueError(
                f"export of per-group {spec.dtype.name} weights is not supported (per tensor / channel / block are)"
            )
        values = round_to_grid(
            q(w.detach()).float() / scale_view(scale, w, spec.qscheme, spec.ch_axis, spec.block_size), fmt
        )
        if spec.dtype in TORCH_FLOAT8:
            info["encoding"] = "float8"
            return {"": values.to(TORCH_FLOAT8[spec.dtype]), "_scale": stored_scale}, info
        codes = encode(values, fmt)
        info["encoding"] = "minifloat_nibbles" if fmt.bits <= 4 else "minifloat"
        return {"": pack_nibbles(codes) if fmt.bits <= 4 else codes, "_scale": stored_scale}, info
    if spec.dtype == Dtype.mx:
        element = Dtype(spec.mx_element_dtype)
        block, axis = spec.group_size or 32, -1 if spec.ch_axis is None else spec.ch_axis
        elements, e8m0 = quantize_mx(w.detach(), element, block, axis, spec.mx_scale_mode)
        info = {
            "dtype": "mx",
            "element": element.name,
            "shape": shape,
            "block": block,
            "axis": axis,
            "blocked_shape": list(elements.shape),
        }
        if element == Dtype.int8:
            info["encoding"] = "mx_int8"
            return {"": torch.round(elements * 64).to(torch.int8), "_scale": e8m0}, info
        efmt = FLOAT_FORMATS[element]
        codes = encode(elements, efmt)
        info["encoding"] = "mx_nibbles" if efmt.bits <= 4 else "mx_codes"
        return {"": pack_nibbles(codes) if efmt.bits <= 4 else codes, "_scale": e8m0}, info
    # casts (bf16 / fp16) are stored in that dtype; mx6 / mx9 / bfp16 as their dequantized values
    value = q(w.detach())
    if spec.dtype in (Dtype.bfloat16, Dtype.float16):
        return {"": value.to(torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16)}, {
            "encoding": "cast",
            "shape": shape,
        }
    return {"": value.float()}, {"encoding": "float", "shape": shape, "dtype": spec.dtype.name}


def int_storage(fmt: IntFormat) -> torch.dtype:
    """The dtype integer codes are stored in (packed nibbles for 4 bits and fewer)."""
    if fmt.bits <= 4:
        return torch.uint8
    if fmt.bits <= 8:
        return torch.int8 if fmt.signed else torch.uint8
    return torch.int16 if fmt.bits <= 16 and fmt.signed else torch.int32


def _store_int(codes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    return pack_nibbles(codes) if fmt.bits <= 4 else codes.to(int_storage(fmt))


def decode_weight(tensors: dict[str, torch.Tensor], key: str, info: dict[str, Any]) -> torch.Tensor:
    """The dequantized weight from its stored form: equal to the exported model's fake-quantized weight."""
    shape = info["shape"]
    stored = tensors[key]
    encoding = info["encoding"]
    if encoding in ("float", "cast"):
        return stored.float().reshape(shape)
    if encoding.startswith("int"):
        fmt = format_of(info["dtype"])
        if not isinstance(fmt, IntFormat):
            raise ValueError(f"{key}: encoding {encoding!r} with the non-integer dtype {info['dtype']!r}")
        count = int(torch.Size(shape).numel())
        codes = (
            unpack_nibbles(stored, count, fmt.signed).reshape(shape)
            if encoding == "int_nibbles"
            else stored.to(torch.int32)
        )
        return dequantize_int(
            codes,
            tensors[key + "_scale"],
            tensors[key + "_zero_point"],
            qscheme=QSchemeType(info["qscheme"]),
            axis=info["ch_axis"],
            group_size=info["group_size"],
            block_size=info.get("block_size"),
        )
    if encoding in ("float8", "minifloat", "minifloat_nibbles"):
        fmt = FLOAT_FORMATS[Dtype(info["dtype"])]
        if encoding == "float8":
            values = stored.float()
        else:
            count = int(torch.Size(shape).numel())
            codes = (
                unpack_nibbles(stored, count, signed=False).reshape(shape)
                if encoding == "minifloat_nibbles"
                else stored
            )
            values = decode(codes, fmt)
        values = values.reshape(shape)
        return values * scale_view(
            tensors[key + "_scale"], values, QSchemeType(info["qscheme"]), info["ch_axis"], info.get("block_size")
        )
    if encoding.startswith("mx"):
        blocked = info["blocked_shape"]
        if encoding == "mx_int8":
            elements = stored.float() / 64
        else:
            efmt = FLOAT_FORMATS[Dtype(info["element"])]
            count = int(torch.Size(blocked).numel())
            codes = unpack_nibbles(stored, count, signed=False) if encoding == "mx_nibbles" else stored
            elements = decode(codes.reshape(blocked), efmt)
        exp = tensors[key + "_scale"].to(torch.int32) - 127
        values = torch.ldexp(elements.reshape(blocked), exp.unsqueeze(-1))
        _, layout = to_blocks(torch.zeros(shape), info["axis"], info["block"])
        return from_blocks(values, layout, torch.Size(shape))
    raise ValueError(f"{key}: unknown encoding {encoding!r}")


# ----------------------------------------------------------------------------------------------- slots and keys
def quant_slots(m: QuantMixin) -> tuple[QuantSlot, ...]:
    """Every quantizer slot of a twin, those without a quantizer included."""
    return tuple(m.quant_slots)


#: the stored name of an activation slot's qparams (before ``_scale`` / ``_zero_point``)
activation_key = slot_name


def quantizer_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of every quantizer submodule (their state is not part of the export)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            prefix = f"{name}." if name else ""
            out += [f"{prefix}{attr}." for attr in {s.attr for s in (*DEFAULT_SLOTS, *quant_slots(m))}]
    return tuple(out)


def is_quantizer_state(key: str, prefixes: tuple[str, ...]) -> bool:
    return key.startswith(prefixes) or "_quantizer." in key


def first_of_its_storage(value: torch.Tensor, seen: set[tuple[int, int, tuple[int, ...]]]) -> bool:
    """Whether ``value`` is the first of the tensors that share its memory (a tied ``lm_head`` and input embedding)
    among those ``seen`` so far (which it joins): the exports store such a tensor once, as ``save_pretrained`` does."""
    alias = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
    if alias in seen:
        return False
    seen.add(alias)
    return True


def tied_to_stored(state: dict[str, torch.Tensor], stored: dict[str, Any]) -> set[str]:
    """Keys of ``state`` (``state_dict(keep_vars=True)``) that a file lacks but that are the same Parameter as a key it
    has: tied, so loading that one loads them too."""
    present = {id(state[k]) for k in state if k in stored}
    return {k for k, v in state.items() if k not in stored and id(v) in present}
