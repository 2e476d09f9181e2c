"""What stays float, and why: every module holding Parameters that no quantizer covers, and every quantizer that a
forward never reached. Nothing is reported as quantized that the model does not run quantized."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quark.torch.quantization.nn.modules.quant_modules import QuantMixin

__all__ = ["FloatLayer", "format_float_layers", "warn_float_layers", "track_forward", "unreached_layers"]

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)

#: names of the functions that consume a weight: a Parameter passed to one directly (no quantizer between) runs float
_WEIGHT_OPS = frozenset({
    "linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "embedding", "embedding_bag", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "__matmul__", "__rmatmul__",
})  # fmt: skip


@dataclass(frozen=True)
class FloatLayer:
    """A module with Parameters of its own that runs float, and why."""

    name: str
    layer_type: str
    reason: str


def format_float_layers(layers: list[FloatLayer]) -> str:
    """The float layers as a fixed-width table (empty string when there are none)."""
    if not layers:
        return ""
    rows = [("float layer", "type", "why")] + [(f.name or "<model>", f.layer_type, f.reason) for f in layers]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{r[0].ljust(widths[0])}  {r[1].ljust(widths[1])}  {r[2]}".rstrip() for r in rows]
    lines.insert(1, f"{'-' * widths[0]}  {'-' * widths[1]}  ---")
    return "\n".join(lines)


def warn_float_layers(layers: list[FloatLayer], stacklevel: int = 3) -> None:
    """One warning naming every float layer with its reason, grouped by reason."""
    if not layers:
        return
    by_reason: dict[str, list[str]] = {}
    for f in layers:
        by_reason.setdefault(f.reason, []).append(f"{f.name or '<model>'} ({f.layer_type})")
    parts = [f"{reason}: {', '.join(names)}" for reason, names in by_reason.items()]
    warnings.warn(f"{len(layers)} layer(s) with Parameters stay float. " + "; ".join(parts), stacklevel=stacklevel)


def is_norm(module: nn.Module) -> bool:
    """torch's normalization layers, and a model's own (``LlamaRMSNorm``, T5's ``T5LayerNorm``): a class whose name
    ends in ``Norm`` holding only a 1-D scale (and bias)."""
    if isinstance(module, _NORMS):
        return True
    params = list(module.parameters(recurse=False))
    return type(module).__name__.endswith("Norm") and bool(params) and all(p.ndim == 1 for p in params)


class _FunctionalUse(TorchFunctionMode):
    """Records weight-consuming calls that receive a model Parameter directly, outside the quantized layer that owns
    it (inside, the layer's own quantizer handles it, even while fake quantization is off for calibration)."""

    def __init__(self, params: dict[int, tuple[str, str | None]], active: list[str]) -> None:
        super().__init__()
        self.params = params  # id -> (parameter name, owning quantized layer or None)
        self.active = active  # quantized layers whose forward is running
        self.found: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = getattr(func, "__name__", "")
        if op in _WEIGHT_OPS:
            for a in list(args) + list(kwargs.values()):
                for t in a if isinstance(a, list | tuple) else (a,):
                    entry = self.params.get(id(t)) if isinstance(t, nn.Parameter) else None
                    if entry is not None and entry[1] not in self.active and entry[0] not in self.found:
                        self.found[entry[0]] = op
        return func(*args, **kwargs)


@contextmanager
def track_forward(model: nn.Module, functional: bool = True) -> Iterator[dict[str, Any]]:
    """Inside the block, record which quantized layers a forward reaches (``"reached"``: their names) and, with
    ``functional``, which Parameters reach a weight op without their layer's quantizer (``"functional"``: name -> op)."""
    record: dict[str, Any] = {"reached": set(), "functional": {}}
    active: list[str] = []
    handles = []
    params: dict[int, tuple[str, str | None]] = {id(p): (n, None) for n, p in model.named_parameters()}

    def enter(name: str, args: tuple[Any, ...]) -> None:  # hooks return None (a value would replace the input)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not tensors or any(t.numel() for t in tensors):  # an empty batch (an MoE expert no token was routed to)
            record["reached"].add(name)  # gives its quantizers no statistics: it does not count as reached
        active.append(name)

    def leave() -> None:
        if active:
            active.pop()

    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            handles.append(m.register_forward_pre_hook(lambda mod, args, n=name: enter(n, args)))
            handles.append(m.register_forward_hook(lambda mod, args, out: leave()))
            prefix = f"{name}." if name else ""
            for p_name, p in m.named_parameters(recurse=False):
                params[id(p)] = (prefix + p_name, name)
    mode = _FunctionalUse(params, active) if functional else None
    try:
        if mode is None:
            yield record
        else:
            with mode:
                yield record
    finally:
        for h in handles:
            h.remove()
        if mode is not None:
            record["functional"] = dict(mode.found)


def unreached_layers(model: nn.Module, reached: set[str]) -> list[str]:
    """Quantized layers of ``model`` that no forward reached (their quantizers never saw data); each is marked so
    that size reports count its weights as float."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QuantMixin):
            m._quant_unreached = name not in reached
            if name not in reached:
                out.append(name)
    return out
