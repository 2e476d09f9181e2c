"""What graph mode leaves float, and why: the quantized data path and the layers with Parameters off it."""

from __future__ import annotations

from torch import fx, nn

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.coverage import FloatLayer
from quark.torch.quantization.graph.capture import fetch_attr, module_path
from quark.torch.quantization.graph.modules import QuantFunctionalWeight
from quark.torch.quantization.graph.rules import computing_users, float_tensor, kind_of, tensor_valued
from quark.torch.quantization.graph.units import GraphUnit
from quark.torch.quantization.resolve import excluded

__all__ = ["find_data_path", "graph_float_layers"]


def find_data_path(gm: fx.GraphModule, compute: set[fx.Node]) -> set[fx.Node]:
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


def _quantized_as_weight(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether every use of ``node`` is a weight quantizer: a weight computed from Parameters (weight_norm's
    ``_weight_norm(v, g)``) that the op reading it sees quantized."""
    return bool(node.users) and all(
        user.op == "call_module" and isinstance(gm.get_submodule(str(user.target)), QuantFunctionalWeight)
        for user in node.users
    )


def graph_float_layers(
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
