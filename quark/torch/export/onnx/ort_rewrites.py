"""Where onnxruntime's default graph optimizations change what an exported graph computes
(``warn_onnxruntime_rewrites``), and the session options that run it as written (``ORT_EXACT_OPTIONS``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from quark.torch.export.onnx.graph import Constants

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


def _rewritten_by_onnxruntime(node: Any, consts: Constants, consumers: dict[str, list[Any]]) -> str | None:
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
    consts = Constants(graph)
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
