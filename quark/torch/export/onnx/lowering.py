"""``lower_placeholders``: the traced ``quark.lowbit`` placeholders replaced by standard ONNX (DequantizeLinear of
INT4 / UINT4 / INT8 / UINT8 / FLOAT8 codes, QuantizeLinear + DequantizeLinear to fp8), with the opset conversion."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from quark.torch.export.onnx.graph import Constants, drop_unused, unique_name
from quark.torch.export.onnx.specs import FLOAT8_TYPES, PLACEHOLDER_DOMAIN, STORED_INTS
from quark.torch.export.packing import pack_nibbles
from quark.torch.quantization.config.type import Dtype


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
        self.consts = Constants(graph)
        self.taken = set(self.consts.inits) | set(self.consts.producers) | {i.name for i in graph.input}
        self.made: dict[tuple[str, str], str] = {}  # (source constant, ONNX type) -> typed initializer
        self.sources: set[str] = set()  # the byte containers the typed initializers replace
        self.float8_inputs: dict[str, str] = {}  # fp8 DequantizeLinear output -> its scale

    def typed(self, name: str, onnx_type: str, new_name: str) -> str:
        """The initializer holding constant ``name``'s values as ``onnx_type``."""
        key = (self.consts.source(name), onnx_type)
        if key not in self.made:
            self.made[key] = unique_name(new_name, self.taken)
            self.graph.initializer.append(_typed_initializer(self.consts.value(name), onnx_type, self.made[key]))
        self.sources.add(key[0])
        return self.made[key]

    def float8_zero(self, onnx_type: str) -> str:
        """A scalar zero of fp8 type ``onnx_type`` (the zero point that makes QuantizeLinear produce fp8)."""
        import numpy as np

        key = ("", onnx_type)
        if key not in self.made:
            self.made[key] = unique_name(f"{onnx_type.lower()}_zero_point", self.taken)
            self.graph.initializer.append(_typed_initializer(np.zeros((), np.uint8), onnx_type, self.made[key]))
        return self.made[key]

    def lower(self, node: Any) -> list[Any]:
        """The standard nodes that compute what placeholder ``node`` computes."""
        from onnx import helper

        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        dtype, name = Dtype(attrs["fmt"].decode()), attrs["name"].decode()
        onnx_type = STORED_INTS.get(dtype) or FLOAT8_TYPES[dtype]
        if node.op_type == "QuantizeDequantize":
            return self.float8_qdq(node, name, onnx_type)
        codes = self.typed(node.input[0], onnx_type, f"{name}_quantized")
        inputs = [codes, node.input[1]]
        zero_point = self.consts.value(node.input[2])
        if dtype not in FLOAT8_TYPES and zero_point.any():
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
        q = unique_name(f"{name}_quantized", self.taken)
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
        if node.domain == PLACEHOLDER_DOMAIN:
            nodes.extend(lowering.lower(node))
            count += 1
        else:
            kept = onnx.NodeProto()
            kept.CopyFrom(node)
            nodes.append(kept)
    graph.ClearField("node")
    graph.node.extend(nodes)
    imports = [o for o in model.opset_import if o.domain != PLACEHOLDER_DOMAIN]
    model.ClearField("opset_import")
    model.opset_import.extend(imports)
    drop_unused(graph, lowering.sources)
    lowering.warn_bias_overflow()
    model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import)))
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return count
