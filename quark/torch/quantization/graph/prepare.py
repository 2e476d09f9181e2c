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
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from quark.torch.compat import EXPORT_GUARDS_ATTR
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.coverage import FloatLayer
from quark.torch.quantization.formats import BLOCK_FORMATS, is_scaled
from quark.torch.quantization.graph.capture import EAGER_FALLBACK, GraphModeError, fetch_attr, module_path, normalize
from quark.torch.quantization.graph.loss import carry_hf_attributes
from quark.torch.quantization.graph.modules import CONV_BN, QuantActivation, QuantFunctionalWeight, SharedFakeQuantize
from quark.torch.quantization.graph.rules import (
    COMPUTE,
    computing_users,
    float_tensor,
    kind_of,
    tensor_valued,
    weighted_ops_in_body,
)
from quark.torch.quantization.nn.modules.quant_modules import QUANT_MODULE_MAP, QuantMixin
from quark.torch.quantization.resolve import LayerPlan, check_layer, excluded, merge_levels, name_levels, type_level
from quark.torch.quantization.state import quant_state
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = ["prepare_graph", "GraphUnit", "QUANTIZERS"]

#: the container of the activation quantizers in a prepared graph (its state_dict prefix)
QUANTIZERS = "_graph_quantizers"
_MODULE_TYPES = {"conv": ("Conv1d", "Conv2d", "Conv3d"), "linear": ("Linear",), "embedding": ("Embedding",)}
_EXPLICIT_ONLY_OPS = {"embedding"}


@dataclass(frozen=True)
class UnitPlan:
    """What resolution decided for one compute op (kept on the prepared graph for summaries)."""

    name: str
    type_name: str
    op: str
    qconfig: QuantizationConfig | None
    source: dict[str, str]


@dataclass
class GraphUnit:
    """A compute op and what is fused into it."""

    node: fx.Node
    op: str  # conv / linear / matmul / embedding
    name: str  # the original module's name
    type_name: str
    qconfig: QuantizationConfig | None
    source: dict[str, str] = field(default_factory=dict)
    bn: fx.Node | None = None
    act: fx.Node | None = None
    twin_path: str | None = None  # where the quantized twin lives (module-owned weights)

    @property
    def tail(self) -> fx.Node:
        """The node whose output leaves the unit."""
        return self.act or self.bn or self.node


# ----------------------------------------------------------------------------------------------- resolution
def resolve_node(
    config: Config, name: str, type_names: list[str], roles: tuple[str, ...], explicit_only: bool = False
) -> tuple[QuantizationConfig | None, dict[str, str]]:
    """The QuantizationConfig of one op: layer name (exact, then patterns) > layer type > global, combined as in
    eager mode (``merge_levels``, the levels of ``resolve``); None when excluded or nothing applies."""
    if excluded(config, name):
        return None, {}
    levels = name_levels(config, name) + type_level(config, type_names)
    if explicit_only and not levels:
        return None, {}
    levels.append(("global", config.global_quant_config))
    return merge_levels(levels, roles, config.inherit_roles)


