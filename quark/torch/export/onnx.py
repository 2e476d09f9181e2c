"""ONNX export as a QuantizeLinear / DequantizeLinear graph (int8 / uint8, per tensor or per channel), from the
frozen model: each quantizer becomes torch's fused fake-quant op, which the exporter writes as a Q/DQ pair."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import slot_label

FILENAME = "quark_model.onnx"  # amd-quark's name
_RANGES = {Dtype.int8: (-128, 127), Dtype.uint8: (0, 255)}


class QDQ(nn.Module):
    """One quantizer as torch's fused fake quantization (exported as QuantizeLinear + DequantizeLinear)."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, qmin: int, qmax: int, axis: int | None) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().float().reshape(-1) if axis is not None else scale.detach().float().reshape(()))
        self.register_buffer("zero_point", zero_point.detach().to(torch.int32).reshape(-1 if axis is not None else ()))
        self.qmin, self.qmax, self.axis = qmin, qmax, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis is None:
            return torch.fake_quantize_per_tensor_affine(x, float(self.scale), int(self.zero_point), self.qmin, self.qmax)
        return torch.fake_quantize_per_channel_affine(x, self.scale, self.zero_point, self.axis, self.qmin, self.qmax)


def check_spec(spec: Any, where: str) -> None:
    """ValueError unless ``spec`` is a static int8/uint8 per-tensor or per-channel format (what Q/DQ expresses)."""
    if spec.dtype not in _RANGES or spec.is_dynamic or spec.qscheme not in (QSchemeType.per_tensor, QSchemeType.per_channel):
        raise ValueError(
            f"{where}: ONNX QDQ export supports static int8/uint8 quantizers per tensor or per channel; got "
            f"{spec.dtype.name}, {spec.qscheme.name if spec.qscheme else None}{', dynamic' if spec.is_dynamic else ''}"
        )


def check_onnx_exportable(model: nn.Module) -> None:
    """Before any work: every quantizer of the prepared ``model`` must be expressible as Q/DQ (names the first that is not)."""
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            for slot, q in m.quantizer_slots():
                check_spec(q.spec, f"layer '{name}' ({slot_label(slot)})")


def _qdq(quantizer: nn.Module, where: str) -> QDQ:
    spec = quantizer.spec  # type: ignore[attr-defined]
    check_spec(spec, where)
    if spec.round_method not in (RoundType.half_even, None):
        warnings.warn(f"{where}: round_method={spec.round_method.name}; ONNX QuantizeLinear rounds half to even", stacklevel=3)
    scale, zero_point = quantizer.calculate_qparams()  # type: ignore[attr-defined]
    qmin, qmax = _RANGES[spec.dtype]
    axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
    return QDQ(scale, zero_point, qmin, qmax, axis)


def qdq_model(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` whose quantizers are QDQ modules; ValueError naming the first unsupported one."""
    export = ModelQuantizer.freeze(copy.deepcopy(model)).eval()
    for name, m in export.named_modules():
        if isinstance(m, QuantMixin):
            for slot, q in list(m.quantizer_slots()):  # every slot: layers with several weights / inputs included
                enabled = bool(q.fake_quant_enabled)
                m.set_quantizer(slot, _qdq(q, f"layer '{name}' ({slot_label(slot)})") if enabled else None)
    return export


def export_onnx(
    model: nn.Module, output_dir: str | Path, input_args: Any, opset_version: int | None = None,
    input_names: list[str] | None = None, output_names: list[str] | None = None, verbose: bool = False,
    do_constant_folding: bool = True, operator_export_type: Any = None, uint4_int4_flag: bool = False,
    dynamo: bool = False, *, filename: str = FILENAME, dynamic_batch: bool = True,
) -> Path:  # fmt: skip
    """Write ``model`` (prepared and calibrated, or frozen; not modified) as an ONNX QDQ graph,
    ``<output_dir>/quark_model.onnx`` as amd-quark names it; returns the path.

    The positional parameters are amd-quark 0.13's, so its calls run unchanged. ``input_args`` is an example input
    tensor (or a tuple of them). ``opset_version`` None means 17. ``input_names`` / ``output_names`` name the graph's
    inputs and outputs (default ``input`` / ``input_i``, ``output``). The batch dimension is dynamic by default.
    amd-quark's ``uint4_int4_flag`` (4-bit Q/DQ) and ``dynamo=True`` are refused with the reason, and
    ``operator_export_type`` must stay the default ONNX one. The write is atomic (a temporary file renamed)."""
    if uint4_int4_flag:
        raise ValueError("export_onnx: uint4_int4_flag=True (int4/uint4 Q/DQ) needs opset 21, which the TorchScript exporter used here does not write")
    if dynamo:
        raise ValueError("export_onnx: dynamo=True is not supported; the Q/DQ folding here works on the TorchScript exporter's graph")
    if operator_export_type not in (None, torch.onnx.OperatorExportTypes.ONNX):
        raise ValueError(f"export_onnx: operator_export_type={operator_export_type!r}; only OperatorExportTypes.ONNX")
    try:
        import onnx  # noqa: F401 - the exporter needs it
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("ONNX export needs `onnx`: pip install 'quark-lightning[export]'") from err
    export = qdq_model(model)
    args = input_args if isinstance(input_args, tuple) else (input_args,)
    names = list(input_names) if input_names else [f"input_{i}" if len(args) > 1 else "input" for i in range(len(args))]
    outputs = list(output_names) if output_names else ["output"]
    axes = {n: {0: "batch"} for n in [*names, *outputs]} if dynamic_batch else None

    def write(tmp: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter writes Q/DQ for these ops
            torch.onnx.export(export, args, tmp, dynamo=False, opset_version=opset_version or 17, input_names=names,
                              output_names=outputs, dynamic_axes=axes, verbose=verbose,
                              do_constant_folding=do_constant_folding)  # fmt: skip
        fold_weight_quantization(tmp)

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
    inits = {i.name: i for i in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}

    def source(name: str) -> str:
        """``name`` followed back through Identity nodes."""
        seen = set()
        while name not in inits and name not in seen:
            seen.add(name)
            node = producers.get(name)
            if node is None or node.op_type != "Identity":
                break
            name = node.input[0]
        return name

    def constant(name: str) -> Any:
        """The constant value behind ``name`` (initializer or Constant, through Identity), else None."""
        name = source(name)
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producers.get(name)
        return _constant_value(node) if node is not None and node.op_type == "Constant" else None

    taken = set(inits) | set(producers) | {i.name for i in graph.input}
    graph_outputs = {o.name for o in graph.output}
    folded_inits: dict[tuple[Any, ...], str] = {}
    replaced: dict[str, str] = {}  # QuantizeLinear output -> integer initializer
    sources: set[str] = set()
    removed = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.output[0] in graph_outputs:
            continue
        w = constant(node.input[0])
        if w is None or not np.issubdtype(w.dtype, np.floating):
            continue  # an activation: quantized at run time
        scale = constant(node.input[1])
        zp = constant(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), dtype=np.uint8)
        if scale is None or zp is None:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
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
            name, k = key[0] + "_quantized", 1
            while name in taken:
                name, k = f"{key[0]}_quantized_{k}", k + 1
            taken.add(name)
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
    # drop what only fed the folded weights: Identity / Constant nodes nobody reads, then the float initializers
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
    onnx.save(model, str(path))
    return len(removed)
