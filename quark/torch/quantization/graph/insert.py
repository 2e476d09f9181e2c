"""Graph rewrites of prepare_graph: quantized twins swapped in, functional weight and activation quantizers placed."""

from __future__ import annotations

import itertools
from typing import Any

from torch import fx, nn

from quark.torch.quantization.config.config import QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.formats import BLOCK_FORMATS, is_scaled
from quark.torch.quantization.graph.capture import module_path
from quark.torch.quantization.graph.modules import CONV_BN, QuantActivation, QuantFunctionalWeight, SharedFakeQuantize
from quark.torch.quantization.graph.rules import float_tensor
from quark.torch.quantization.graph.units import GraphUnit, float_module
from quark.torch.quantization.nn.modules.quant_modules import QUANT_MODULE_MAP
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = ["QUANTIZERS", "swap_unit", "functional_weights", "per_tensor_static", "Placer", "on_graph_device"]

#: the container of the activation quantizers in a prepared graph (its state_dict prefix)
QUANTIZERS = "_graph_quantizers"


# ----------------------------------------------------------------------------------------------- units
def swap_unit(gm: fx.GraphModule, unit: GraphUnit) -> None:
    """Replace the compute node (and its BatchNorm) by a call of the quantized twin at the module's path."""
    if unit.twin_path is None or unit.qconfig is None or not (unit.qconfig.weight or unit.qconfig.bias or unit.bn):
        return
    float_layer = float_module(gm, unit)
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


def functional_weights(gm: fx.GraphModule, unit: GraphUnit, holders: nn.Module) -> None:
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
def per_tensor_static(spec: QuantizationSpec) -> bool:
    return (
        spec.qscheme == QSchemeType.per_tensor
        and not spec.is_dynamic
        and is_scaled(spec.dtype)
        and spec.dtype not in BLOCK_FORMATS
    )


class Placer:
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
            and per_tensor_static(spec)
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
            if source is not None and per_tensor_static(source.spec) and node not in self.own:
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


# ----------------------------------------------------------------------------------------------- device
def on_graph_device(holders: nn.Module, graph: fx.GraphModule) -> None:
    """The inserted quantizers (built parameter-less, so on the CPU) on the device of the graph's Parameters, so a
    graph captured on a GPU runs there."""
    device = next(
        (t.device for t in itertools.chain(graph.parameters(), graph.buffers()) if t.device.type != "meta"), None
    )
    if device is not None:
        holders.to(device)
