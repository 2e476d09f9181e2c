"""What ONNX Q/DQ can express: the file name, the formats and opsets, and the checks that name the first quantizer
of a model no opset expresses (``check_onnx_exportable``) and choose the opset to write."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.type import Dtype, QSchemeType, ZeroPointType
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import slot_label, slot_name, slot_tensor_name
from quark.torch.quantization.nn.modules.quant_modules import slot_tensor as parameter_or_part

FILENAME = "quark_model.onnx"  # amd-quark's name
#: the int8 / uint8 ranges torch's fused fake-quant ops (and QuantizeLinear) take
INT8_RANGES = {Dtype.int8: (-128, 127), Dtype.uint8: (0, 255)}
#: integer formats a weight can be stored in, as ONNX names the tensor type
STORED_INTS = {Dtype.int4: "INT4", Dtype.uint4: "UINT4", Dtype.int8: "INT8", Dtype.uint8: "UINT8"}
#: fp8_e5m2 is left out: its small scales make onnxruntime overflow biases (see ``lowering._Lowering.warn_bias_overflow``)
FLOAT8_TYPES = {Dtype.fp8_e4m3: "FLOAT8E4M3FN"}
#: the placeholders' op domain: traced, then replaced; none is left in the written file
PLACEHOLDER_DOMAIN = "quark.lowbit"
_DEFAULT_OPSET = 17
_SUPPORTED = (
    "ONNX QDQ export supports static int8/uint8 quantizers per tensor or per channel, fp8_e4m3 per tensor "
    "(weights also per channel), and for weights and biases int4/uint4 per tensor or per channel and "
    "int4/uint4/int8/uint8 per group along axis 1 (the input features), integers with integer zero points"
)


def _opset_for(spec: Any, ndim: int | None) -> int | None:
    """The lowest opset whose Q/DQ expresses ``spec`` (``ndim``: the rank of the weight or bias it quantizes, None
    for an activation), None where none does."""
    scheme = spec.qscheme
    if spec.is_dynamic:
        return None
    if spec.dtype in FLOAT8_TYPES:  # FLOAT8 zero points: opset 19
        return (
            19 if scheme == QSchemeType.per_tensor or (ndim is not None and scheme == QSchemeType.per_channel) else None
        )
    if spec.dtype not in STORED_INTS or spec.zero_point_type == ZeroPointType.float32:
        return None
    if scheme == QSchemeType.per_group:  # DequantizeLinear's block_size: opset 21
        return 21 if ndim is not None and ndim >= 2 and spec.ch_axis is not None and spec.ch_axis % ndim == 1 else None
    if scheme not in (QSchemeType.per_tensor, QSchemeType.per_channel):
        return None
    if spec.dtype in INT8_RANGES:
        return 13  # per-channel QuantizeLinear
    return 21 if ndim is not None else None  # INT4 / UINT4 tensors: opset 21, stored weights only


def _describe(spec: Any, ndim: int | None) -> str:
    """``spec`` as the messages name it: dtype, scheme, the axis where it matters, and what it quantizes."""
    parts = [spec.dtype.name, spec.qscheme.name if spec.qscheme else "None"]
    if spec.qscheme in (QSchemeType.per_channel, QSchemeType.per_group):
        parts.append(f"ch_axis={spec.ch_axis}")
    if spec.is_dynamic:
        parts.append("dynamic")
    if spec.zero_point_type == ZeroPointType.float32 and spec.dtype in STORED_INTS:
        parts.append("float zero point")
    return ", ".join(parts) + (" (an activation)" if ndim is None else f" (a tensor of rank {ndim})")


def check_spec(spec: Any, where: str, ndim: int | None = None) -> int:
    """ValueError unless Q/DQ expresses ``spec`` (``ndim``: rank of the weight or bias it quantizes, None for an
    activation); returns the lowest opset that does."""
    opset = _opset_for(spec, ndim)
    if opset is None:
        raise ValueError(f"{where}: {_SUPPORTED}; got {_describe(spec, ndim)}")
    return opset


def named_quantizer_slots(model: nn.Module) -> Iterator[tuple[QuantMixin, Any, nn.Module, str, str]]:
    """(layer, slot, quantizer, message name, graph name) of every quantizer slot of ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            for slot, q in list(m.quantizer_slots()):  # every slot: layers with several weights / inputs included
                label = slot_tensor_name(slot) or slot_name(slot)
                yield m, slot, q, f"layer '{name}' ({slot_label(slot)})", f"{name}.{label}" if name else label


