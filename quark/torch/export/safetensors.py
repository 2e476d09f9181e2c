"""Real-quantized safetensors: integer codes (int4/uint4 packed two per byte), fp8 as torch float8, fp4/fp6 and MX
elements as packed codes with their E8M0 scales, plus scales, zero points and the quark Config in the metadata.
Per-block (2-D tile) weights store their scales as [ceil(R / rows), ceil(C / cols)]; weight scales of
``scale_type=float8_e8m0fnu`` are stored as torch.float8_e8m0fnu (one byte each, exact).

``import_model_from_safetensors`` rebuilds the quantized model from a float instance of the same architecture; its
outputs equal the exported (fake-quantized) model's bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.export.packing import pack_nibbles, unpack_nibbles
from quark.torch.export.skeleton import materialize
from quark.torch.extras import import_extra
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType, ZeroPointType
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
from quark.torch.quantization.formats.table import MXINT8_QMAX
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import (
    DEFAULT_SLOTS,
    QUANT_MODULE_MAP,
    QuantSlot,
    bakeable,
    shared_tensors,
    slot_name,
)
from quark.torch.quantization.resolve import config_from_stored
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FakeQuantizeBase, FrozenScaledFakeQuantize

FILENAME = "model.safetensors"


def _require_safetensors() -> Any:
    return import_extra("safetensors.torch", "export", "safetensors export and import")


# ----------------------------------------------------------------------------------------------- encoding
def _has_qparams(q: FakeQuantizeBase | None) -> bool:
    """A static quantizer with a scale (integers, minifloats): its qparams are part of the export."""
    return q is not None and not q.is_dynamic and isinstance(format_of(q.spec.dtype), IntFormat | FloatFormat)


def stored_quantizer(tensor: torch.Tensor, q: FakeQuantizeBase | None) -> FakeQuantizeBase | None:
    """The quantizer whose codes the exports store for ``tensor``: ``q`` while its fake quant is on. With fake quant
    switched off the model computes with ``tensor`` as it is: a pass-through ``BakedFakeQuantize`` with ``q``'s spec
    and qparams when ``tensor`` lies on their grid (a weight an algorithm or the user quantized already), else None:
    the tensor is stored in float."""
    if q is None or bool(q.fake_quant_enabled):
        return q
    if not _has_qparams(q):
        return None
    scale, zp = q.calculate_qparams()
    baked = BakedFakeQuantize(q.spec, scale.detach().clone(), zp.detach().clone())
    return baked if baked.holds(tensor) else None


def decoded_weight_quantizer(
    module: nn.Module, slot: QuantSlot, spec: QuantizationSpec, scale: torch.Tensor | None, zero_point: torch.Tensor | None,
    shared: set[int],
) -> FakeQuantizeBase | None:  # fmt: skip
    """The quantizer the imports put in ``slot`` once its tensor holds the decoded values (``scale`` / ``zero_point``:
    the stored qparams, None for formats without them). The values are on the grid already: a pass-through
    ``BakedFakeQuantize`` keeps them (re-quantizing with the spec's rounding is not exact: floor can drop a value one
    step). A tensor that is not ``bakeable`` (another module holds it and loads float values into it, or it is
    computed at each forward) keeps a quantizer that quantizes it, as the exported model's did: frozen with the stored
    qparams, or None (keep the prepared one) for a format without qparams."""
    if bakeable(module, slot, shared):
        return BakedFakeQuantize(spec, scale, zero_point)
    return None if scale is None else FrozenScaledFakeQuantize(spec, scale, zero_point)


def _scale_view(
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


_E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _stored_scale(scale: torch.Tensor, spec: QuantizationSpec) -> torch.Tensor:
    """A weight's scale as stored: float32, or float8_e8m0fnu (1 byte, exact) for ``scale_type=float8_e8m0fnu``."""
    scale = scale.detach().float()
    if spec.scale_type == ScaleType.float8_e8m0fnu and _E8M0 is not None:
        e8m0 = scale.to(_E8M0)
        if torch.equal(e8m0.float(), scale):  # powers of two in range, as the observer makes them
            return e8m0
    return scale


