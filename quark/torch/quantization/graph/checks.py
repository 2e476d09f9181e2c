"""The checks around graph mode's function-preserving passes (BatchNorm folding, cross-layer equalization).

Each pass runs the batch the graph was captured with (``capture.example_inputs``) through the graph with every
quantizer off, before and after, and compares with ``equivalence.check_equivalent`` (the one comparison rule). A
difference beyond float noise undoes the pass and raises ``EquivalenceError`` naming the pass and the first layer
whose output differs (found by running both versions node by node, only then). ``quantized_error`` measures what a
pass does to the quantized model on the same batch (CLE keeps its rescaling only where that error does not grow).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import fx, nn

from quark.torch.quantization.equivalence import EquivalenceError, check_equivalent, relative_error, tolerance
from quark.torch.quantization.graph.capture import example_inputs, module_path
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin, slot_tensor
from quark.torch.quantization.state import paused_quantizers, preserve_modes
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = ["checked", "example_for", "float_run", "quantized_error", "Example"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
Example = tuple[tuple[Any, ...], dict[str, Any]]


def _like_model(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The example moved to the model's device, its floating-point tensors in the model's dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, dict):
        return {k: _like_model(v, device, dtype) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_like_model(v, device, dtype) for v in value)
    return value


def example_for(gm: nn.Module) -> Example | None:
    """``gm``'s captured example, on its device and in its dtype; None when it has none or no Parameters."""
    example = example_inputs(gm)
    param = next((p for p in gm.parameters() if p.is_floating_point()), None)
    if example is None or param is None:
        return None
    return _like_model(example, param.device, param.dtype)


@contextlib.contextmanager
def _float_function(gm: nn.Module) -> Iterator[None]:
    """Inside the block ``gm`` computes its float function: eval mode, no grad, every quantizer neither observing nor
    fake-quantizing (their flags set directly, so no qparams are fixed on the way); all of it restored after."""
    with paused_quantizers(gm, fake_quant=True), preserve_modes(gm, mode=False), torch.no_grad():
        yield


def float_run(gm: nn.Module, example: Example, hooks: dict[nn.Module, Callable[..., Any]] | None = None) -> Any:
    """``gm``'s float output on ``example`` (quantizers off); ``hooks``: forward hooks to run on the way."""
    handles = [m.register_forward_hook(h) for m, h in (hooks or {}).items()]
    try:
        with _float_function(gm):
            return gm(*example[0], **example[1])
    finally:
        for handle in handles:
            handle.remove()


class _Trace(fx.Interpreter):
    """Runs a graph node by node, keeping every node's output (the failure path only: it holds all of them)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _trace(gm: fx.GraphModule, example: Example) -> dict[str, Any]:
    """Every node's float output on ``example``."""
    tracer = _Trace(gm)
    with _float_function(gm):
        bound = inspect.signature(gm.forward).bind(
            *example[0], **example[1]
        )  # keywords by position, as forward takes them
        bound.apply_defaults()
        tracer.run(*bound.args)
    return tracer.values


def _node_label(node: fx.Node) -> str:
    """A layer name for messages: the module a node calls, else the original module that ran it."""
    if node.op == "call_module":
        return f"layer '{node.target}'"
    path, type_name = module_path(node)
    return f"node '{node.name}'" + (f" in '{path}' ({type_name})" if path else "")


def _first_divergence(
    gm: fx.GraphModule,
    before: dict[str, Any],
    after: dict[str, Any],
    rescaled: set[str],
    label: Callable[[fx.Node], str],
) -> tuple[str, Any, Any] | None:
    """(label, before, after) of the first node, in graph order, whose output differs beyond float noise; nodes in
    ``rescaled`` (values a pass changes on purpose, e.g. between the two layers of a CLE pair) are not compared."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or node.name in rescaled or node.name not in before:
            continue
        old, new = before[node.name], after.get(node.name)
        if not isinstance(old, torch.Tensor) or not old.is_floating_point():
            continue
        if not relative_error(old, new) <= tolerance(old.dtype, old.device):
            return label(node), old, new
    return None


def checked(
    transform: str,
    gm: nn.Module,
    apply: Callable[[], T],
    undo: Callable[[], None],
    rescaled: set[str] | None = None,
    label: Callable[[fx.Node], str] = _node_label,
    reference: Any = None,
) -> T:
    """``apply()`` a pass that must keep ``gm``'s float function, then compare on the captured example (against
    ``reference`` when given: the float output before any pass). On a difference beyond float noise, or on any
    error in ``apply``, ``undo()`` and raise: EquivalenceError naming ``transform`` and the first differing layer."""
    example = example_for(gm)
    if example is None:
        logger.info("%s: the graph has no captured example batch; not checked against the float model", transform)
        return apply()
    before = float_run(gm, example) if reference is None else reference
    try:
        result = apply()
        after = float_run(gm, example)
    except BaseException:
        undo()
        raise
    try:
        check_equivalent(transform, "the graph's output", before, after)
    except EquivalenceError as err:
        where = _locate(gm, example, undo, rescaled or set(), label)
        if where is None:
            raise
        check_equivalent(transform, *where)  # raises, naming the layer
        raise err from None  # the layer's output agrees but the graph's does not: the graph-level message
    return result


def _locate(
    gm: nn.Module, example: Example, undo: Callable[[], None], rescaled: set[str], label: Callable[[fx.Node], str]
) -> tuple[str, Any, Any] | None:
    """Undo the pass and find the first layer whose float output it changed (node by node, both versions)."""
    if not isinstance(gm, fx.GraphModule):
        undo()
        return None
    try:
        after = _trace(gm, example)
    finally:
        undo()
    return _first_divergence(gm, _trace(gm, example), after, rescaled, label)


# ----------------------------------------------------------------------------------------------- quantized error
def quantized_error(gm: nn.Module, example: Example, reference: Any) -> float:
    """Relative error against ``reference`` (the float output) of a copy of ``gm`` calibrated on ``example`` alone
    (weights and activations observed, then fake-quantized): what the quantized model would lose on that batch."""
    trial = copy.deepcopy(gm)
    trial.eval()
    quantizers = [m for m in trial.modules() if isinstance(m, FakeQuantizeBase)]
    with torch.no_grad():
        for q in quantizers:
            q.enable_observer()
            q.disable_fake_quant()
        for m in trial.modules():
            if isinstance(m, QuantMixin):
                for slot, q in m.quantizer_slots():
                    tensor = slot_tensor(m, slot)
                    if isinstance(tensor, torch.Tensor):
                        q(tensor)
        trial(*example[0], **example[1])
        for q in quantizers:
            if not q.is_dynamic:
                q.enable_observer(False)  # fixes the qparams
            q.enable_fake_quant()
        return relative_error(reference, trial(*example[0], **example[1]))