def functional_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """Graph mode: the Parameter each weight-quantizer node of a functionally used weight (``F.linear(x, self.w)``)
    reads, by the id of that node's module; its codes are stored like a layer's weight."""
    from quark.torch.quantization.graph import QuantFunctionalWeight, is_graph_module
    from quark.torch.quantization.graph.capture import fetch_attr

    found: dict[int, torch.Tensor] = {}
    for gm in model.modules():
        if not is_graph_module(gm):
            continue
        for node in gm.graph.nodes:  # type: ignore[union-attr]
            if node.op != "call_module" or not node.args or getattr(node.args[0], "op", None) != "get_attr":
                continue
            module = gm.get_submodule(str(node.target))
            tensor = fetch_attr(gm, node.args[0])  # type: ignore[arg-type]
            if isinstance(module, QuantFunctionalWeight) and isinstance(tensor, torch.Tensor):
                found[id(module)] = tensor
    return found


def slot_tensor(layer: QuantMixin, slot: Any, functional: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The weight / bias a slot quantizes (a functionally used Parameter included); None for an activation slot."""
    if slot.tensor is not None:
        return parameter_or_part(layer, slot)
    return functional.get(id(layer))


def _ndim(layer: QuantMixin, slot: Any, functional: dict[int, torch.Tensor]) -> int | None:
    """The rank of the tensor a weight / bias slot quantizes; None for an activation slot."""
    tensor = slot_tensor(layer, slot, functional)
    return None if tensor is None else tensor.ndim


def _required_opset(model: nn.Module) -> tuple[int, str]:
    """Check every quantizer of ``model`` (ValueError naming the first Q/DQ cannot express, or the first layer without
    a fixed graph); the opset the model needs and the quantizer that sets it."""
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin) and m.data_dependent is not None:
            raise ValueError(
                f"export_onnx: layer '{name}' ({type(m).__name__}) has no fixed graph to export: {m.data_dependent}; "
                "export_safetensors writes it"
            )
    needed, why = 0, ""
    functional = functional_weights(model)
    for layer, slot, q, where, _ in named_quantizer_slots(model):
        spec, ndim = q.spec, _ndim(layer, slot, functional)  # type: ignore[attr-defined]
        opset = check_spec(spec, where, ndim)
        if opset > needed:
            needed, why = opset, f"{where}, {_describe(spec, ndim)},"
    return needed, why


def check_onnx_exportable(model: nn.Module) -> int:
    """Before any work: every quantizer of the prepared ``model`` must be expressible as Q/DQ (names the first that is
    not) and every quantized layer must have a fixed graph (a layer whose ``data_dependent`` says why not, as fused
    MoE experts, is refused); returns the lowest opset the model's quantizers need (13 for int8, 19 with fp8, 21 with
    int4 or groups)."""
    return _required_opset(model)[0]


def export_opset(requested: int | None, model: nn.Module) -> int:
    """The opset to write: ``requested``, or when None the default 17 raised to what the quantizers need (21 with fp8
    activations, whose QuantizeLinear then needs no zero point: see ``lowering._Lowering.float8_qdq``); ValueError naming the
    layer when ``requested`` is too old for one of them."""
    needed, why = _required_opset(model)
    if requested is None:
        float8_inputs = any(
            slot.tensor is None and q.spec.dtype in FLOAT8_TYPES for _, slot, q, _, _ in named_quantizer_slots(model)
        )  # type: ignore[attr-defined]
        return max(_DEFAULT_OPSET, needed, 21 if float8_inputs else 0)
    if requested < needed:
        raise ValueError(f"export_onnx: {why} needs opset {needed}; got opset_version={requested} (None chooses it)")
    return requested


def has_4bit(model: nn.Module) -> bool:
    """Whether any quantizer of ``model`` is int4 / uint4."""
    return any(q.spec.dtype in (Dtype.int4, Dtype.uint4) for _, _, q, _, _ in named_quantizer_slots(model))  # type: ignore[attr-defined]
