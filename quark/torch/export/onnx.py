"""ONNX export as a QuantizeLinear / DequantizeLinear graph, from the frozen model.

int8 / uint8 quantizers per tensor or per channel become torch's fused fake-quant ops, which the TorchScript exporter
writes as Q/DQ pairs (``fold_weight_quantization`` then stores the weights as integers). What that exporter cannot
write is traced as private placeholder nodes that ``lower_placeholders`` replaces by standard ONNX: int4 / uint4
weights (per tensor, channel or group) and int8 / uint8 weights per group as codes of type INT4 / UINT4 / INT8 /
UINT8 read by DequantizeLinear (``block_size`` for groups; opset 21), fp8 weights as FLOAT8 codes read by
DequantizeLinear, and fp8 activations as QuantizeLinear (to FLOAT8) + DequantizeLinear (opset 19; 21 by default)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.compat import EXPORT_GUARDS_ATTR
from quark.torch.export.codec import stored_quantizer
from quark.torch.export.files import write_atomically
from quark.torch.export.packing import pack_nibbles
from quark.torch.extras import import_extra
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ZeroPointType
from quark.torch.quantization.formats import TORCH_FLOAT8, decode, fake_quantize, format_of, int_range, quantize_int
from quark.torch.quantization.formats.grouping import channel_view
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import (
    refresh_computed_tensors,
    slot_label,
    slot_name,
    store_computed_tensors,
)

FILENAME = "quark_model.onnx"  # amd-quark's name
_RANGES = {Dtype.int8: (-128, 127), Dtype.uint8: (0, 255)}
#: integer formats a weight can be stored in, as ONNX names the tensor type
_STORED_INTS = {Dtype.int4: "INT4", Dtype.uint4: "UINT4", Dtype.int8: "INT8", Dtype.uint8: "UINT8"}
#: fp8_e5m2 is left out: its small scales make onnxruntime overflow biases (see ``_Lowering.warn_bias_overflow``)
_FLOAT8 = {Dtype.fp8_e4m3: "FLOAT8E4M3FN"}
_DOMAIN = "quark.lowbit"  # the placeholders' op domain: traced, then replaced; none is left in the written file
_DEFAULT_OPSET = 17
_TORCHSCRIPT_MAX_OPSET = 20  # the newest opset torch's TorchScript exporter writes; later ones by onnx's converter
_SUPPORTED = (
    "ONNX QDQ export supports static int8/uint8 quantizers per tensor or per channel, fp8_e4m3 per tensor "
    "(weights also per channel), and for weights and biases int4/uint4 per tensor or per channel and "
    "int4/uint4/int8/uint8 per group along axis 1 (the input features), integers with integer zero points"
)


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


# ----------------------------------------------------------------------------------------------- placeholders
def dequantize_linear(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, fmt: str, axis: int | None, block: int
) -> torch.Tensor:
    """ONNX DequantizeLinear in torch: ``(codes - zero_point) * scale`` with the qparams laid out as ONNX reads them
    (one value; one per index of ``axis``; with ``block``, one per block of ``axis``); fp8 codes are bit patterns."""
    dtype = Dtype(fmt)
    if dtype in _FLOAT8:
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
    if spec.dtype in _FLOAT8:
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
        out = g.op(f"{_DOMAIN}::DequantizeCodes", codes, scale, zero_point, **attrs)
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
        zero_point = torch.zeros_like(zero_point) if spec.dtype in _FLOAT8 else zero_point
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
        out = g.op(f"{_DOMAIN}::QuantizeDequantize", x, scale, fmt_s=fmt, name_s=name)
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


# ----------------------------------------------------------------------------------------------- checks
def _opset_for(spec: Any, ndim: int | None) -> int | None:
    """The lowest opset whose Q/DQ expresses ``spec`` (``ndim``: the rank of the weight or bias it quantizes, None
    for an activation), None where none does."""
    scheme = spec.qscheme
    if spec.is_dynamic:
        return None
    if spec.dtype in _FLOAT8:  # FLOAT8 zero points: opset 19
        return (
            19 if scheme == QSchemeType.per_tensor or (ndim is not None and scheme == QSchemeType.per_channel) else None
        )
    if spec.dtype not in _STORED_INTS or spec.zero_point_type == ZeroPointType.float32:
        return None
    if scheme == QSchemeType.per_group:  # DequantizeLinear's block_size: opset 21
        return 21 if ndim is not None and ndim >= 2 and spec.ch_axis is not None and spec.ch_axis % ndim == 1 else None
    if scheme not in (QSchemeType.per_tensor, QSchemeType.per_channel):
        return None
    if spec.dtype in _RANGES:
        return 13  # per-channel QuantizeLinear
    return 21 if ndim is not None else None  # INT4 / UINT4 tensors: opset 21, stored weights only


def _describe(spec: Any, ndim: int | None) -> str:
    """``spec`` as the messages name it: dtype, scheme, the axis where it matters, and what it quantizes."""
    parts = [spec.dtype.name, spec.qscheme.name if spec.qscheme else "None"]
    if spec.qscheme in (QSchemeType.per_channel, QSchemeType.per_group):
        parts.append(f"ch_axis={spec.ch_axis}")
    if spec.is_dynamic:
        parts.append("dynamic")
    if spec.zero_point_type == ZeroPointType.float32 and spec.dtype in _STORED_INTS:
        parts.append("float zero point")
    return ", ".join(parts) + (" (an activation)" if ndim is None else f" (a tensor of rank {ndim})")


def check_spec(spec: Any, where: str, ndim: int | None = None) -> int:
    """ValueError unless Q/DQ expresses ``spec`` (``ndim``: rank of the weight or bias it quantizes, None for an
    activation); returns the lowest opset that does."""
    opset = _opset_for(spec, ndim)
    if opset is None:
        raise ValueError(f"{where}: {_SUPPORTED}; got {_describe(spec, ndim)}")
    return opset


def _slots(model: nn.Module) -> Iterator[tuple[QuantMixin, Any, nn.Module, str, str]]:
    """(layer, slot, quantizer, message name, graph name) of every quantizer slot of ``model``."""
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            for slot, q in list(m.quantizer_slots()):  # every slot: layers with several weights / inputs included
                label = slot.tensor or slot_name(slot)
                yield m, slot, q, f"layer '{name}' ({slot_label(slot)})", f"{name}.{label}" if name else label


def _functional_weights(model: nn.Module) -> dict[int, torch.Tensor]:
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


def _slot_tensor(layer: QuantMixin, slot: Any, functional: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The weight / bias a slot quantizes (a functionally used Parameter included); None for an activation slot."""
    if slot.tensor is not None:
        return getattr(layer, slot.tensor)
    return functional.get(id(layer))


