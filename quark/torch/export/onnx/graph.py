"""Rewrites of a written ONNX graph: constants followed through ``Identity`` nodes (``Constants``), unused nodes and
initializers dropped, and ``fold_weight_quantization`` storing QuantizeLinear'd float weights as integers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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


class Constants:
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


def drop_unused(graph: Any, sources: set[str]) -> None:
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
    consts = Constants(graph)
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
            name = unique_name(key[0] + "_quantized", taken)
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
    drop_unused(graph, sources)  # what only fed the folded weights: Identity / Constant nodes, float initializers
    onnx.save(model, str(path))
    return len(removed)


def unique_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name_1``, ``name_2``, ... : the first not in ``taken`` (which it joins)."""
    found, k = name, 1
    while found in taken:
        found, k = f"{name}_{k}", k + 1
    taken.add(found)
    return found