def encode_weight(w: torch.Tensor, q: FakeQuantizeBase | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stored tensors of one weight (codes, scales) and how to read them back."""
    shape = list(w.shape)
    if q is None:
        return {"": w.detach().float()}, {"encoding": "float", "shape": shape}
    spec = q.spec
    fmt = format_of(spec.dtype)
    if _has_qparams(q):
        scale, zp = q.calculate_qparams()
        info: dict[str, Any] = {"dtype": spec.dtype.name, "shape": shape, "qscheme": spec.qscheme.name,
                                "ch_axis": spec.ch_axis, "group_size": spec.group_size}  # fmt: skip
        if spec.block_size is not None:
            info["block_size"] = list(spec.block_size)
        stored_scale = _stored_scale(scale, spec)
        if isinstance(fmt, IntFormat):
            codes = quantize_int(w.detach(), scale, zp, fmt.qmin, fmt.qmax, round_method=q.round_method,
                                 qscheme=spec.qscheme, axis=spec.ch_axis, group_size=spec.group_size,
                                 block_size=spec.block_size)  # fmt: skip
            stored = _store_int(codes, fmt)
            info["encoding"] = "int_nibbles" if fmt.bits <= 4 else "int"
            return {"": stored, "_scale": stored_scale, "_zero_point": zp.detach()}, info
        if spec.qscheme == QSchemeType.per_group:
            raise ValueError(f"export of per-group {spec.dtype.name} weights is not supported (per tensor / channel / block are)")
        values = round_to_grid(q(w.detach()).float() / _scale_view(scale, w, spec.qscheme, spec.ch_axis, spec.block_size), fmt)
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
        info = {"dtype": "mx", "element": element.name, "shape": shape, "block": block, "axis": axis,
                "blocked_shape": list(elements.shape)}  # fmt: skip
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
        return {"": value.to(torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16)}, {"encoding": "cast", "shape": shape}
    return {"": value.float()}, {"encoding": "float", "shape": shape, "dtype": spec.dtype.name}


def _int_storage(fmt: IntFormat) -> torch.dtype:
    """The dtype integer codes are stored in (packed nibbles for 4 bits and fewer)."""
    if fmt.bits <= 4:
        return torch.uint8
    if fmt.bits <= 8:
        return torch.int8 if fmt.signed else torch.uint8
    return torch.int16 if fmt.bits <= 16 and fmt.signed else torch.int32


def _store_int(codes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    return pack_nibbles(codes) if fmt.bits <= 4 else codes.to(_int_storage(fmt))


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
        codes = unpack_nibbles(stored, count, fmt.signed).reshape(shape) if encoding == "int_nibbles" else stored.to(torch.int32)
        return dequantize_int(codes, tensors[key + "_scale"], tensors[key + "_zero_point"], qscheme=QSchemeType(info["qscheme"]),
                              axis=info["ch_axis"], group_size=info["group_size"], block_size=info.get("block_size"))  # fmt: skip
    if encoding in ("float8", "minifloat", "minifloat_nibbles"):
        fmt = FLOAT_FORMATS[Dtype(info["dtype"])]
        if encoding == "float8":
            values = stored.float()
        else:
            count = int(torch.Size(shape).numel())
            codes = unpack_nibbles(stored, count, signed=False).reshape(shape) if encoding == "minifloat_nibbles" else stored
            values = decode(codes, fmt)
        values = values.reshape(shape)
        return values * _scale_view(tensors[key + "_scale"], values, QSchemeType(info["qscheme"]), info["ch_axis"], info.get("block_size"))
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
def _slots(m: QuantMixin) -> tuple[QuantSlot, ...]:
    """Every quantizer slot of a twin, those without a quantizer included."""
    return tuple(getattr(m, "_quant_slots", ()))


#: the stored name of an activation slot's qparams (before ``_scale`` / ``_zero_point``)
activation_key = slot_name


def _quantizer_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of every quantizer submodule (their state is not part of the export)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            prefix = f"{name}." if name else ""
            out += [f"{prefix}{attr}." for attr in {s.attr for s in (*DEFAULT_SLOTS, *_slots(m))}]
    return tuple(out)


def _is_quantizer_state(key: str, prefixes: tuple[str, ...]) -> bool:
    return key.startswith(prefixes) or "_quantizer." in key


# ----------------------------------------------------------------------------------------------- export
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


def export_safetensors(
    model: nn.Module, output_dir: str | Path, custom_mode: str | None = "quark", weight_format: str = "real_quantized",
    pack_method: str = "reorder", *, filename: str = FILENAME,
) -> Path:  # fmt: skip
    """Write the quantized ``model`` (prepared and calibrated, or frozen) as real-quantized safetensors; amd-quark
    0.13's signature. Returns the path of the safetensors file.

    ``custom_mode="quark"`` (the default, as in amd-quark) writes amd-quark's directory: ``config.json`` with the
    ``quantization_config`` + ``model.safetensors`` in its key names, dtypes and ``pack_method`` packing, which
    amd-quark and vLLM load; formats amd-quark lacks follow the same rules (see ``quark.torch.export.quark_format``),
    and a format no rule covers is refused before anything is written. ``custom_mode=None`` writes this project's
    single file ``filename`` (below), which stores every format and slot of the engine.

    Every weight-like tensor of a quantized layer (each slot: ``weight``, ``bias``, an LSTM's ``weight_ih_l0``, an
    attention's ``in_proj_weight``) is stored under its own name as codes with ``_scale`` / ``_zero_point``, or as
    float when it has no quantizer; static activation quantizers' scales and zero points are stored under the slot's
    name (``input_scale``, ``output_zero_point``, ``key_input_scale``); everything else as in the state_dict. The
    write is atomic (a temporary file renamed).

    What is stored is what the model computes: a quantizer with fake quant switched off (``disable_fake_quant()``)
    leaves its tensor as it is, so such a weight is stored as its codes when it lies on the quantizer's grid, else in
    float (the single file) or refused with a ValueError naming the layer (amd-quark's directory, whose config.json
    cannot say so); a switched-off activation quantizer is stored as unquantized (single file) or refused (directory).
    """
    if custom_mode is not None:
        if custom_mode != "quark":
            raise ValueError(f"export_safetensors: custom_mode={custom_mode!r}; allowed: 'quark' or None (this project's format)")
        from quark.torch.export.quark_format import WEIGHTS_FILE, export_quark_dir

        return export_quark_dir(model, output_dir, weight_format, pack_method) / WEIGHTS_FILE
    st = _require_safetensors()
    config: Config | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("export_safetensors needs a model prepared by ModelQuantizer (it has no quant_config)")
    from quark.torch.export.quark_format import unreached_layers

    floated = unreached_layers(model)  # written in float, and excluded in the stored config so an import runs them so
    if floated:
        warnings.warn(
            f"layer(s) that no calibration forward reached are exported in float and excluded in the stored config: "
            f"{floated}",
            stacklevel=2,
        )
        config = dataclasses.replace(config, exclude=list(config.exclude) + [n for n in floated if n not in config.exclude])
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    skip: set[str] = set()

    def put(key: str, value: torch.Tensor) -> None:
        if key in tensors:
            raise ValueError(f"export_safetensors: two tensors of the model would be stored as '{key}'")
        tensors[key] = value.detach().contiguous()

    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin) or name in floated:  # a floated layer's tensors go out with the state_dict
            continue
        prefix = f"{name}." if name else ""
        for slot in _slots(m):
            q = getattr(m, slot.attr, None)
            if slot.tensor is not None:
                tensor = getattr(m, slot.tensor, None)
                if not isinstance(tensor, torch.Tensor):
                    continue
                skip.add(prefix + slot.tensor)
                stored, meta = encode_weight(tensor, stored_quantizer(tensor, q))
                for suffix, value in stored.items():
                    put(prefix + slot.tensor + suffix, value)
                info[prefix + slot.tensor] = meta
            elif q is not None and not bool(q.fake_quant_enabled):
                info[prefix + activation_key(slot)] = {"encoding": "float"}  # the model runs it unquantized
            elif _has_qparams(q):
                scale, zp = q.calculate_qparams()  # type: ignore[union-attr]
                key = prefix + activation_key(slot)
                put(key + "_scale", scale.float().clone())
                put(key + "_zero_point", zp.clone())
                info[key] = {"encoding": "qparams"}
    prefixes = _quantizer_prefixes(model)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if key in skip or _is_quantizer_state(key, prefixes) or key in tensors:
            continue
        if first_of_its_storage(value, seen):  # a tied tensor (an lm_head sharing the input embedding) is stored once
            put(key, value)
    metadata = {
        "format": "pt", "quant_method": "quark",
        "quantization_config": json.dumps(config.to_dict()), "quark_tensors": json.dumps(info),
    }  # fmt: skip
    tensors = {k: v.cpu() for k, v in tensors.items()}
    return write_atomically(output_dir, filename, lambda tmp: st.save_file(tensors, tmp, metadata=metadata))


# ----------------------------------------------------------------------------------------------- validation
def _expected_encoding(spec: QuantizationSpec | None) -> str:
    """The encoding ``encode_weight`` writes for a weight quantized with ``spec`` ("float" for none)."""
    if spec is None:
        return "float"
    fmt = format_of(spec.dtype)
    if not spec.is_dynamic and isinstance(fmt, IntFormat):
        return "int_nibbles" if fmt.bits <= 4 else "int"
    if not spec.is_dynamic and isinstance(fmt, FloatFormat):
        if spec.dtype in TORCH_FLOAT8:
            return "float8"
        return "minifloat_nibbles" if fmt.bits <= 4 else "minifloat"
    if spec.dtype == Dtype.mx:
        element = Dtype(spec.mx_element_dtype)
        if element == Dtype.int8:
            return "mx_int8"
        return "mx_nibbles" if FLOAT_FORMATS[element].bits <= 4 else "mx_codes"
    return "cast" if spec.dtype in (Dtype.bfloat16, Dtype.float16) else "float"


def _blocked_shape(shape: list[int], axis: int, block: int) -> list[int]:
    """The shape ``to_blocks`` gives a tensor of ``shape``: ``axis`` moved last and split into padded blocks."""
    shape = shape or [1]
    axis = axis % len(shape)
    rest = [n for i, n in enumerate(shape) if i != axis]
    return [*rest, -(-shape[axis] // block), block]


def _qparam_shape(shape: list[int], spec: QuantizationSpec) -> list[int] | None:
    """The scale / zero-point shape of a weight of ``shape`` (None: one element, any layout)."""
    if spec.qscheme == QSchemeType.per_channel:
        return [shape[spec.ch_axis]]  # type: ignore[index]
    if spec.qscheme == QSchemeType.per_group:
        return _blocked_shape(shape, spec.ch_axis, spec.group_size)[:-1]  # type: ignore[arg-type]
    if spec.qscheme == QSchemeType.per_block:
        return list(tile_layout(shape, spec.block_size).n_tiles)
    return None


def _described(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} of shape {list(tensor.shape)}"


#: the dtypes a float tensor of the model may be stored in, besides its own
_STORED_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _Checker:
    """Checks a file's tensors against its Config and the target model; collects the keys it expects."""

    def __init__(self, where: str, tensors: dict[str, torch.Tensor]) -> None:
        self.where, self.tensors, self.expected = where, tensors, set()

    def fail(self, key: str, expected: str, found: str) -> NoReturn:
        raise ValueError(f"{self.where}: tensor '{key}': expected {expected}, found {found}")

    def get(self, key: str, dtypes: tuple[torch.dtype, ...], shape: list[int] | None, what: str) -> torch.Tensor:
        """The tensor ``key`` after checking presence, dtype and shape (``shape`` None: exactly one element)."""
        self.expected.add(key)
        if key not in self.tensors:
            self.fail(key, f"{what} ({' or '.join(str(d).removeprefix('torch.') for d in dtypes)})", "no such tensor in the file")
        t = self.tensors[key]
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        if t.dtype not in dtypes:
            self.fail(key, f"{what} of dtype {names}", _described(t))
        if shape is None and t.numel() != 1:
            self.fail(key, f"{what} with one element", _described(t))
        if shape is not None and list(t.shape) != list(shape):
            self.fail(key, f"{what} of shape {list(shape)}", _described(t))
        return t

    def finite(self, key: str, t: torch.Tensor, what: str, allow_inf: bool = False) -> None:
        v = t.float()
        bad = torch.isnan(v) if allow_inf else ~torch.isfinite(v)
        if bool(bad.any()):
            self.fail(key, f"{what} with {'no NaN' if allow_inf else 'finite values'}", f"{int(bad.sum())} value(s) that are {'NaN' if allow_inf else 'NaN or infinite'}")

    def model_tensor(self, key: str, value: torch.Tensor, is_param: bool) -> None:
        """A tensor of the model stored as it is (either layout; a quantized layer's unquantized bias too): the
        model's shape; a float one in float32 / float16 / bfloat16 or the model's own dtype (what the exports
        write), finite (NaN never; buffers may hold inf, as attention masks do); any other in the model's dtype."""
        if not value.is_floating_point():
            self.get(key, (value.dtype,), list(value.shape), "a tensor of the model")
            return
        dtypes = tuple(dict.fromkeys((*_STORED_FLOATS, value.dtype)))
        self.finite(key, self.get(key, dtypes, list(value.shape), "a float tensor"), "a float tensor", allow_inf=not is_param)

    def codes_in_format(self, key: str, codes: torch.Tensor, fmt: FloatFormat) -> None:
        """Bit patterns that are values of ``fmt`` (fp8's NaN / inf patterns decode past ``max_normal``)."""
        values = decode(codes, fmt).abs()
        if bool((values > fmt.max_normal).any()):
            self.fail(key, f"{fmt.bits}-bit codes of values within +-{fmt.max_normal}", f"{int((values > fmt.max_normal).sum())} "
                      f"code(s) past it, e.g. {int(codes.reshape(-1)[(values > fmt.max_normal).reshape(-1)][0])}")  # fmt: skip

    def in_range(self, key: str, values: torch.Tensor, low: float, high: float, what: str) -> None:
        if values.numel() and (bool((values < low).any()) or bool((values > high).any())):
            self.fail(key, f"{what} in [{low}, {high}]", f"values in [{values.min().item()}, {values.max().item()}]")

    def scale(self, key: str, shape: list[int] | None, spec: QuantizationSpec | None = None) -> None:
        e8m0 = spec is not None and spec.scale_type == ScaleType.float8_e8m0fnu and _E8M0 is not None
        t = self.get(key, (torch.float32, _E8M0) if e8m0 else (torch.float32,), shape, "a scale").float()  # type: ignore[arg-type]
        self.finite(key, t, "a scale")
        if bool((t <= 0).any()):
            self.fail(key, "a scale > 0", f"min {t.min().item()}")

    def zero_point(self, key: str, shape: list[int] | None, fmt: IntFormat | FloatFormat, spec: QuantizationSpec) -> None:
        """Integers, or float32 where the Config says ``zero_point_type=float32`` (the two round differently)."""
        if isinstance(fmt, IntFormat) and spec.zero_point_type == ZeroPointType.float32:
            dtypes: tuple[torch.dtype, ...] = (torch.float32,)
        else:
            dtypes = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
        t = self.get(key, dtypes, shape, "a zero point")
        self.finite(key, t, "a zero point")
        if isinstance(fmt, IntFormat):
            self.in_range(key, t, fmt.qmin, fmt.qmax, "a zero point")
        else:
            self.in_range(key, t, 0, 0, "a zero point (minifloats have none)")

    def qparams(self, key: str, spec: QuantizationSpec, shape: list[int] | None) -> None:
        """An activation slot's ``_scale`` / ``_zero_point`` (per channel: one dimension, as many zero points)."""
        fmt = format_of(spec.dtype)
        if spec.qscheme == QSchemeType.per_channel:
            scale = self.tensors.get(key + "_scale")
            shape = list(scale.shape) if scale is not None and scale.ndim == 1 else [-1]
        self.scale(key + "_scale", shape)
        self.zero_point(key + "_zero_point", shape, fmt, spec)  # type: ignore[arg-type]

    def weight(self, key: str, param: torch.Tensor, spec: QuantizationSpec | None, meta: Any, is_param: bool) -> None:
        """One weight-like tensor of a quantized layer, stored as ``encode_weight`` writes it."""
        shape = list(param.shape)
        if not isinstance(meta, dict) or "encoding" not in meta or meta.get("shape") != shape:
            self.fail(key, f"a metadata entry with the encoding and shape {shape}", repr(meta))
        encoding, expected = meta["encoding"], _expected_encoding(spec)
        plain = encoding == "float" and "dtype" not in meta  # stored unquantized (no quantizer, or switched off)
        if not plain and encoding != expected:
            self.fail(key, f"encoding {expected!r} (the Config's {spec.dtype.name if spec else 'no quantizer'}) or 'float'", repr(encoding))
        if plain:
            self.model_tensor(key, param, is_param)
            return
        if encoding == "float":
            if meta["dtype"] != spec.dtype.name:  # type: ignore[union-attr]
                self.fail(key, f"values of {spec.dtype.name}", f"metadata dtype {meta['dtype']!r}")  # type: ignore[union-attr]
            self.finite(key, self.get(key, (torch.float32,), shape, "a float tensor"), "a float tensor", allow_inf=not is_param)
            return
        if spec is None:  # unreachable: with no spec only "float" passes the encoding check above
            self.fail(key, "a float tensor (the Config quantizes no such tensor)", repr(encoding))
        if encoding == "cast":
            t = self.get(key, (torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16,), shape, f"a {spec.dtype.name} tensor")
            self.finite(key, t, f"a {spec.dtype.name} tensor")
            return
        count = int(torch.Size(shape).numel())
        if encoding.startswith("mx"):
            block, axis = spec.group_size or 32, -1 if spec.ch_axis is None else spec.ch_axis
            blocked = _blocked_shape(shape, axis, block)
            wanted = {"dtype": "mx", "element": Dtype(spec.mx_element_dtype).name, "block": block, "axis": axis, "blocked_shape": blocked}
            self._same(key, meta, wanted)
            n = int(torch.Size(blocked).numel())
            if encoding == "mx_int8":
                elements = self.get(key, (torch.int8,), blocked, "MX int8 elements")
                self.in_range(key, elements, -MXINT8_QMAX, MXINT8_QMAX, "MX int8 elements")
            elif encoding == "mx_nibbles":
                self.get(key, (torch.uint8,), [(n + 1) // 2], f"{n} MX element codes packed two per byte")
            else:
                codes = self.get(key, (torch.uint8,), blocked, "MX element codes")
                efmt = FLOAT_FORMATS[Dtype(spec.mx_element_dtype)]
                self.in_range(key, codes, 0, 2**efmt.bits - 1, f"{efmt.bits}-bit codes")
                self.codes_in_format(key, codes, efmt)
            e8m0 = self.get(key + "_scale", (torch.uint8,), blocked[:-1], "E8M0 block scales")
            self.in_range(key + "_scale", e8m0, 0, 254, "E8M0 block scales (255 is NaN)")
            return
        wanted = {"dtype": spec.dtype.name, "qscheme": spec.qscheme.name if spec.qscheme else None,
                  "ch_axis": spec.ch_axis, "group_size": spec.group_size, "block_size": spec.block_size}  # fmt: skip
        self._same(key, meta, wanted)
        if spec.qscheme == QSchemeType.per_group and not isinstance(format_of(spec.dtype), IntFormat):
            self.fail(key, "per tensor or per channel minifloat weights", "per_group")
        qshape = _qparam_shape(shape, spec)
        fmt = format_of(spec.dtype)
        if isinstance(fmt, IntFormat):
            if encoding == "int_nibbles":
                packed = self.get(key, (torch.uint8,), [(count + 1) // 2], f"{count} {fmt.bits}-bit codes packed two per byte")
                codes = unpack_nibbles(packed, count, fmt.signed)
            else:
                codes = self.get(key, (_int_storage(fmt),), shape, f"{spec.dtype.name} codes")
            self.in_range(key, codes, fmt.qmin, fmt.qmax, f"{spec.dtype.name} codes")
            self.scale(key + "_scale", qshape, spec)
            self.zero_point(key + "_zero_point", qshape, fmt, spec)
            return
        if not isinstance(fmt, FloatFormat):
            self.fail(key, "an integer or minifloat encoding", f"{encoding!r} for {spec.dtype.name}")
        if encoding == "float8":
            self.finite(key, self.get(key, (TORCH_FLOAT8[spec.dtype],), shape, f"{spec.dtype.name} values"), f"{spec.dtype.name} values")
        elif encoding == "minifloat_nibbles":
            self.get(key, (torch.uint8,), [(count + 1) // 2], f"{count} {spec.dtype.name} codes packed two per byte")
        else:
            self.in_range(key, self.get(key, (torch.uint8,), shape, f"{spec.dtype.name} codes"), 0, 2**fmt.bits - 1, f"{fmt.bits}-bit codes")
        self.scale(key + "_scale", qshape, spec)

    def _same(self, key: str, meta: dict[str, Any], wanted: dict[str, Any]) -> None:
        for field, value in wanted.items():
            if meta.get(field) != value:
                self.fail(key, f"metadata {field}={value!r} (from the Config and the model)", f"{field}={meta.get(field)!r}")


def _quant_layers(model: nn.Module, config: Config) -> list[tuple[str, nn.Module, list[tuple[QuantSlot, QuantizationSpec | None]]]]:
    """(state-dict prefix, module, [(slot, spec)]) of every layer the Config quantizes, without changing ``model``:
    a prepared model's twins as they are, else the plan ``prepare`` would follow."""
    out = []
    if any(isinstance(m, QuantMixin) for m in model.modules()):
        for name, m in model.named_modules():
            if isinstance(m, QuantMixin):
                slots = [(s, getattr(getattr(m, s.attr, None), "spec", None)) for s in _slots(m)]
                out.append((f"{name}." if name else "", m, slots))
        return out
    for plan in ModelQuantizer(config).resolve(model, warn=False):
        module = model.get_submodule(plan.name)
        twin = next(QUANT_MODULE_MAP[c] for c in type(module).__mro__ if c in QUANT_MODULE_MAP)
        slots = [(s, twin.slot_spec(s, getattr(plan.qconfig, s.role))) for s in twin.slots_for(module)]
        out.append((f"{plan.name}." if plan.name else "", module, slots))
    return out


def check_model_tensors(check: _Checker, model: nn.Module, handled: set[str]) -> None:
    """The rule both imports share once the quantized layers' tensors are checked (``handled``: the model's keys
    they store; ``check.expected``: every key read): each other tensor of the model stored as it is
    (``_Checker.model_tensor``; quantizer state and tied copies aside), and nothing else in the file."""
    prefixes = _quantizer_prefixes(model)
    state = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = tied_to_stored(state, check.tensors)  # loaded with the tensor the file stores (a tied lm_head)
    for key, value in state.items():
        if key not in handled and not _is_quantizer_state(key, prefixes) and key not in tied:
            check.model_tensor(key, value, key in params)
    extra = sorted(set(check.tensors) - check.expected)
    if extra:
        check.fail(extra[0], "only tensors of the model and of its quantized layers", f"'{extra[0]}' that belongs to none" +
                   (f" (and {len(extra) - 1} more: {extra[1:6]})" if len(extra) > 1 else ""))  # fmt: skip


def check_import(model: nn.Module, config: Config, tensors: dict[str, torch.Tensor], info: dict[str, Any], where: str) -> None:
    """ValueError (naming the tensor, what was expected and what was found) unless ``tensors`` hold exactly what
    ``export_safetensors`` writes for ``model`` quantized with ``config``: every tensor present, its dtype and shape
    (codes, packed byte counts, scales), scales finite and > 0, zero points and codes in range, float tensors
    finite (NaN never; buffers may hold infinities, as attention masks do), nothing extra. Changes nothing."""
    check = _Checker(where, tensors)
    described: set[str] = set()
    skip: set[str] = set()
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for prefix, module, slots in _quant_layers(model, config):
        for slot, spec in slots:
            if slot.tensor is not None:
                tensor = getattr(module, slot.tensor, None)
                if isinstance(tensor, torch.Tensor):
                    key = prefix + slot.tensor
                    skip.add(key)
                    described.add(key)
                    check.weight(key, tensor, spec, info.get(key), key in params)
            elif spec is not None and info.get(prefix + activation_key(slot)) == {"encoding": "float"}:
                described.add(prefix + activation_key(slot))  # the exported model ran it unquantized: nothing stored
            elif spec is not None and not spec.is_dynamic and isinstance(format_of(spec.dtype), IntFormat | FloatFormat):
                key = prefix + activation_key(slot)
                described.add(key)
                if info.get(key) != {"encoding": "qparams"}:
                    check.fail(key, "a metadata entry {'encoding': 'qparams'}", repr(info.get(key)))
                check.qparams(key, spec, None)
    check_model_tensors(check, model, skip)
    unknown = sorted(set(info) - described)
    if unknown:
        check.fail(unknown[0], "metadata only for the quantized layers' tensors", f"an entry for '{unknown[0]}', which is none of them")


# ----------------------------------------------------------------------------------------------- import
#: bytes per element of safetensors' dtype names
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_entry(path: Path, name: str, entry: Any) -> tuple[str, list[int], tuple[int, int]]:
    """(dtype, shape, data_offsets) of one header entry; a ValueError names the tensor and the field otherwise."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: tensor '{name}': its header entry {entry!r} is not a mapping of dtype, shape and data_offsets")
    missing = [f for f in ("dtype", "shape", "data_offsets") if f not in entry]
    if missing:
        raise ValueError(f"{path}: tensor '{name}': its header entry has no {missing}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise ValueError(f"{path}: tensor '{name}': dtype={dtype!r} must be a safetensors dtype name (e.g. 'F32')")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise ValueError(f"{path}: tensor '{name}': shape={shape!r} must be a list of integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise ValueError(f"{path}: tensor '{name}': data_offsets={offsets!r} must be two integers [start, end]")
    return dtype, shape, (offsets[0], offsets[1])


def check_header(path: str | Path) -> None:
    """ValueError naming the tensor unless every entry of the safetensors header at ``path`` spans exactly the bytes
    its dtype and shape need, inside the file (the reader's own message names no tensor). Reads the header only."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or 8 + length > size:
            raise ValueError(f"{path} is not a readable safetensors file: its header length {length} does not fit in {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable safetensors file: its header is not JSON ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a readable safetensors file: its header is not a mapping")
    data = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _header_entry(path, name, entry)
        if dtype not in _ST_ITEMSIZE:
            continue  # a dtype this check does not know: safetensors' reader judges it
        need = _ST_ITEMSIZE[dtype] * int(torch.Size(shape).numel()) if all(d >= 0 for d in shape) else -1
        if need < 0 or end - start != need:
            raise ValueError(f"{path}: tensor '{name}': expected {need} bytes ({dtype} of shape {shape}), found {end - start} "
                             f"(data_offsets [{start}, {end}])")  # fmt: skip
        if not 0 <= start <= end <= data:
            raise ValueError(f"{path} is not a readable safetensors file: tensor '{name}': data_offsets [{start}, {end}] lie "
                             f"outside its {data} data bytes (a truncated file?)")  # fmt: skip


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Config]:
    st = _require_safetensors()
    from safetensors import safe_open

    check_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = st.load_file(str(path))
    except Exception as err:  # a truncated or corrupt file: the reader's own errors vary
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    if metadata.get("quant_method") != "quark":
        raise ValueError(f"{path} is not a quark export (metadata quant_method={metadata.get('quant_method')!r})")
    try:
        info = json.loads(metadata["quark_tensors"])
        config = config_from_stored(json.loads(metadata["quantization_config"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: the metadata 'quark_tensors' / 'quantization_config' cannot be read: {err}") from err
    if not isinstance(info, dict):
        raise ValueError(f"{path}: the metadata 'quark_tensors' is not a mapping")
    return tensors, info, config


def import_model_from_safetensors(
    model: nn.Module | None, model_dir: str | Path, multi_device: bool = False, trust_remote_code: bool = False,
    attn_implementation: str = "eager", device: str | torch.device | None = None, multi_gpu: bool | str | None = False,
    *, filename: str = FILENAME,
) -> nn.Module:  # fmt: skip
    """Rebuild the quantized model from a float ``model`` of the same architecture and an exported directory:
    amd-quark 0.13's directory (config.json with a quark ``quantization_config``) or this project's single file;
    amd-quark 0.13's signature.

    ``model=None`` builds the Hugging Face model ``config.json`` describes as a skeleton (Parameters on the meta
    device, see ``skeleton.hf_skeleton``; ``trust_remote_code`` and ``attn_implementation`` go to transformers). A
    ``model`` whose Parameters are on meta is filled the same way. ``device`` places the result (None: where the
    model's tensors are, the CPU for a skeleton; amd-quark's default is "cuda"). Every tensor of the file is checked
    first against the stored Config and ``model``: on any mismatch a ValueError names the tensor and ``model`` is
    left as it was. Returns the model prepared with the stored Config, in eval mode: weights set to their dequantized
    codes, each with a pass-through ``BakedFakeQuantize`` holding its spec and qparams (the values are on the grid;
    a weight another module shares, such as an lm_head tied to float input embeddings, holds those float values and
    keeps a frozen quantizer), every static activation quantizer frozen with the stored qparams; a tensor stored as
    the exported model ran it unquantized (fake quant switched off, not on its grid) has no quantizer."""
    from quark.torch.export.quark_format import import_quark_dir, is_quark_dir
    from quark.torch.export.skeleton import hf_skeleton

    if multi_device or multi_gpu:
        raise ValueError("import_model_from_safetensors: multi_device / multi_gpu loading is not supported here; "
                         "pass device= (one device) and shard the returned model yourself")  # fmt: skip
    if model is None:
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model=None needs {Path(model_dir) / 'config.json'} (a Hugging Face config) to build the model")
        model = hf_skeleton(model_dir, trust_remote_code, attn_implementation)
    if filename == FILENAME and is_quark_dir(model_dir):  # amd-quark 0.13's directory (or ours with custom_mode="quark")
        return _placed(import_quark_dir(model, model_dir, device), device)
    path = Path(model_dir) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (written by export_safetensors?)")
    tensors, info, config = _read(path)
    check_import(model, config, tensors, info, str(path))
    materialize(model, device, set(tensors))
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        ModelQuantizer(config).prepare(model)
    owned = {k for key in info for k in (key, key + "_scale", key + "_zero_point")}
    shared = shared_tensors(model)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, QuantMixin):
                _load_layer(m, f"{name}." if name else "", tensors, info, shared)
    # the float tensors last: a Parameter a quantized layer shares with a float one (an lm_head tied to the input
    # embeddings) holds the float values, as in the model exported; the layer's frozen quantizer applies its codes
    model.load_state_dict({k: v for k, v in tensors.items() if k not in owned}, strict=False)
    return _placed(ModelQuantizer.freeze(model).eval(), device)


def _load_layer(m: QuantMixin, prefix: str, tensors: dict[str, torch.Tensor], info: dict[str, Any], shared: set[int]) -> None:
    """One quantized layer from the single file: each stored weight decoded into its tensor with the quantizer
    ``decoded_weight_quantizer`` gives (none where it was stored as the model used it, unquantized), each activation
    slot frozen with its stored qparams, or emptied where the exported model ran it unquantized."""
    for slot in _slots(m):
        q = getattr(m, slot.attr, None)
        key = prefix + (slot.tensor if slot.tensor is not None else activation_key(slot))
        meta = info.get(key)
        if meta is None:
            continue
        encoding = meta["encoding"]
        if slot.tensor is not None:
            getattr(m, slot.tensor).copy_(decode_weight(tensors, key, meta))
        if q is None:
            continue
        if encoding == "float" and "dtype" not in meta:
            m.set_quantizer(slot, None)  # stored as the model used it: unquantized
        elif slot.tensor is None:
            m.set_quantizer(slot, FrozenScaledFakeQuantize(q.spec, tensors[key + "_scale"], tensors[key + "_zero_point"]))
        else:
            scaled = encoding.startswith(("int", "float8", "minifloat"))  # an MX _scale is E8M0 exponents, no qparam
            scale = tensors[key + "_scale"].float() if scaled else None
            zp = tensors.get(key + "_zero_point", torch.zeros((), dtype=torch.int32)) if scaled else None
            quantizer = decoded_weight_quantizer(m, slot, q.spec, scale, zp, shared)
            if quantizer is not None:
                m.set_quantizer(slot, quantizer)


def _placed(model: nn.Module, device: str | torch.device | None) -> nn.Module:
    return model if device is None else model.to(device)


def size_report(path: str | Path, model: nn.Module) -> dict[str, float]:
    """Bytes of an exported file against the FP32 state of ``model``'s parameters, and bits per parameter."""
    file_bytes = Path(path).stat().st_size
    params = [p for n, p in model.named_parameters() if "_quantizer" not in n]
    count = sum(p.numel() for p in params)
    fp32_bytes = 4 * count
    return {
        "file_bytes": file_bytes, "fp32_bytes": fp32_bytes, "ratio": file_bytes / fp32_bytes if fp32_bytes else 0.0,
        "bits_per_parameter": 8 * file_bytes / count if count else 0.0,
    }  # fmt: skip