def _ndim(layer: QuantMixin, slot: Any, functional: dict[int, torch.Tensor]) -> int | None:
    """The rank of the tensor a weight / bias slot quantizes; None for an activation slot."""
    tensor = _slot_tensor(layer, slot, functional)
    return None if tensor is None else tensor.ndim


def _required_opset(model: nn.Module) -> tuple[int, str]:
    """Check every quantizer of ``model`` (ValueError naming the first Q/DQ cannot express); the opset the model needs
    and the quantizer that sets it."""
    needed, why = 0, ""
    functional = _functional_weights(model)
    for layer, slot, q, where, _ in _slots(model):
        spec, ndim = q.spec, _ndim(layer, slot, functional)  # type: ignore[attr-defined]
        opset = check_spec(spec, where, ndim)
        if opset > needed:
            needed, why = opset, f"{where}, {_describe(spec, ndim)},"
    return needed, why


def check_onnx_exportable(model: nn.Module) -> int:
    """Before any work: every quantizer of the prepared ``model`` must be expressible as Q/DQ (names the first that is
    not); returns the lowest opset the model's quantizers need (13 for int8, 19 with fp8, 21 with int4 or groups)."""
    return _required_opset(model)[0]


def _export_opset(requested: int | None, model: nn.Module) -> int:
    """The opset to write: ``requested``, or when None the default 17 raised to what the quantizers need (21 with fp8
    activations, whose QuantizeLinear then needs no zero point: see ``_Lowering.float8_qdq``); ValueError naming the
    layer when ``requested`` is too old for one of them."""
    needed, why = _required_opset(model)
    if requested is None:
        float8_inputs = any(slot.tensor is None and q.spec.dtype in _FLOAT8 for _, slot, q, _, _ in _slots(model))  # type: ignore[attr-defined]
        return max(_DEFAULT_OPSET, needed, 21 if float8_inputs else 0)
    if requested < needed:
        raise ValueError(f"export_onnx: {why} needs opset {needed}; got opset_version={requested} (None chooses it)")
    return requested


def _has_4bit(model: nn.Module) -> bool:
    """Whether any quantizer of ``model`` is int4 / uint4."""
    return any(q.spec.dtype in (Dtype.int4, Dtype.uint4) for _, _, q, _, _ in _slots(model))  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------------------------- export
