"""Checks of amd-quark's directory before its import touches the model: every tensor a quantized layer needs, with
amd-quark's dtype and shape, scales finite and positive, codes and zero points in range, then the single-file
import's rule for the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.quark_codec import (
    BLOCK_DTYPES,
    MANTISSA_BITS,
    int_container,
    unsupported_layout,
    weight_layout,
)
from quark.torch.export.validation import (
    Checker,
    check_model_tensors,
    describe_tensor,
)
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    TORCH_FLOAT8,
    IntFormat,
    format_of,
)
from quark.torch.quantization.formats.grouping import tile_layout
from quark.torch.quantization.formats.table import MXINT8_QMAX
from quark.torch.quantization.hf import linear_weight
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QUANT_MODULE_MAP, slot_tensor
from quark.torch.quantization.resolve import float_type


def _stored_weight(spec: QuantizationSpec, shape: torch.Size) -> tuple[tuple[torch.dtype, ...], tuple[int, ...]] | None:
    """The dtype(s) and shape a weight of ``shape`` quantized with ``spec`` is stored in (None: no layout)."""
    layout = weight_layout(spec, torch.empty(shape, device="meta"))
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
        return ((torch.int32,), (rest, (out + 7) // 8)) if fmt.bits == 4 else ((int_container(fmt),), (rest, out))
    return ((torch.int32,), (out, (rest + 7) // 8)) if fmt.bits == 4 else ((int_container(fmt),), dims)


def check_before_import(
    model: nn.Module, config: Config, t: dict[str, torch.Tensor], path: Path, checked: set[str] | None = None
) -> None:
    """Every tensor a quantized layer needs is there with amd-quark's dtype and shape, scales finite and positive
    (with the shape of their qscheme), zero points and codes inside the format's range, no companion a layout does
    not have (a zero point of fp8 weights), then the rest by the single-file import's rule (``check_model_tensors``:
    float tensors as the model's, nothing extra); raises a ValueError naming the tensor otherwise. ``checked``: keys
    checked elsewhere (the attention probabilities' scales)."""
    check = Checker(str(path), t)
    check.expected |= checked or set()
    owned: set[str] = set()
    for plan in ModelQuantizer(config).resolve(model):
        module = model.get_submodule(plan.name)
        prefix = f"{plan.name}." if plan.name else ""
        twin = type(module) if isinstance(module, QuantMixin) else QUANT_MODULE_MAP[float_type(module)]  # type: ignore[index]
        parts = twin.linear_parts_for(module)
        _check_shared_inputs(path, prefix, parts, t)
        for part, weight_slot, _ in parts:  # each a Linear of its own (one expert's projection)
            weight = slot_tensor(module, weight_slot)
            where = f"{plan.name}.{part}" if plan.name else part
            _check_linear(
                check,
                path,
                f"{prefix}{part}.",
                where,
                weight.shape,
                plan.qconfig.weight,
                plan.qconfig.input_tensors,
                None,
            )  # type: ignore[union-attr]
            owned.add(prefix + weight_slot.tensor)  # type: ignore[operator]
        if parts:
            continue
        # the configured weight spec is for Linear's [out, in] view, which a Conv1D is stored as
        weight = linear_weight(module) if isinstance(getattr(module, "weight", None), torch.Tensor) else None
        spec, inputs, outputs = plan.qconfig.weight, plan.qconfig.input_tensors, plan.qconfig.output_tensors
        shape = weight.shape if isinstance(weight, torch.Tensor) else None
        owned |= _check_linear(check, path, prefix, plan.name, shape, spec, inputs, outputs)
    check_model_tensors(check, model, owned)  # the float tensors and nothing extra: the single-file import's rule


def _check_shared_inputs(
    path: Path, prefix: str, parts: tuple[tuple[str, Any, Any], ...], t: dict[str, torch.Tensor]
) -> None:
    """Parts that read one input (an expert's gate and up projections) have one input quantizer in the model: their
    stored input scales (and zero points) must be equal."""
    first: dict[str, str] = {}
    for part, _, source in parts:
        if source is None:
            continue
        seen = first.setdefault(source.attr, part)
        for leaf in ("input_scale", "input_zero_point"):
            a, b = t.get(f"{prefix}{seen}.{leaf}"), t.get(f"{prefix}{part}.{leaf}")
            if seen != part and a is not None and b is not None and not torch.equal(a, b):
                raise ValueError(
                    f"{path}: '{prefix}{seen}.{leaf}' and '{prefix}{part}.{leaf}' differ ({a.tolist()} vs "
                    f"{b.tolist()}), but the two projections read the same input: the model has one input quantizer "
                    "for them"
                )


def _check_linear(
    check: Checker,
    path: Path,
    prefix: str,
    name: str,
    shape: torch.Size | None,
    spec: QuantizationSpec | None,
    inputs: QuantizationSpec | None,
    outputs: QuantizationSpec | None,
) -> set[str]:
    """The tensors of one quantized Linear-like layer stored under ``prefix`` (``name`` in messages): its weight of
    ``shape`` (None: it has none) with ``spec`` and its static input / output qparams. Returns the model's keys it
    stores (the weight's)."""
    owned = set()
    if spec is not None and shape is not None:
        key = prefix + "weight"
        expected = _stored_weight(spec, shape)
        if expected is None:
            raise unsupported_layout(f"{path}: '{key}'", spec)
        for need in (key, key + "_scale") if spec.dtype not in (Dtype.bfloat16, Dtype.float16) else (key,):
            if need not in check.tensors:
                raise ValueError(
                    f"{path}: tensor '{need}' is missing (the config quantizes '{name}' as {spec.dtype.name})"
                )
        dtypes, stored = expected
        t = check.tensors[key]
        if t.dtype not in dtypes or tuple(t.shape) != stored:
            raise ValueError(
                f"{path}: tensor '{key}': expected {[str(d) for d in dtypes]} of shape {list(stored)}, found {t.dtype} of shape {list(t.shape)}"
            )
        if spec.dtype not in (*BLOCK_DTYPES, Dtype.bfloat16, Dtype.float16):
            _check_scale(path, key + "_scale", check.tensors[key + "_scale"])
        check.expected.add(key)
        _check_weight_values(check, key, spec, shape)  # reads (and expects) the companions it has
        owned.add(key)
    for role, spec_a in (("input", inputs), ("output", outputs)):
        if spec_a is None or spec_a.is_dynamic or spec_a.dtype in BLOCK_DTYPES:
            continue
        key = f"{prefix}{role}_scale"
        if key not in check.tensors:
            raise ValueError(
                f"{path}: tensor '{key}' is missing (the config quantizes the {role} of '{name}' statically)"
            )
        _check_scale(path, key, check.tensors[key])
        _check_activation_qparams(check, f"{prefix}{role}", spec_a)
    return owned


def _check_scale(path: Path, key: str, scale: torch.Tensor) -> None:
    if not scale.is_floating_point():
        raise ValueError(f"{path}: tensor '{key}': expected a float scale, found {describe_tensor(scale)}")
    s = scale.float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(
            f"{path}: tensor '{key}': expected finite scales > 0, found min {float(s.min())}, max {float(s.max())}"
        )


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


def _check_weight_values(check: Checker, key: str, spec: QuantizationSpec, shape: torch.Size) -> None:
    """The values of a weight whose codes have amd-quark's dtype and shape, and its companion tensors: float8 / cast
    values finite, integer codes in the format's range, MX E8M0 bytes below 255 (NaN), mx6 / mx9 codes, steps and
    shifts, each scale's shape and the zero points (present for integers, their dtype, shape and range)."""
    dims = tuple(int(d) for d in shape)
    layout = weight_layout(spec, torch.empty(dims, device="meta"))
    stored = check.tensors[key]
    if layout in ("cast", "float8"):
        check.finite(key, stored, f"{spec.dtype.name} values")
    if layout == "cast":
        return
    if layout == "mx":
        element = Dtype(spec.mx_element_dtype)
        e8m0 = check.get(
            key + "_scale", (torch.uint8,), [dims[0], -(-dims[1] // (spec.group_size or 32))], "E8M0 block scales"
        )
        check.in_range(key + "_scale", e8m0, 0, 254, "E8M0 block scales (255 is NaN)")
        if element == Dtype.int8:
            check.in_range(key, stored, -MXINT8_QMAX, MXINT8_QMAX, "MX int8 elements")
        elif element in TORCH_FLOAT8:
            check.finite(key, stored, f"MX {element.name} elements")
        return
    if layout == "block":
        limit = 2 ** MANTISSA_BITS[spec.dtype] - 1
        check.in_range(key, stored, -limit, limit, f"{spec.dtype.name} codes")
        step = check.get(
            key + "_scale", (torch.float32,), [dims[0], -(-dims[1] // (spec.group_size or 16))], "block steps"
        )
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
        zp = check.get(
            zp_key, (torch.int32,), [-(-dims[1] // (spec.group_size or 32)), (dims[0] + 7) // 8], "packed zero points"
        )
    elif packed and spec.qscheme == QSchemeType.per_channel:
        zp = check.get(zp_key, (torch.int32,), [(dims[0] + 7) // 8], "packed zero points")
    else:
        zp = check.get(zp_key, (int_container(fmt),), _scale_shape(spec, dims, layout == "int_group"), "zero points")
    if not (packed and zp.dtype == torch.int32):  # packed nibbles are in range by construction
        check.in_range(zp_key, zp, fmt.qmin, fmt.qmax, f"{spec.dtype.name} zero points")


def _check_activation_qparams(check: Checker, name: str, spec: QuantizationSpec) -> None:
    """``<name>_scale`` (float, one element, or one per channel) and, for integer formats, ``<name>_zero_point`` in
    the codes' dtype, the scale's shape and the format's range."""
    scale = check.tensors[name + "_scale"]
    shape = None if spec.qscheme != QSchemeType.per_channel else (list(scale.shape) if scale.ndim == 1 else [-1])
    check.get(name + "_scale", _SCALE_DTYPES, shape, "a scale")
    fmt = format_of(spec.dtype)
    if isinstance(fmt, IntFormat):
        zp = check.get(name + "_zero_point", (int_container(fmt),), shape, "a zero point")
        check.in_range(name + "_zero_point", zp, fmt.qmin, fmt.qmax, f"{spec.dtype.name} zero points")
