"""Checks before an import touches the model: the single file's header and tensors against the stored Config
(``check_header``, ``check_import``, ``check_model_tensors``, the ``Checker`` both layouts use), and the layers both
exports write in float (``unreached_layers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from quark.torch.export.codec import (
    E8M0_DTYPE,
    activation_key,
    int_storage,
    is_quantizer_state,
    quant_slots,
    quantizer_prefixes,
    tied_to_stored,
)
from quark.torch.export.packing import (
    unpack_nibbles,
)
from quark.torch.quantization.api import ModelQuantizer, uncalibrated_layers
from quark.torch.quantization.attention import hf_attention_modules
from quark.torch.quantization.config.config import Config, QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType, ZeroPointType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    FloatFormat,
    IntFormat,
    decode,
    format_of,
)
from quark.torch.quantization.formats.grouping import tile_layout
from quark.torch.quantization.formats.table import MXINT8_QMAX
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_attention import ATTENTION_PROBS, QuantAttentionProbs
from quark.torch.quantization.nn.modules.quant_modules import (
    QUANT_MODULE_MAP,
    QuantSlot,
    slot_tensor,
    slot_tensor_name,
)


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


def describe_tensor(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} of shape {list(tensor.shape)}"


#: the dtypes a float tensor of the model may be stored in, besides its own
_STORED_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Checker:
    """Checks a file's tensors against its Config and the target model; collects the keys it expects."""

    def __init__(self, where: str, tensors: dict[str, torch.Tensor]) -> None:
        self.where, self.tensors, self.expected = where, tensors, set()

    def fail(self, key: str, expected: str, found: str) -> NoReturn:
        raise ValueError(f"{self.where}: tensor '{key}': expected {expected}, found {found}")

    def get(self, key: str, dtypes: tuple[torch.dtype, ...], shape: list[int] | None, what: str) -> torch.Tensor:
        """The tensor ``key`` after checking presence, dtype and shape (``shape`` None: exactly one element)."""
        self.expected.add(key)
        if key not in self.tensors:
            self.fail(
                key,
                f"{what} ({' or '.join(str(d).removeprefix('torch.') for d in dtypes)})",
                "no such tensor in the file",
            )
        t = self.tensors[key]
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        if t.dtype not in dtypes:
            self.fail(key, f"{what} of dtype {names}", describe_tensor(t))
        if shape is None and t.numel() != 1:
            self.fail(key, f"{what} with one element", describe_tensor(t))
        if shape is not None and list(t.shape) != list(shape):
            self.fail(key, f"{what} of shape {list(shape)}", describe_tensor(t))
        return t

    def finite(self, key: str, t: torch.Tensor, what: str, allow_inf: bool = False) -> None:
        v = t.float()
        bad = torch.isnan(v) if allow_inf else ~torch.isfinite(v)
        if bool(bad.any()):
            self.fail(
                key,
                f"{what} with {'no NaN' if allow_inf else 'finite values'}",
                f"{int(bad.sum())} value(s) that are {'NaN' if allow_inf else 'NaN or infinite'}",
            )

    def model_tensor(self, key: str, value: torch.Tensor, is_param: bool) -> None:
        """A tensor of the model stored as it is (either layout; a quantized layer's unquantized bias too): the
        model's shape; a float one in float32 / float16 / bfloat16 or the model's own dtype (what the exports
        write), finite (NaN never; buffers may hold inf, as attention masks do); any other in the model's dtype."""
        if not value.is_floating_point():
            self.get(key, (value.dtype,), list(value.shape), "a tensor of the model")
            return
        dtypes = tuple(dict.fromkeys((*_STORED_FLOATS, value.dtype)))
        self.finite(
            key, self.get(key, dtypes, list(value.shape), "a float tensor"), "a float tensor", allow_inf=not is_param
        )

    def codes_in_format(self, key: str, codes: torch.Tensor, fmt: FloatFormat) -> None:
        """Bit patterns that are values of ``fmt`` (fp8's NaN / inf patterns decode past ``max_normal``)."""
        values = decode(codes, fmt).abs()
        if bool((values > fmt.max_normal).any()):
            self.fail(
                key,
                f"{fmt.bits}-bit codes of values within +-{fmt.max_normal}",
                f"{int((values > fmt.max_normal).sum())} "
                f"code(s) past it, e.g. {int(codes.reshape(-1)[(values > fmt.max_normal).reshape(-1)][0])}",
            )

    def in_range(self, key: str, values: torch.Tensor, low: float, high: float, what: str) -> None:
        if values.numel() and (bool((values < low).any()) or bool((values > high).any())):
            self.fail(key, f"{what} in [{low}, {high}]", f"values in [{values.min().item()}, {values.max().item()}]")

    def scale(self, key: str, shape: list[int] | None, spec: QuantizationSpec | None = None) -> None:
        e8m0 = spec is not None and spec.scale_type == ScaleType.float8_e8m0fnu and E8M0_DTYPE is not None
        t = self.get(key, (torch.float32, E8M0_DTYPE) if e8m0 else (torch.float32,), shape, "a scale").float()  # type: ignore[arg-type]
        self.finite(key, t, "a scale")
        if bool((t <= 0).any()):
            self.fail(key, "a scale > 0", f"min {t.min().item()}")

    def zero_point(
        self, key: str, shape: list[int] | None, fmt: IntFormat | FloatFormat, spec: QuantizationSpec
    ) -> None:
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
            self.fail(
                key,
                f"encoding {expected!r} (the Config's {spec.dtype.name if spec else 'no quantizer'}) or 'float'",
                repr(encoding),
            )
        if plain:
            self.model_tensor(key, param, is_param)
            return
        if encoding == "float":
            if meta["dtype"] != spec.dtype.name:  # type: ignore[union-attr]
                self.fail(key, f"values of {spec.dtype.name}", f"metadata dtype {meta['dtype']!r}")  # type: ignore[union-attr]
            self.finite(
                key, self.get(key, (torch.float32,), shape, "a float tensor"), "a float tensor", allow_inf=not is_param
            )
            return
        if spec is None:  # unreachable: with no spec only "float" passes the encoding check above
            self.fail(key, "a float tensor (the Config quantizes no such tensor)", repr(encoding))
        if encoding == "cast":
            t = self.get(
                key,
                (torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16,),
                shape,
                f"a {spec.dtype.name} tensor",
            )
            self.finite(key, t, f"a {spec.dtype.name} tensor")
            return
        count = int(torch.Size(shape).numel())
        if encoding.startswith("mx"):
            block, axis = spec.group_size or 32, -1 if spec.ch_axis is None else spec.ch_axis
            blocked = _blocked_shape(shape, axis, block)
            wanted = {
                "dtype": "mx",
                "element": Dtype(spec.mx_element_dtype).name,
                "block": block,
                "axis": axis,
                "blocked_shape": blocked,
            }
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
        wanted = {
            "dtype": spec.dtype.name,
            "qscheme": spec.qscheme.name if spec.qscheme else None,
            "ch_axis": spec.ch_axis,
            "group_size": spec.group_size,
            "block_size": spec.block_size,
        }
        self._same(key, meta, wanted)
        if spec.qscheme == QSchemeType.per_group and not isinstance(format_of(spec.dtype), IntFormat):
            self.fail(key, "per tensor or per channel minifloat weights", "per_group")
        qshape = _qparam_shape(shape, spec)
        fmt = format_of(spec.dtype)
        if isinstance(fmt, IntFormat):
            if encoding == "int_nibbles":
                packed = self.get(
                    key, (torch.uint8,), [(count + 1) // 2], f"{count} {fmt.bits}-bit codes packed two per byte"
                )
                codes = unpack_nibbles(packed, count, fmt.signed)
            else:
                codes = self.get(key, (int_storage(fmt),), shape, f"{spec.dtype.name} codes")
            self.in_range(key, codes, fmt.qmin, fmt.qmax, f"{spec.dtype.name} codes")
            self.scale(key + "_scale", qshape, spec)
            self.zero_point(key + "_zero_point", qshape, fmt, spec)
            return
        if not isinstance(fmt, FloatFormat):
            self.fail(key, "an integer or minifloat encoding", f"{encoding!r} for {spec.dtype.name}")
        if encoding == "float8":
            self.finite(
                key,
                self.get(key, (TORCH_FLOAT8[spec.dtype],), shape, f"{spec.dtype.name} values"),
                f"{spec.dtype.name} values",
            )
        elif encoding == "minifloat_nibbles":
            self.get(key, (torch.uint8,), [(count + 1) // 2], f"{count} {spec.dtype.name} codes packed two per byte")
        else:
            self.in_range(
                key,
                self.get(key, (torch.uint8,), shape, f"{spec.dtype.name} codes"),
                0,
                2**fmt.bits - 1,
                f"{fmt.bits}-bit codes",
            )
        self.scale(key + "_scale", qshape, spec)

    def _same(self, key: str, meta: dict[str, Any], wanted: dict[str, Any]) -> None:
        for field, value in wanted.items():
            if meta.get(field) != value:
                self.fail(
                    key, f"metadata {field}={value!r} (from the Config and the model)", f"{field}={meta.get(field)!r}"
                )


def _quant_layers(
    model: nn.Module, config: Config
) -> list[tuple[str, nn.Module, list[tuple[QuantSlot, QuantizationSpec | None]]]]:
    """(state-dict prefix, module, [(slot, spec)]) of every layer the Config quantizes, without changing ``model``:
    a prepared model's twins as they are, else the plan ``prepare`` would follow."""
    out = []
    if any(isinstance(m, QuantMixin) for m in model.modules()):
        for name, m in model.named_modules():
            if isinstance(m, QuantMixin):
                slots = [(s, getattr(getattr(m, s.attr, None), "spec", None)) for s in quant_slots(m)]
                out.append((f"{name}." if name else "", m, slots))
        return out
    for plan in ModelQuantizer(config).resolve(model, warn=False):
        module = model.get_submodule(plan.name)
        twin = next(QUANT_MODULE_MAP[c] for c in type(module).__mro__ if c in QUANT_MODULE_MAP)
        slots = [(s, twin.slot_spec(s, getattr(plan.qconfig, s.role))) for s in twin.slots_for(module)]
        out.append((f"{plan.name}." if plan.name else "", module, slots))
    if config.softmax_quant_spec is not None:  # the probabilities' twins prepare adds to each attention
        slot = QuantAttentionProbs.slots_for(nn.Identity())[0]
        for name, attention in hf_attention_modules(model):
            out.append((f"{name}.{ATTENTION_PROBS}.", attention, [(slot, config.softmax_quant_spec)]))
    return out


def check_model_tensors(check: Checker, model: nn.Module, handled: set[str]) -> None:
    """The rule both imports share once the quantized layers' tensors are checked (``handled``: the model's keys
    they store; ``check.expected``: every key read): each other tensor of the model stored as it is
    (``Checker.model_tensor``; quantizer state and tied copies aside), and nothing else in the file."""
    prefixes = quantizer_prefixes(model)
    state = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = tied_to_stored(state, check.tensors)  # loaded with the tensor the file stores (a tied lm_head)
    for key, value in state.items():
        if key not in handled and not is_quantizer_state(key, prefixes) and key not in tied:
            check.model_tensor(key, value, key in params)
    extra = sorted(set(check.tensors) - check.expected)
    if extra:
        check.fail(
            extra[0],
            "only tensors of the model and of its quantized layers",
            f"'{extra[0]}' that belongs to none"
            + (f" (and {len(extra) - 1} more: {extra[1:6]})" if len(extra) > 1 else ""),
        )


def check_import(
    model: nn.Module, config: Config, tensors: dict[str, torch.Tensor], info: dict[str, Any], where: str
) -> None:
    """ValueError (naming the tensor, what was expected and what was found) unless ``tensors`` hold exactly what
    ``export_safetensors`` writes for ``model`` quantized with ``config``: every tensor present, its dtype and shape
    (codes, packed byte counts, scales), scales finite and > 0, zero points and codes in range, float tensors
    finite (NaN never; buffers may hold infinities, as attention masks do), nothing extra. Changes nothing."""
    check = Checker(where, tensors)
    described: set[str] = set()
    skip: set[str] = set()
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for prefix, module, slots in _quant_layers(model, config):
        for slot, spec in slots:
            if slot.tensor is not None:
                tensor = slot_tensor(module, slot)
                if isinstance(tensor, torch.Tensor):
                    key = prefix + slot_tensor_name(slot)  # type: ignore[operator]
                    skip.add(prefix + slot.tensor)  # the Parameter (a stacked one: stored as its parts)
                    described.add(key)
                    check.weight(key, tensor, spec, info.get(key), prefix + slot.tensor in params)
            elif spec is not None and info.get(prefix + activation_key(slot)) == {"encoding": "float"}:
                described.add(prefix + activation_key(slot))  # the exported model ran it unquantized: nothing stored
            elif (
                spec is not None and not spec.is_dynamic and isinstance(format_of(spec.dtype), IntFormat | FloatFormat)
            ):
                key = prefix + activation_key(slot)
                described.add(key)
                if info.get(key) != {"encoding": "qparams"}:
                    check.fail(key, "a metadata entry {'encoding': 'qparams'}", repr(info.get(key)))
                check.qparams(key, spec, None)
    check_model_tensors(check, model, skip)
    unknown = sorted(set(info) - described)
    if unknown:
        check.fail(
            unknown[0],
            "metadata only for the quantized layers' tensors",
            f"an entry for '{unknown[0]}', which is none of them",
        )


# ----------------------------------------------------------------------------------------------- import
#: bytes per element of safetensors' dtype names
_ST_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_entry(path: Path, name: str, entry: Any) -> tuple[str, list[int], tuple[int, int]]:
    """(dtype, shape, data_offsets) of one header entry; a ValueError names the tensor and the field otherwise."""
    if not isinstance(entry, dict):
        raise ValueError(
            f"{path}: tensor '{name}': its header entry {entry!r} is not a mapping of dtype, shape and data_offsets"
        )
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
            raise ValueError(
                f"{path} is not a readable safetensors file: its header length {length} does not fit in {size} bytes"
            )
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
            raise ValueError(
                f"{path}: tensor '{name}': expected {need} bytes ({dtype} of shape {shape}), found {end - start} "
                f"(data_offsets [{start}, {end}])"
            )
        if not 0 <= start <= end <= data:
            raise ValueError(
                f"{path} is not a readable safetensors file: tensor '{name}': data_offsets [{start}, {end}] lie "
                f"outside its {data} data bytes (a truncated file?)"
            )


# ----------------------------------------------------------------------------------------------- layers run in float
def quantized_modules(model: nn.Module) -> list[tuple[str, QuantMixin]]:
    """(name, module) of every quantized layer (a twin) of ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, QuantMixin)]


def unreached_layers(model: nn.Module) -> list[str]:
    """Quantized layers that calibration never reached: ``uncalibrated_layers``, or run in float by
    ``ModelQuantizer.freeze``. Both exports write them in float and add them to the stored config's ``exclude``."""
    return sorted(
        uncalibrated_layers(model)
        | {name for name, m in quantized_modules(model) if m.unreached and not list(m.quantizer_slots())}
    )