def _qdq(quantizer: nn.Module, where: str) -> QDQ:
    spec = quantizer.spec  # type: ignore[attr-defined]
    if quantizer.round_method != RoundType.half_even:  # type: ignore[attr-defined] # a baked weight's is half_even
        warnings.warn(
            f"{where}: round_method={spec.round_method.name}; ONNX QuantizeLinear rounds half to even", stacklevel=4
        )
    scale, zero_point = quantizer.calculate_qparams()  # type: ignore[attr-defined]
    qmin, qmax = _RANGES[spec.dtype]
    axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
    return QDQ(scale, zero_point, qmin, qmax, axis)


def _export_quantizer(quantizer: nn.Module, where: str, tensor: torch.Tensor | None, name: str) -> nn.Module:
    """The export form of one frozen quantizer: the codes of a weight that torch's fake-quant ops cannot express
    (StoredWeight; also a weight rounded other than half to even, which QuantizeLinear would round differently), an
    fp8 activation placeholder (Float8QDQ), else torch's fused fake quantization (QDQ)."""
    spec = quantizer.spec  # type: ignore[attr-defined]
    check_spec(spec, where, None if tensor is None else tensor.ndim)
    nearest = quantizer.round_method == RoundType.half_even  # type: ignore[attr-defined]
    if tensor is not None and (spec.dtype not in _RANGES or spec.qscheme == QSchemeType.per_group or not nearest):
        return StoredWeight(quantizer, tensor, where, name)
    if spec.dtype in _FLOAT8:
        return Float8QDQ(quantizer.calculate_qparams()[0], spec.dtype.name, name)  # type: ignore[operator]
    return _qdq(quantizer, where)


class _NoGuards(nn.Module):
    """Stands in for a captured graph's ``_guards_fn`` (torch.export's input-shape asserts) in the export copy: traced,
    each assert is a tensor turned into a Python bool (a TracerWarning per guard), and the ONNX graph holds no guard."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


def qdq_model(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` whose quantizers are in their export form; ValueError naming the first unsupported one."""
    refresh_computed_tensors(model)  # old-style weight_norm's weight: a non-leaf tensor that deepcopy refuses
    with warnings.catch_warnings():  # torch's own pickling of a captured graph's pytree specs (torch >= 2.10)
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        export = copy.deepcopy(model)
    store_computed_tensors(export)  # weight_norm's weight: stored as the model computes it now, not recomputed
    export = ModelQuantizer.freeze(export).eval()
    functional = _functional_weights(export)
    for layer, slot, q, where, name in _slots(export):
        tensor = _slot_tensor(layer, slot, functional)
        q = (
            stored_quantizer(tensor, q) if tensor is not None else q if bool(q.fake_quant_enabled) else None
        )  # fake quant off: float
        layer.set_quantizer(slot, None if q is None else _export_quantizer(q, where, tensor, name))
    guarded = [m for m in export.modules() if isinstance(getattr(m, EXPORT_GUARDS_ATTR, None), nn.Module)]
    for module in guarded:
        setattr(module, EXPORT_GUARDS_ATTR, _NoGuards())
    return export


