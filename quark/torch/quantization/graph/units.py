"""Compute units of a captured graph: per-op Config resolution, conv + BatchNorm + activation fusion, rule checks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from quark.torch.compat import EXPORT_GUARDS_ATTR
from quark.torch.quantization.config.config import Config, QuantizationConfig
from quark.torch.quantization.graph.capture import EAGER_FALLBACK, GraphModeError, fetch_attr, module_path
from quark.torch.quantization.graph.rules import COMPUTE, kind_of, weighted_ops_in_body
from quark.torch.quantization.resolve import LayerPlan, check_layer, excluded, merge_levels, name_levels, type_level

__all__ = [
    "UnitPlan",
    "GraphUnit",
    "resolve_node",
    "float_module",
    "single_user",
    "check_rules",
    "find_units",
    "check_unit",
]

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


def float_module(gm: fx.GraphModule, unit: GraphUnit) -> nn.Module:
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


def single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _bn_calls(gm: fx.GraphModule) -> Counter[str]:
    """How often each module is called by the graph (a BatchNorm called twice is not folded)."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")


def check_rules(gm: fx.GraphModule) -> None:
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
def find_units(gm: fx.GraphModule, config: Config, prefix: str) -> list[GraphUnit]:
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
        nxt = single_user(node)
        if op == "conv" and nxt is not None and kind_of(nxt, gm) == "batch_norm" and nxt.args[0] is node:
            bn = gm.get_submodule(str(nxt.target))
            if bn.track_running_stats and bn_calls.get(str(nxt.target)) == 1:  # type: ignore[union-attr]
                unit.bn, tail = nxt, nxt
        nxt = single_user(tail)
        if op in ("conv", "linear") and nxt is not None and kind_of(nxt, gm) == "activation" and nxt.args[0] is tail:
            unit.act = nxt
        unit.twin_path = _module_owned(gm, unit) if op != "matmul" else None
        units.append(unit)
    return units


def check_unit(gm: fx.GraphModule, unit: GraphUnit) -> None:
    """The eager-mode shape checks of the weight specs (ch_axis range, group_size divisibility), per unit."""
    if unit.twin_path is None or unit.qconfig is None:
        return
    layer = float_module(gm, unit)
    check_layer(LayerPlan(unit.name, type(layer).__name__, unit.qconfig, unit.source), layer)
