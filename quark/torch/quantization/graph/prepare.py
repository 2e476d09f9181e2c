"""Quantizer placement on a captured graph (``quant_mode=fx_graph_mode``).

Per compute op (conv, linear, matmul/bmm, embedding) the Config resolves like eager mode, keyed by the original
module's name (``blocks.0.c1``) and class name, with ``exclude``. Then:
- conv [+ BatchNorm] [+ ReLU/ReLU6/clamp] is one unit: a quantized twin at the conv's module path (same Parameters,
  same state_dict keys as eager mode; BatchNorm folding simulated, see ``QuantConvBn2d``), no quantizer inside it;
- every activation tensor is quantized once, right after its producer, and all its consumers read that node;
  a consumer whose spec differs gets its own re-quantization;
- add, mul, cat, mean and average pooling have quantized inputs and a quantized output (after a ReLU that follows
  them); cat inputs share one quantizer for per-tensor integer formats, so the concatenation is exact in integers;
- max pooling and layout ops keep their input's grid: where their output feeds a quantized op it is quantized again
  with the same qparams (a ``SharedFakeQuantize``), which is what integer runtimes expect around them.

The units (resolution, fusion, checks) are found in ``units``, the graph is rewritten by ``insert`` (twins swapped in,
quantizers placed) and what stays float is reported by ``float_layers``; this module runs them in order.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import torch
from torch import fx, nn

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.graph.capture import GraphModeError, module_path, normalize
from quark.torch.quantization.graph.float_layers import find_data_path, graph_float_layers
from quark.torch.quantization.graph.insert import (
    QUANTIZERS,
    Placer,
    functional_weights,
    on_graph_device,
    per_tensor_static,
    swap_unit,
)
from quark.torch.quantization.graph.loss import carry_hf_attributes
from quark.torch.quantization.graph.rules import kind_of
from quark.torch.quantization.graph.units import (
    GraphUnit,
    UnitPlan,
    check_rules,
    check_unit,
    find_units,
    resolve_node,
    single_user,
)
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin
from quark.torch.quantization.state import ensure_quant_state

__all__ = ["prepare_graph", "GraphUnit", "QUANTIZERS", "UnitPlan", "resolve_node"]


def prepare_graph(graph_module: fx.GraphModule, config: Config, name_prefix: str = "") -> fx.GraphModule:
    """A quantized copy of ``graph_module`` (same Parameter and buffer objects, new graph and containers): units
    swapped for twins, activation quantizers inserted. The input graph is left as it was."""
    memo = {id(t): t for t in itertools.chain(graph_module.parameters(), graph_module.buffers())}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's pytree spec deprecation inside deepcopy
        gm = copy.deepcopy(graph_module, memo)
    carry_hf_attributes(graph_module, gm)  # a captured Hugging Face model's config and loss hooks (deepcopy drops them)
    normalize(gm)
    if any(isinstance(m, QuantMixin) for m in gm.modules()):
        raise GraphModeError(
            "the graph is already prepared for quantization (it holds quantized layers); prepare a captured float graph"
        )
    check_rules(gm)
    units = find_units(gm, config, name_prefix)
    holders = nn.Module()
    gm.add_module(QUANTIZERS, holders)
    for unit in units:
        check_unit(gm, unit)
    for unit in units:
        swap_unit(gm, unit)
        functional_weights(gm, unit, holders)
    passthrough = {n for n in gm.graph.nodes if kind_of(n, gm) == "passthrough"}
    pooling = {n for n in passthrough if "max_pool" in str(n.target) or str(n.target).startswith("_dropout")}
    placer = Placer(gm, holders, passthrough)
    unit_tails = {u.tail: u for u in units}
    data_path = find_data_path(gm, {u.node for u in units})
    for node in list(gm.graph.nodes):
        kind = (
            kind_of(node, gm)
            if node.op != "call_module" or not str(node.target).startswith(QUANTIZERS)
            else "quantizer"
        )
        unit = next((u for u in units if u.node is node), None)
        if unit is not None and unit.qconfig is not None:
            if unit.op == "matmul":
                for arg in node.args[:2]:
                    if isinstance(arg, fx.Node) and arg.op != "get_attr" and not str(arg.target).startswith(QUANTIZERS):
                        placer.need(arg, node, unit.qconfig.input_tensors)
            elif unit.op != "embedding":
                placer.need(node.args[0], node, unit.qconfig.input_tensors)
        if (
            node in unit_tails
            and unit_tails[node].qconfig is not None
            and unit_tails[node].qconfig.output_tensors is not None
        ):  # type: ignore[union-attr]
            placer.own[node] = unit_tails[node].qconfig.output_tensors  # type: ignore[union-attr]
        if kind == "quantized_output" and node in data_path:
            _quantized_output(gm, placer, node, config, name_prefix)
    placer.place(list(gm.graph.nodes), passthrough, pooling)
    on_graph_device(holders, graph_module)  # the input graph: the holders are not part of it
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm.quant_config = config
    state = ensure_quant_state(gm)
    state.graph_units = [UnitPlan(u.name, u.type_name, u.op, u.qconfig, dict(u.source)) for u in units]  # no fx nodes
    state.graph_float_layers = graph_float_layers(gm, units, config, name_prefix, data_path)
    return gm


def _quantized_output(gm: fx.GraphModule, placer: Placer, node: fx.Node, config: Config, prefix: str) -> None:
    """Add / mul / cat / mean / average pooling: quantized inputs, a quantized output (after a following ReLU)."""
    name, type_name = module_path(node)
    qconfig, _ = resolve_node(config, prefix + name, [type_name], ("input_tensors", "output_tensors"))
    if qconfig is None:
        return
    in_spec = qconfig.input_tensors
    out_spec = qconfig.output_tensors or in_spec
    if node.target is torch.ops.aten.cat.default and in_spec is not None and per_tensor_static(in_spec):
        placer.share_cat(node, in_spec)
        return
    args = node.args[0] if node.target is torch.ops.aten.cat.default else node.args[:2]
    for arg in args:  # type: ignore[union-attr]
        placer.need(arg, node, in_spec)
    tail = node
    nxt = single_user(node)
    if nxt is not None and kind_of(nxt, gm) == "activation" and nxt.args[0] is node:
        tail = nxt  # add + ReLU: one op on integer hardware
    if out_spec is not None:
        placer.own[tail] = out_spec