_HALF = (torch.float16, torch.bfloat16)
_SDPA_GQA_ARG = 7  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class _SdpaWithoutGqa(torch.overrides.TorchFunctionMode):
    """Grouped-query attention (``scaled_dot_product_attention(..., enable_gqa=True)``, as Hugging Face's LLaMA,
    Mistral or Qwen2 call it with fewer key/value heads) written as the key/value heads repeated for their query heads,
    torch's own definition of it: the TorchScript ONNX exporter has no conversion for ``enable_gqa``."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            args = list(args)  # type: ignore[assignment]
            gqa = args.pop(_SDPA_GQA_ARG) if len(args) > _SDPA_GQA_ARG else kwargs.pop("enable_gqa", False)  # type: ignore[attr-defined]
            if gqa:
                query, key, value = args[:3]
                repeat = query.size(-3) // key.size(-3)
                args[1:3] = [key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)]  # type: ignore[index]
        return func(*args, **kwargs)


def _in_float32(export: nn.Module, args: tuple[Any, ...]) -> tuple[nn.Module, tuple[Any, ...]]:
    """A float16 / bfloat16 model (or input) as a float32 graph, with a warning: ONNX's QuantizeLinear takes a float32
    input in onnxruntime, and the export's dequantized weights are float32. The integer codes and scales are the
    same; the graph computes in float32."""
    tensors = [*export.parameters(), *export.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    half = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype in _HALF})
    if not half:
        return export, args
    warnings.warn(
        f"export_onnx: the model or its example input is {' / '.join(half)}; the ONNX graph is written in float32 "
        "(onnxruntime's QuantizeLinear takes float32): the same integer codes and scales, float32 inputs, outputs "
        "and arithmetic between the Q/DQ pairs",
        stacklevel=3,
    )
    cast = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in _HALF else a for a in args)
    return export.float(), cast


class _FirstOutput(nn.Module):
    """A Hugging Face model as its first output (``logits`` of a causal LM, a classifier's scores): the TorchScript
    exporter takes tensors, not a ``ModelOutput`` holding a ``DynamicCache``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.model(*args)
        return out[0] if isinstance(out, tuple | dict) or hasattr(out, "to_tuple") else out


def export_onnx(
    model: nn.Module,
    output_dir: str | Path,
    input_args: Any,
    opset_version: int | None = None,
    input_names: list[str] | None = None,
    output_names: list[str] | None = None,
    verbose: bool = False,
    do_constant_folding: bool = True,
    operator_export_type: Any = None,
    uint4_int4_flag: bool = False,
    dynamo: bool = False,
    *,
    filename: str = FILENAME,
    dynamic_batch: bool = True,
) -> Path:
    """Write ``model`` (prepared and calibrated, or frozen; not modified) as an ONNX QDQ graph,
    ``<output_dir>/quark_model.onnx`` as amd-quark names it; returns the path.

    The positional parameters are amd-quark 0.13's, so its calls run unchanged. ``input_args`` is an example input
    tensor (or a tuple of them). ``opset_version`` None means 17, raised to what the quantizers need: 21 with int4 /
    uint4 or per-group weights or fp8 activations, 19 with fp8 weights only; a lower explicit one is refused naming
    the layer. ``input_names`` /
    ``output_names`` name the graph's inputs and outputs (default ``input`` / ``input_i``, ``output``). The batch
    dimension is dynamic by default. 4-bit weights are always written as INT4 / UINT4; amd-quark's
    ``uint4_int4_flag=True`` (it declares a 4-bit model) is accepted and checked: ValueError when no quantizer is
    int4 / uint4. ``dynamo=True`` is refused with the reason, and ``operator_export_type`` must stay the default ONNX
    one. The write is atomic (a temporary file renamed)."""
    if dynamo:
        raise ValueError(
            "export_onnx: dynamo=True is not supported; the Q/DQ folding here works on the TorchScript exporter's graph"
        )
    if operator_export_type not in (None, torch.onnx.OperatorExportTypes.ONNX):
        raise ValueError(f"export_onnx: operator_export_type={operator_export_type!r}; only OperatorExportTypes.ONNX")
    import_extra("onnx", "export", "ONNX export")  # the exporter needs it
    opset = _export_opset(opset_version, model)
    if uint4_int4_flag and not _has_4bit(model):
        raise ValueError(
            "export_onnx: uint4_int4_flag=True declares an int4/uint4 model, but no quantizer is int4 or uint4 "
            "(4-bit weights are written as INT4/UINT4 without the flag; leave it False for this model)"
        )
    export = qdq_model(model)
    placeholders = any(isinstance(m, StoredWeight | Float8QDQ) for m in export.modules())
    args = input_args if isinstance(input_args, tuple) else (input_args,)
    export, args = _in_float32(export, args)
    if type(export).__module__.startswith("transformers."):
        export = _FirstOutput(
            export
        )  # a Hugging Face model returns a ModelOutput (and a KV cache): the graph its logits
    names = list(input_names) if input_names else [f"input_{i}" if len(args) > 1 else "input" for i in range(len(args))]
    outputs = list(output_names) if output_names else ["output"]
    axes = {n: {0: "batch"} for n in [*names, *outputs]} if dynamic_batch else None

    def write(tmp: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter writes Q/DQ for these ops
            with _SdpaWithoutGqa():
                torch.onnx.export(
                    export,
                    args,
                    tmp,
                    dynamo=False,
                    opset_version=min(opset, _TORCHSCRIPT_MAX_OPSET),
                    input_names=names,
                    output_names=outputs,
                    dynamic_axes=axes,
                    verbose=verbose,
                    do_constant_folding=do_constant_folding,
                )
        fold_weight_quantization(tmp)
        if placeholders or opset > _TORCHSCRIPT_MAX_OPSET:
            lower_placeholders(tmp, opset)
        warn_onnxruntime_rewrites(tmp, Path(output_dir) / filename)

    return write_atomically(output_dir, filename, write)


def _subgraph_inputs(node: Any) -> set[str]:
    """Names read inside a node's subgraphs (If / Loop / Scan bodies), which count as uses of outer values."""
    import onnx

    names: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            for inner in g.node:
                names.update(inner.input)
                names |= _subgraph_inputs(inner)
    return names


def _constant_value(node: Any) -> Any:
    """The value of a ``Constant`` node as a numpy array (None for a sparse constant)."""
    import numpy as np
    from onnx import helper, numpy_helper

    attr = node.attribute[0]
    if attr.name == "value":
        return numpy_helper.to_array(attr.t)
    value = helper.get_attribute_value(attr)
    if attr.name in ("value_float", "value_floats"):
        return np.asarray(value, dtype=np.float32)
    if attr.name in ("value_int", "value_ints"):
        return np.asarray(value, dtype=np.int64)
    return None


class _Constants:
    """The constant values of a graph by name: initializers and ``Constant`` nodes, followed back through ``Identity``
    nodes (the TorchScript exporter merges initializers of equal value and routes the copies through them)."""

    def __init__(self, graph: Any) -> None:
        self.inits = {i.name: i for i in graph.initializer}
        self.producers = {out: n for n in graph.node for out in n.output}

    def source(self, name: str) -> str:
        """``name`` followed back through Identity nodes."""
        seen = set()
        while name not in self.inits and name not in seen:
            seen.add(name)
            node = self.producers.get(name)
            if node is None or node.op_type != "Identity":
                break
            name = node.input[0]
        return name

    def value(self, name: str) -> Any:
        """The constant value behind ``name`` (initializer or Constant, through Identity) as numpy, else None."""
        from onnx import numpy_helper

        name = self.source(name)
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.producers.get(name)
        return _constant_value(node) if node is not None and node.op_type == "Constant" else None


def _drop_unused(graph: Any, sources: set[str]) -> None:
    """Remove the Identity / Constant nodes nobody reads (repeatedly), then the initializers (and graph inputs) among
    ``sources`` nobody reads any more."""
    graph_outputs = {o.name for o in graph.output}
    while True:
        used = {i for n in graph.node for i in n.input} | graph_outputs
        for n in graph.node:
            used |= _subgraph_inputs(n)
        dead = [n for n in graph.node if n.op_type in ("Identity", "Constant") and not any(o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for init in list(graph.initializer):
        if init.name in sources and init.name not in used:
            graph.initializer.remove(init)
    for value in list(graph.input):
        if value.name in sources and value.name not in used:
            graph.input.remove(value)


def fold_weight_quantization(path: str | Path) -> int:
    """Store weights as integers: every QuantizeLinear whose input is a constant float tensor (an initializer or a
    ``Constant``, directly or through ``Identity`` nodes) becomes an int8/uint8 initializer (codes
    ``clamp(round(w * (1/scale)) + zp)``, as the fake-quant model rounds) that its DequantizeLinear reads.

    The TorchScript exporter merges initializers of equal value (the zero points of two layers of one width, the
    scales of layers with equal ranges, equal weights) and routes the copies through ``Identity`` nodes; scales,
    zero points and weights are resolved through those chains. A weight initializer read by other nodes too (a
    shared weight) stays; one no longer read is removed, with the ``Identity`` nodes that only fed it. Two
    QuantizeLinear nodes of one weight with equal qparams share one integer initializer. Rewrites the file in
    place; returns how many QuantizeLinear nodes were folded."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    consts = _Constants(graph)
    taken = set(consts.inits) | set(consts.producers) | {i.name for i in graph.input}
    graph_outputs = {o.name for o in graph.output}
    folded_inits: dict[tuple[Any, ...], str] = {}
    replaced: dict[str, str] = {}  # QuantizeLinear output -> integer initializer
    sources: set[str] = set()
    removed = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.output[0] in graph_outputs:
            continue
        w = consts.value(node.input[0])
        if w is None or not np.issubdtype(w.dtype, np.floating):
            continue  # an activation: quantized at run time
        scale = consts.value(node.input[1])
        zp = consts.value(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), dtype=np.uint8)
        if scale is None or zp is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        source = consts.source
        key = (source(node.input[0]), source(node.input[1]), source(node.input[2]) if len(node.input) > 2 else "", axis)
        if key not in folded_inits:
            w, scale = w.astype(np.float32), scale.astype(np.float32)
            if scale.ndim == 1 and scale.size > 1:  # per channel along ``axis``
                shape = [1] * w.ndim
                shape[axis % w.ndim] = -1
                scale, zp_b = scale.reshape(shape), zp.reshape(shape).astype(np.float32)
            else:
                zp_b = zp.astype(np.float32)
            info = np.iinfo(zp.dtype)
            codes = np.clip(np.rint(w * (np.float32(1.0) / scale)) + zp_b, info.min, info.max).astype(zp.dtype)
            name = _unique(key[0] + "_quantized", taken)
            graph.initializer.append(numpy_helper.from_array(codes, name))
            folded_inits[key] = name
        replaced[node.output[0]] = folded_inits[key]
        sources.add(key[0])
        removed.append(node)
    for node in removed:
        graph.node.remove(node)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in replaced:
                node.input[i] = replaced[name]
    _drop_unused(graph, sources)  # what only fed the folded weights: Identity / Constant nodes, float initializers
    onnx.save(model, str(path))
    return len(removed)


#: how to run an exported graph in onnxruntime as it is written (named by the warning and the README)
ORT_EXACT_OPTIONS = (
    'sess_options.add_session_config_entry("session.disable_quant_qdq", "1") (all of its QDQ rewrites off; the graph '
    'runs as written, in float), or InferenceSession(path, sess_options, disabled_optimizers=["WeightBiasQuantization"])'
)


def _feeds_quantize(node: Any, consumers: dict[str, list[Any]]) -> bool:
    """``node``'s output reaches a QuantizeLinear without branching, through Relu / Clip at most (onnxruntime's
    condition for its weight / bias quantization of a Conv or Gemm)."""
    while len(node.output) == 1 and len(consumers.get(node.output[0], [])) == 1:
        node = consumers[node.output[0]][0]
        if node.op_type == "QuantizeLinear":
            return True
        if node.op_type not in ("Relu", "Clip"):
            return False
    return False


def _rewritten_by_onnxruntime(node: Any, consts: _Constants, consumers: dict[str, list[Any]]) -> str | None:
    """What onnxruntime's WeightBiasQuantization (graph optimization level BASIC and up, so by default) changes in
    Conv / ConvTranspose / Gemm ``node``: it quantizes a float weight to int8 per tensor, and a float bias to int32
    ``round(bias / (input scale * weight scale))``; None when it leaves the node alone or the result is the same."""
    import numpy as np

    if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or not _feeds_quantize(node, consumers):
        return None
    source, weight = consts.producers.get(node.input[0]), consts.producers.get(node.input[1])
    x_scale = consts.value(source.input[1]) if source is not None and source.op_type == "DequantizeLinear" else None
    if x_scale is None or x_scale.size != 1:
        return None  # its input is not dequantized with one scale: left alone
    if weight is None or weight.op_type != "DequantizeLinear":
        value = consts.value(node.input[1])
        return (
            "its float weight quantized to int8 per tensor" if value is not None and value.dtype == np.float32 else None
        )
    bias = consts.value(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    w_scale = consts.value(weight.input[1])
    if bias is None or bias.ndim != 1 or w_scale is None or w_scale.size not in (1, bias.size):
        return None
    attrs = {a.name: a.i for a in weight.attribute}
    transposed = next((a.i for a in node.attribute if a.name == "transB"), 0)
    if w_scale.size > 1 and (
        attrs.get("block_size", 0) or attrs.get("axis", 1) != (1 - transposed if node.op_type == "Gemm" else 0)
    ):
        return None
    step = np.float32(x_scale.reshape(())) * w_scale.astype(np.float32).reshape(-1)
    rounded = np.rint(bias.astype(np.float32) / step) * step
    return (
        None if np.array_equal(rounded, bias) else "its bias rounded to int32 multiples of input scale x weight scale"
    )


def warn_onnxruntime_rewrites(path: str | Path, label: str | Path | None = None) -> list[str]:
    """Warn once, naming the nodes, where onnxruntime's default graph optimizations change what the graph at
    ``path`` (called ``label`` in the message) computes, so its integer codes can differ from the quantized model's,
    and the session options that run the graph as written. Returns the nodes named."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    consts = _Constants(graph)
    consumers: dict[str, list[Any]] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    changed = {n.name: why for n in graph.node if (why := _rewritten_by_onnxruntime(n, consts, consumers)) is not None}
    if changed:
        shown = "; ".join(f"{name} ({why})" for name, why in list(changed.items())[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        warnings.warn(
            f"{label or path}: onnxruntime's default graph optimizations (WeightBiasQuantization, level BASIC and up) "
            f"change what {len(changed)} node(s) compute: {shown}{more}; its integer codes can then differ from the "
            f"quantized model's. To run the graph as written, create the session with {ORT_EXACT_OPTIONS}",
            stacklevel=3,
        )
    return list(changed)


def _unique(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... : the first not in ``taken`` (which it joins)."""
    found, k = name, 1
    while found in taken:
        found, k = f"{name}_{k}", k + 1
    taken.add(found)
    return found


# ----------------------------------------------------------------------------------------------- lowering
def _typed_initializer(values: Any, onnx_type: str, name: str) -> Any:
    """``values`` (integer codes, or fp8 bit patterns as uint8; numpy) as an initializer of ONNX type ``onnx_type``:
    4-bit codes packed two to a byte, low nibble first (ONNX's layout), the others one byte each."""
    import numpy as np
    from onnx import TensorProto, helper

    values = np.array(values, order="C")  # (ascontiguousarray would make a scalar 1-D)
    if onnx_type in ("INT4", "UINT4"):
        raw = pack_nibbles(torch.from_numpy(values)).numpy().tobytes()
    else:
        raw = values.tobytes()
    return helper.make_tensor(name, getattr(TensorProto, onnx_type), list(values.shape), raw, raw=True)


class _Lowering:
    """Replaces the placeholder nodes of one graph of ``opset`` by standard ones, creating each typed initializer once
    (placeholders reading one merged constant share it)."""

    def __init__(self, graph: Any, opset: int) -> None:
        self.graph, self.opset = graph, opset
        self.consts = _Constants(graph)
        self.taken = set(self.consts.inits) | set(self.consts.producers) | {i.name for i in graph.input}
        self.made: dict[tuple[str, str], str] = {}  # (source constant, ONNX type) -> typed initializer
        self.sources: set[str] = set()  # the byte containers the typed initializers replace
        self.float8_inputs: dict[str, str] = {}  # fp8 DequantizeLinear output -> its scale

    def typed(self, name: str, onnx_type: str, new_name: str) -> str:
        """The initializer holding constant ``name``'s values as ``onnx_type``."""
        key = (self.consts.source(name), onnx_type)
        if key not in self.made:
            self.made[key] = _unique(new_name, self.taken)
            self.graph.initializer.append(_typed_initializer(self.consts.value(name), onnx_type, self.made[key]))
        self.sources.add(key[0])
        return self.made[key]

    def float8_zero(self, onnx_type: str) -> str:
        """A scalar zero of fp8 type ``onnx_type`` (the zero point that makes QuantizeLinear produce fp8)."""
        import numpy as np

        key = ("", onnx_type)
        if key not in self.made:
            self.made[key] = _unique(f"{onnx_type.lower()}_zero_point", self.taken)
            self.graph.initializer.append(_typed_initializer(np.zeros((), np.uint8), onnx_type, self.made[key]))
        return self.made[key]

    def lower(self, node: Any) -> list[Any]:
        """The standard nodes that compute what placeholder ``node`` computes."""
        from onnx import helper

        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        dtype, name = Dtype(attrs["fmt"].decode()), attrs["name"].decode()
        onnx_type = _STORED_INTS.get(dtype) or _FLOAT8[dtype]
        if node.op_type == "QuantizeDequantize":
            return self.float8_qdq(node, name, onnx_type)
        codes = self.typed(node.input[0], onnx_type, f"{name}_quantized")
        inputs = [codes, node.input[1]]
        zero_point = self.consts.value(node.input[2])
        if dtype not in _FLOAT8 and zero_point.any():
            inputs.append(self.typed(node.input[2], onnx_type, f"{name}_zero_point"))
        else:
            self.sources.add(self.consts.source(node.input[2]))
        extra = {"axis": attrs["axis"]} if "axis" in attrs else {}
        if attrs["block_size"]:
            extra["block_size"] = attrs["block_size"]
        return [helper.make_node("DequantizeLinear", inputs, list(node.output), name=node.name, **extra)]

    def float8_qdq(self, node: Any, name: str, onnx_type: str) -> list[Any]:
        """QuantizeLinear + DequantizeLinear to fp8. From opset 21 the type is QuantizeLinear's ``output_dtype`` and no
        zero point is written: onnxruntime (1.32 and before) drops a Relu that feeds a QuantizeLinear whose zero
        point is not int8 / uint8 (ReluQuantRewrite, graph optimization level EXTENDED and up), a wrong result for
        fp8. Opsets 19 and 20 have only the FLOAT8 zero point; a Relu before it is warned about."""
        from onnx import TensorProto, helper

        x, scale = node.input[0], node.input[1]
        q = _unique(f"{name}_quantized", self.taken)
        self.float8_inputs[node.output[0]] = scale
        if self.opset >= 21:
            return [
                helper.make_node(
                    "QuantizeLinear",
                    [x, scale],
                    [q],
                    name=f"{node.name}_q",
                    output_dtype=getattr(TensorProto, onnx_type),
                ),
                helper.make_node("DequantizeLinear", [q, scale], list(node.output), name=f"{node.name}_dq"),
            ]
        producer = self.consts.producers.get(x)
        if producer is not None and producer.op_type == "Relu":
            warnings.warn(
                f"{name}: at opset {self.opset} an fp8 QuantizeLinear needs a FLOAT8 zero point, and onnxruntime at graph "
                "optimization level EXTENDED or higher removes the Relu before it (ReluQuantRewrite). Export at opset 21 "
                "(the default), or run with disabled_optimizers=['ReluQuantRewrite']",
                stacklevel=2,
            )
        zero = self.float8_zero(onnx_type)
        return [
            helper.make_node("QuantizeLinear", [x, scale, zero], [q], name=f"{node.name}_q"),
            helper.make_node("DequantizeLinear", [q, scale, zero], list(node.output), name=f"{node.name}_dq"),
        ]

    def warn_bias_overflow(self) -> None:
        """Warn where onnxruntime would wrap a bias around: its WeightBiasQuantization (optimization level BASIC and up)
        rewrites the float bias of a Conv / Gemm between Q/DQ as int32 ``round(bias / (input scale * weight scale))``
        with no range check, and fp8's small scales can take that quotient past 2^31."""
        import numpy as np

        producers = {o: n for n in self.graph.node for o in n.output}
        for node in self.graph.node:
            if node.op_type not in ("Conv", "ConvTranspose", "Gemm") or len(node.input) < 3:
                continue
            weight = producers.get(node.input[1])
            if node.input[0] not in self.float8_inputs or weight is None or weight.op_type != "DequantizeLinear":
                continue
            bias, x_scale = self.consts.value(node.input[2]), self.consts.value(self.float8_inputs[node.input[0]])
            w_scale = self.consts.value(weight.input[1])
            if bias is None or x_scale is None or w_scale is None or w_scale.size not in (1, bias.size):
                continue
            ratio = float(np.max(np.abs(bias) / (np.float64(x_scale) * np.asarray(w_scale, np.float64).reshape(-1))))
            if ratio >= 2**31:
                warnings.warn(
                    f"{node.name}: onnxruntime's WeightBiasQuantization (graph optimization level BASIC and up) stores this "
                    f"bias as int32 bias / (input scale * weight scale), here up to {ratio:.3g}, past the int32 range: "
                    "the bias comes out wrong. Run the model with disabled_optimizers=['WeightBiasQuantization']",
                    stacklevel=2,
                )


def lower_placeholders(path: str | Path, opset: int) -> int:
    """Make the exported file standard ONNX of ``opset``: convert the graph when the exporter wrote an older opset
    (before any 4-bit / fp8 type enters it), replace every ``quark.lowbit`` placeholder by DequantizeLinear of typed
    codes (weights) or QuantizeLinear + DequantizeLinear with an fp8 zero point (activations), drop the byte
    containers nothing reads any more, and check the model. Rewrites the file in place; returns how many
    placeholders were replaced."""
    import onnx
    from onnx import helper, version_converter

    model = onnx.load(str(path))
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if current < opset:
        model = version_converter.convert_version(model, opset)
    graph = model.graph
    lowering = _Lowering(graph, opset)
    nodes, count = [], 0
    for node in graph.node:
        if node.domain == _DOMAIN:
            nodes.extend(lowering.lower(node))
            count += 1
        else:
            kept = onnx.NodeProto()
            kept.CopyFrom(node)
            nodes.append(kept)
    graph.ClearField("node")
    graph.node.extend(nodes)
    imports = [o for o in model.opset_import if o.domain != _DOMAIN]
    model.ClearField("opset_import")
    model.opset_import.extend(imports)
    _drop_unused(graph, lowering.sources)
    lowering.warn_bias_overflow()
    model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import)))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return count