# ----------------------------------------------------------------------------------------------- helpers
def _arg(node: fx.Node, index: int, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(_ARG_NAMES.get(index, ""), default)


_ARG_NAMES = {3: "stride", 4: "padding", 5: "dilation", 6: "groups"}


def _hyper(value: Any) -> Any:
    """A conv hyper-parameter from the graph (an int, a "same"/"valid" string, or a list) as nn.Conv takes it."""
    return value if isinstance(value, str | int) else tuple(value)


def _float_module(gm: fx.GraphModule, unit: GraphUnit) -> nn.Module:
    """The float layer a compute node computes, rebuilt around the graph's Parameter objects."""
    node = unit.node
    if unit.op == "embedding":
        weight = fetch_attr(gm, node.args[0])
        padding_idx = _arg(node, 2, -1)
        layer = nn.Embedding(
            weight.shape[0], weight.shape[1], padding_idx=None if padding_idx == -1 else padding_idx, device="meta"
        )
        layer.weight = weight
        return layer
    weight, bias = fetch_attr(gm, node.args[1]), fetch_attr(gm, _arg(node, 2, None))
    if unit.op == "linear":
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    else:
        groups = int(_arg(node, 6, 1))
        layer = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[weight.ndim - 3](
            weight.shape[1] * groups,
            weight.shape[0],
            tuple(weight.shape[2:]),
            stride=_hyper(_arg(node, 3, 1)),
            padding=_hyper(_arg(node, 4, 0)),
            dilation=_hyper(_arg(node, 5, 1)),
            groups=groups,
            bias=bias is not None,
            device="meta",
        )
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


def _module_owned(gm: fx.GraphModule, unit: GraphUnit) -> str | None:
    """The path of the nn.Conv/Linear/Embedding whose own forward is this op (its weight is ``<path>.weight``)."""
    weight_arg = unit.node.args[0 if unit.op == "embedding" else 1]
    if not isinstance(weight_arg, fx.Node) or weight_arg.op != "get_attr":
        return None
    owner, _, attr = str(weight_arg.target).rpartition(".")
    if attr != "weight" or owner != unit.name or unit.type_name not in _MODULE_TYPES.get(unit.op, ()):
        return None
    if not isinstance(fetch_attr(gm, weight_arg), nn.Parameter):
        return None
    return owner


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _bn_calls(gm: fx.GraphModule) -> Counter[str]:
    """How often each module is called by the graph (a BatchNorm called twice is not folded)."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")


def _check_rules(gm: fx.GraphModule) -> None:
    """GraphModeError naming every op without a rule (before anything changes)."""
    missing = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) == EXPORT_GUARDS_ATTR:
            continue
        if kind_of(node, gm) in (None, "module"):
            path, type_name = module_path(node)
            inside = weighted_ops_in_body(node, gm)
            why = f", whose body has weighted ops that would stay float: {inside}" if inside else ""
            missing.append(
                f"{node.target} (node '{node.name}' in {f'{path!r} ({type_name})' if path else 'the top-level forward'}{why})"
            )
    if missing:
        raise GraphModeError(
            f"quant_mode=fx_graph_mode has no quantization rule for {len(missing)} op(s): {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}. {EAGER_FALLBACK}."
        )


# ----------------------------------------------------------------------------------------------- units
def _find_units(gm: fx.GraphModule, config: Config, prefix: str) -> list[GraphUnit]:
    bn_calls = _bn_calls(gm)
    units = []
    for node in gm.graph.nodes:
        if kind_of(node, gm) != "compute":
            continue
        op = COMPUTE[node.target]
        name, type_name = module_path(node)
        roles = {
            "embedding": ("weight", "output_tensors"),
            "matmul": ("input_tensors", "output_tensors", "weight"),
        }.get(op, QuantizationConfig.ROLES)
        types = [type_name, *_MODULE_TYPES.get(op, ())]
        qconfig, source = resolve_node(config, prefix + name, types, roles, explicit_only=op in _EXPLICIT_ONLY_OPS)
        unit = GraphUnit(node, op, name, type_name, qconfig, source)
        tail = node
        nxt = _single_user(node)
        if op == "conv" and nxt is not None and kind_of(nxt, gm) == "batch_norm" and nxt.args[0] is node:
            bn = gm.get_submodule(str(nxt.target))
            if bn.track_running_stats and bn_calls.get(str(nxt.target)) == 1:  # type: ignore[union-attr]
                unit.bn, tail = nxt, nxt
        nxt = _single_user(tail)
        if op in ("conv", "linear") and nxt is not None and kind_of(nxt, gm) == "activation" and nxt.args[0] is tail:
            unit.act = nxt
        unit.twin_path = _module_owned(gm, unit) if op != "matmul" else None
        units.append(unit)
    return units


def _swap_unit(gm: fx.GraphModule, unit: GraphUnit) -> None:
    """Replace the compute node (and its BatchNorm) by a call of the quantized twin at the module's path."""
    if unit.twin_path is None or unit.qconfig is None or not (unit.qconfig.weight or unit.qconfig.bias or unit.bn):
        return
    float_layer = _float_module(gm, unit)
    params = QuantizationConfig(
        weight=unit.qconfig.weight, bias=unit.qconfig.bias, target_device=unit.qconfig.target_device
    )
    where = f"layer '{unit.name}' ({type(float_layer).__name__}{' + BatchNorm' if unit.bn else ''}"
    if unit.bn is not None:
        bn = gm.get_submodule(str(unit.bn.target))
        twin = CONV_BN[type(float_layer)].from_conv_bn(float_layer, bn, params)  # type: ignore[arg-type]
    else:
        twin = QUANT_MODULE_MAP[type(float_layer)].from_float(float_layer, params)
    for slot, q in twin.quantizer_slots():
        q.where = f"{where}, {slot.role})"
    parent, _, attr = unit.twin_path.rpartition(".")
    setattr(gm.get_submodule(parent), attr, twin)
    graph = gm.graph
    inputs = (unit.node.args[1],) if unit.op == "embedding" else (unit.node.args[0],)
    with graph.inserting_before(unit.node):
        call = graph.call_module(unit.twin_path, inputs)
    last = unit.bn or unit.node
    call.meta = dict(last.meta)
    last.replace_all_uses_with(call)
    if unit.bn is not None:
        graph.erase_node(unit.bn)
    graph.erase_node(unit.node)
    unit.node, unit.bn = call, None


def _functional_weights(gm: fx.GraphModule, unit: GraphUnit, holders: nn.Module) -> None:
    """Weight quantizers as graph nodes for weights an op reads that no twin holds (F.linear inside a custom module,
    ``x @ self.w``): the Parameter read is fake-quantized before the op."""
    if unit.qconfig is None or unit.qconfig.weight is None or unit.node.op == "call_module":
        return
    positions = (0, 1) if unit.op == "matmul" else ((0,) if unit.op == "embedding" else (1,))
    for i in positions:
        arg = unit.node.args[i]
        if not isinstance(arg, fx.Node) or (unit.op == "matmul" and arg.op != "get_attr"):
            continue
        holder = QuantFunctionalWeight.from_float(nn.Identity(), QuantizationConfig(weight=unit.qconfig.weight))
        holder._weight_quantizer.where = (
            f"layer '{unit.name}' ({unit.type_name}, weight '{arg.target}' used by {unit.node.target})"  # type: ignore[union-attr]
        )
        name = f"{arg.name}_{unit.node.name}"
        holders.add_module(name, holder)
        with gm.graph.inserting_before(unit.node):
            call = gm.graph.call_module(f"{QUANTIZERS}.{name}", (arg,))
        call.meta = dict(arg.meta)
        unit.node.replace_input_with(arg, call)


# ----------------------------------------------------------------------------------------------- activations
def _per_tensor_static(spec: QuantizationSpec) -> bool:
    return (
        spec.qscheme == QSchemeType.per_tensor
        and not spec.is_dynamic
        and is_scaled(spec.dtype)
        and spec.dtype not in BLOCK_FORMATS
    )


class _Placer:
    """Puts the activation quantizers into the graph, one per tensor (and spec)."""

    def __init__(self, gm: fx.GraphModule, holders: nn.Module, passthrough: set[fx.Node]) -> None:
        self.gm, self.graph, self.holders, self.passthrough = gm, gm.graph, holders, passthrough
        self.needs: dict[fx.Node, list[tuple[fx.Node, QuantizationSpec]]] = {}
        self.own: dict[fx.Node, QuantizationSpec] = {}
        self.grid: dict[fx.Node, FakeQuantizeBase] = {}  # node -> the quantizer whose grid its values are on

    def need(self, producer: Any, consumer: fx.Node, spec: QuantizationSpec | None) -> None:
        """``consumer`` reads ``producer`` quantized by ``spec``. Through max-pool and layout ops the need goes back
        to the op that computed the values (quantized once, there; the pass-through op keeps its grid)."""
        if spec is None or not float_tensor(producer):
            return
        self.needs.setdefault(producer, []).append((consumer, spec))
        if (
            producer in self.passthrough
            and _per_tensor_static(spec)
            and producer.args
            and float_tensor(producer.args[0])
        ):
            self.need(producer.args[0], producer, spec)

    def _holder(
        self, name: str, spec: QuantizationSpec | None, where: str, quantizer: FakeQuantizeBase | None = None
    ) -> str:
        holder = QuantActivation.from_float(nn.Identity(), QuantizationConfig(output_tensors=spec))
        if quantizer is not None:
            holder.set_quantizer(holder.quant_slots[0], quantizer)
        holder._output_quantizer.where = where  # type: ignore[union-attr]
        base, k = name, 1
        while hasattr(self.holders, name):
            name, k = f"{base}_{k}", k + 1
        self.holders.add_module(name, holder)
        return f"{QUANTIZERS}.{name}"

    def _insert_after(self, node: fx.Node, target: str) -> fx.Node:
        anchor = node
        if node.op == "placeholder":  # after every placeholder: graph inputs come first
            anchor = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(anchor):
            call = self.graph.call_module(target, (node,))
        call.meta = dict(node.meta)
        return call

    def quantize(self, node: fx.Node, spec: QuantizationSpec | None, shared: FakeQuantizeBase | None = None) -> fx.Node:
        """Insert a quantizer after ``node``; every consumer now reads it."""
        path, _ = module_path(node)
        where = f"node '{node.name}'{f' in {path!r}' if path else ''}"
        target = self._holder(node.name, spec, where, SharedFakeQuantize(shared) if shared is not None else None)
        call = self._insert_after(node, target)
        node.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
        quantizer = self.gm.get_submodule(target)._output_quantizer
        self.grid[node] = self.grid[call] = shared if shared is not None else quantizer
        return call

    def place(self, order: list[fx.Node], passthrough: set[fx.Node], pooling: set[fx.Node]) -> None:
        for node in order:
            if node.op == "output" or node.graph is not self.graph:
                continue
            source = self.grid.get(node)  # a concatenation's shared input quantizer
            if source is None and node in passthrough and node.args and isinstance(node.args[0], fx.Node):
                source = self.grid.get(node.args[0])
            if source is not None and _per_tensor_static(source.spec) and node not in self.own:
                self.grid[node] = source
            wanted = self.needs.get(node, [])
            if node in passthrough and node not in pooling and wanted and all(c in passthrough for c, _ in wanted):
                continue  # a layout op between layout ops: the grid passes through, quantized where it is read
            spec = self.own.get(node) or (wanted[0][1] if wanted else None)
            if node in self.own or wanted or (node in pooling and source is not None):
                if source is not None and node not in self.own and all(s == source.spec for _, s in wanted):
                    quantized = self.quantize(node, None, shared=source)  # same grid: the max-pool / reshape case
                elif spec is not None:
                    quantized = self.quantize(node, spec)
                else:
                    continue
                for consumer, other in wanted:  # a consumer with its own spec re-quantizes
                    if other != self.grid[node].spec:
                        where = f"input of '{consumer.name}'"
                        target = self._holder(f"{node.name}_for_{consumer.name}", other, where)
                        with self.graph.inserting_after(quantized):
                            requant = self.graph.call_module(target, (quantized,))
                        requant.meta = dict(node.meta)
                        consumer.replace_input_with(quantized, requant)

    def share_cat(self, node: fx.Node, spec: QuantizationSpec) -> None:
        """One quantizer for every input of a concatenation (its observer sees them all): the output is exact."""
        target = self._holder(f"{node.name}_inputs", spec, f"inputs of '{node.name}' (shared)")
        tensors = node.args[0]
        new = []
        for t in tensors:  # type: ignore[union-attr]
            if float_tensor(t):
                with self.graph.inserting_before(node):
                    call = self.graph.call_module(target, (t,))
                call.meta = dict(t.meta)
                new.append(call)
            else:
                new.append(t)
        node.update_arg(0, new)
        self.grid[node] = self.gm.get_submodule(target)._output_quantizer


# ----------------------------------------------------------------------------------------------- entry
def _on_graph_device(holders: nn.Module, graph: fx.GraphModule) -> None:
    """The inserted quantizers (built parameter-less, so on the CPU) on the device of the graph's Parameters, so a
    graph captured on a GPU runs there."""
    device = next(
        (t.device for t in itertools.chain(graph.parameters(), graph.buffers()) if t.device.type != "meta"), None
    )
    if device is not None:
        holders.to(device)


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
    _check_rules(gm)
    units = _find_units(gm, config, name_prefix)
    holders = nn.Module()
    gm.add_module(QUANTIZERS, holders)
    for unit in units:
        _check_unit(gm, unit)
    for unit in units:
        _swap_unit(gm, unit)
        _functional_weights(gm, unit, holders)
    passthrough = {n for n in gm.graph.nodes if kind_of(n, gm) == "passthrough"}
    pooling = {n for n in passthrough if "max_pool" in str(n.target) or str(n.target).startswith("_dropout")}
    placer = _Placer(gm, holders, passthrough)
    unit_tails = {u.tail: u for u in units}
    data_path = _data_path(gm, {u.node for u in units})
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
    _on_graph_device(holders, graph_module)  # the input graph: the holders are not part of it
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    gm.quant_config = config
    state = quant_state(gm, create=True)
    assert state is not None
    state.graph_units = [UnitPlan(u.name, u.type_name, u.op, u.qconfig, dict(u.source)) for u in units]  # no fx nodes
    state.graph_float_layers = _graph_float_layers(gm, units, config, name_prefix, data_path)
    return gm


def _data_path(gm: fx.GraphModule, compute: set[fx.Node]) -> set[fx.Node]:
    """The nodes on the network's activation path: graph inputs and compute ops, then add / mul / cat / mean / pooling
    and pass-through ops all of whose tensor operands are on it. What ``float`` ops compute (norm statistics, the
    rotary embedding's cos/sin, a sigmoid gate) and Parameters read directly (a norm's weight) are not: an add or
    mul with such an operand is part of float arithmetic (RMSNorm, rotary embedding, a gated unit) and is not
    quantized; the compute op that reads its result quantizes its input."""
    path: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or node in compute:
            on = float_tensor(node) or node in compute
        elif node.op in ("call_function", "call_module"):
            kind = kind_of(node, gm)
            tensors = [a for a in node.all_input_nodes if float_tensor(a) or a.op == "get_attr"]
            on = (
                kind in ("quantized_output", "passthrough", "activation", "batch_norm")
                and bool(tensors)
                and all(a in path for a in tensors)
            )
        else:
            on = False
        if on:
            path.add(node)
    return path


def _quantized_output(gm: fx.GraphModule, placer: _Placer, node: fx.Node, config: Config, prefix: str) -> None:
    """add / mul / cat / mean / average pooling: quantized inputs, a quantized output (after a following ReLU)."""
    name, type_name = module_path(node)
    qconfig, _ = resolve_node(config, prefix + name, [type_name], ("input_tensors", "output_tensors"))
    if qconfig is None:
        return
    in_spec = qconfig.input_tensors
    out_spec = qconfig.output_tensors or in_spec
    if node.target is torch.ops.aten.cat.default and in_spec is not None and _per_tensor_static(in_spec):
        placer.share_cat(node, in_spec)
        return
    args = node.args[0] if node.target is torch.ops.aten.cat.default else node.args[:2]
    for arg in args:  # type: ignore[union-attr]
        placer.need(arg, node, in_spec)
    tail = node
    nxt = _single_user(node)
    if nxt is not None and kind_of(nxt, gm) == "activation" and nxt.args[0] is node:
        tail = nxt  # add + ReLU: one op on integer hardware
    if out_spec is not None:
        placer.own[tail] = out_spec


def _check_unit(gm: fx.GraphModule, unit: GraphUnit) -> None:
    """The eager-mode shape checks of the weight specs (ch_axis range, group_size divisibility), per unit."""
    if unit.twin_path is None or unit.qconfig is None:
        return
    layer = _float_module(gm, unit)
    check_layer(LayerPlan(unit.name, type(layer).__name__, unit.qconfig, unit.source), layer)


def _quantized_as_weight(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether every use of ``node`` is a weight quantizer: a weight computed from Parameters (weight_norm's
    ``_weight_norm(v, g)``) that the op reading it sees quantized."""
    return bool(node.users) and all(
        user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), QuantFunctionalWeight)
        for user in node.users
    )


def _graph_float_layers(
    gm: fx.GraphModule, units: list[GraphUnit], config: Config, prefix: str, data_path: set[fx.Node]
) -> list[FloatLayer]:
    """The layers with Parameters graph mode leaves float, each with the reason."""
    out: list[FloatLayer] = []
    for unit in units:
        if unit.qconfig is None or (unit.twin_path is not None and unit.qconfig.weight is None and unit.op != "matmul"):
            if (
                unit.op == "matmul"
                and unit.qconfig is None
                and not any(isinstance(a, fx.Node) and a.op == "get_attr" for a in unit.node.args[:2])
            ):
                continue
            reason = (
                "excluded by Config.exclude"
                if excluded(config, prefix + unit.name)
                else (
                    "embeddings are quantized only when named in layer_type_quant_config or layer_quant_config"
                    if unit.op == "embedding"
                    else "no QuantizationSpec for its weight at any config level"
                )
            )
            out.append(FloatLayer(unit.name or "<top>", unit.type_name or unit.op, reason))
    seen = {f.name for f in out} | {u.name for u in units}
    for node in gm.graph.nodes:
        if node.op == "call_module" and kind_of(node, gm) == "batch_norm" and str(node.target) not in seen:
            seen.add(str(node.target))
            out.append(
                FloatLayer(
                    str(node.target),
                    type(gm.get_submodule(str(node.target))).__name__,
                    "BatchNorm not after a conv (kept float, not folded)",
                )
            )
        elif node.op == "call_function" and tensor_valued(node) and _runs_float(gm, node, data_path):
            params = [
                a
                for a in node.args
                if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(fetch_attr(gm, a), nn.Parameter)
            ]
            path, type_name = module_path(node)
            if params and path not in seen and not _quantized_as_weight(gm, node):
                seen.add(path)
                out.append(FloatLayer(path, type_name, _float_reason(gm, node, params, data_path)))
    return out


def _runs_float(gm: fx.GraphModule, node: fx.Node, data_path: set[fx.Node]) -> bool:
    """An op that computes in float: float by rule, or an add / mul / ... off the quantized data path."""
    kind = kind_of(node, gm)
    return kind == "float" or (kind == "quantized_output" and node not in data_path)


def _float_reason(gm: fx.GraphModule, node: fx.Node, params: list[fx.Node], data_path: set[fx.Node]) -> str:
    """Why a layer whose Parameters ``node`` reads stays float: the ops that compute with them (through casts and
    layout ops; never bookkeeping such as ``_assert_tensor_metadata``), which run in float."""
    ops = [str(u.target) for p in params for u in computing_users(p) if _runs_float(gm, u, data_path)] or [
        str(node.target)
    ]
    names = list(dict.fromkeys(ops))
    verb = "runs" if len(names) == 1 else "run"
    return f"{', '.join(names)} {verb} in float (graph mode quantizes conv/linear/matmul/embedding weights)"
