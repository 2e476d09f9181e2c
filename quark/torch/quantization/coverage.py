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
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules.quant_modules import (
    EXPLICIT_ONLY,
    QUANT_MODULE_MAP,
    QuantMixin,
    float_rule_reason,
    structural_twin,
)
from quark.torch.quantization.resolve import excluded, explicit_levels, float_type, owners, submodule
from quark.torch.quantization.state import ensure_quant_state
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "FloatLayer",
    "format_float_layers",
    "warn_float_layers",
    "track_forward",
    "unreached_layers",
    "float_reason",
    "float_layers",
    "own_parameters",
    "uncalibrated_layers",
    "report_coverage",
    "functional_float",
    "finish_calibration",
]

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)

#: names of the functions that consume a weight: a Parameter passed to one directly (no quantizer between) runs float
_WEIGHT_OPS = frozenset(
    {
        "linear",
        "bilinear",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "embedding",
        "embedding_bag",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "einsum",
        "__matmul__",
        "__rmatmul__",
    }
)


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
    """Torch's normalization layers, and a model's own (``LlamaRMSNorm``, T5's ``T5LayerNorm``): a class whose name
    ends in ``Norm`` holding only a 1-D scale (and bias)."""
    if isinstance(module, _NORMS):
        return True
    params = list(module.parameters(recurse=False))
    return type(module).__name__.endswith("Norm") and bool(params) and all(p.ndim == 1 for p in params)


class _FunctionalUse(TorchFunctionMode):
    """Records weight-consuming calls that receive a model Parameter directly, outside the quantized layer that owns
    it (inside, the layer's own quantizer handles it, even while fake quantization is off for calibration)."""

    def __init__(self, params: dict[int, tuple[str, frozenset[str]]], active: list[str]) -> None:
        super().__init__()
        self.params = params  # id -> (parameter name, the quantized layers holding it: several for a tied one)
        self.active = active  # quantized layers whose forward is running
        self.found: dict[str, str] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = getattr(func, "__name__", "")
        if op in _WEIGHT_OPS:
            for a in list(args) + list(kwargs.values()):
                for t in a if isinstance(a, list | tuple) else (a,):
                    entry = self.params.get(id(t)) if isinstance(t, nn.Parameter) else None
                    if entry is not None and entry[1].isdisjoint(self.active) and entry[0] not in self.found:
                        self.found[entry[0]] = op
        return func(*args, **kwargs)


@contextmanager
def track_forward(model: nn.Module, functional: bool = True) -> Iterator[dict[str, Any]]:
    """Inside the block, record which quantized layers a forward reaches (``"reached"``: their names) and, with
    ``functional``, which Parameters reach a weight op without their layer's quantizer (``"functional"``: name -> op)."""
    record: dict[str, Any] = {"reached": set(), "functional": {}}
    active: list[str] = []
    handles = []
    params: dict[int, tuple[str, frozenset[str]]] = {id(p): (n, frozenset()) for n, p in model.named_parameters()}

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
            for p_name, p in m.named_parameters(recurse=False):  # a tied Parameter: inside any of its layers
                params[id(p)] = (prefix + p_name, params.get(id(p), ("", frozenset()))[1] | {name})
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
            m.unreached = name not in reached
            if name not in reached:
                out.append(name)
    return out


# ----------------------------------------------------------------------------------------------- float reasons
#: modules whose Parameters belong to another: a quantizer's thresholds, the originals of a parametrized tensor (the
#: layer holding the parametrization is the one quantized or reported float)
_NOT_LAYERS = (QuantMixin, FakeQuantizeBase, parametrize.ParametrizationList)


def float_reason(
    config: Config,
    name: str,
    module: nn.Module,
    owner: tuple[str, nn.Module] | None,
    parent: nn.Module | None = None,
) -> str:
    """Why a module with Parameters of its own is not quantized (it resolved to no plan). ``parent``: the module
    holding it, for the registered float rules that look at its neighbours (an MoE router beside its experts)."""
    base = next((c for c in type(module).__mro__ if c in QUANT_MODULE_MAP), None)
    if excluded(config, name):
        return "excluded by Config.exclude"
    if owner is not None and excluded(config, owner[0]):
        return f"excluded with its owner '{owner[0]}'"
    rule = float_rule_reason(name, module, parent)
    if rule is not None:
        return rule
    if base is not None and float_type(module) is None:
        return f"subclass of {base.__name__} with its own forward (a quantized twin would drop it)"
    if base in EXPLICIT_ONLY:
        by_name, by_type = explicit_levels(config, name, module)
        if not by_name and not by_type:
            return "embeddings are quantized only when named in layer_type_quant_config or layer_quant_config"
    if base is not None:
        return "no QuantizationSpec for any of its tensors at any config level"
    if is_norm(module):
        return "normalization layer (kept float)"
    _, layout = structural_twin(module)
    if layout is not None:
        return layout
    params = own_parameters(module)
    return f"no quantized twin for {type(module).__name__}: its Parameters {params} are used in its own forward"


def float_layers(config: Config, model: nn.Module, planned: set[str]) -> list[FloatLayer]:
    """Every module holding Parameters of its own that no plan covers, with the reason (before the swap)."""
    owned = owners(model)
    out = []
    for name, module in model.named_modules():
        if name in planned or isinstance(module, _NOT_LAYERS) or _inside_quantized(model, name):
            continue
        if not own_parameters(module):
            continue
        parent = submodule(model, name.rpartition(".")[0]) if name else None
        reason = float_reason(config, name, module, owned.get(name), parent)
        out.append(FloatLayer(name, type(module).__name__, reason))
    return out


def own_parameters(module: nn.Module) -> list[str]:
    """The Parameters a module holds itself, its parametrized tensors (weight_norm's ``weight``) included."""
    params = [n for n, _ in module.named_parameters(recurse=False)]
    return params + list(module.parametrizations) if parametrize.is_parametrized(module) else params


def _inside_quantized(model: nn.Module, name: str) -> bool:
    """Whether ``name`` lies inside a quantizer module or a parametrization (see ``_NOT_LAYERS``)."""
    parts = name.split(".")
    return any(isinstance(submodule(model, ".".join(parts[:i])), _NOT_LAYERS[1:]) for i in range(1, len(parts)))


# ----------------------------------------------------------------------------------------------- after calibration
_ACTIVATION_ROLES = ("input_tensors", "output_tensors")


def uncalibrated_layers(model: nn.Module) -> set[str]:
    """Names of the quantized layers that calibration (or QAT) never reached: none of their static activation
    quantizers has qparams (their weight quantizers may have them: PTQ observes weights directly, QAT in the forward).
    Reached layers first give their parts that saw no data the qparams they define (``finish_calibration``: an MoE
    expert no token reached takes its siblings' input scales, named in a warning).

    Raises a ValueError naming the layer and role for a layer that was reached (an activation quantizer has qparams)
    but has a quantizer without them, and when no quantizer of the model has qparams (it was never calibrated)."""
    finish_calibration(model)
    unreached, calibrated = set(), False
    for name, module in model.named_modules():
        if not isinstance(module, QuantMixin):
            continue
        static = []
        for slot, q in module.quantizer_slots():
            initialized = getattr(q, "initialized", None)
            if q.is_dynamic or not isinstance(initialized, torch.Tensor):
                continue
            q.calculate_qparams()  # brings lazily computed qparams up to date (sets ``initialized``)
            static.append((slot, bool(initialized)))
        missing = [slot for slot, ready in static if not ready]
        calibrated |= len(missing) < len(static)
        if not missing:
            continue
        if any(ready for slot, ready in static if slot.role in _ACTIVATION_ROLES):
            raise ValueError(
                f"layer '{name}' ({type(module).__name__}): the {missing[0].role} quantizer has no qparams yet; "
                "calibrate the model (or load a calibrated state_dict) first"
            )
        unreached.add(name)
    if unreached and not calibrated:
        raise ValueError(
            f"no quantizer of the model has qparams yet (layer '{sorted(unreached)[0]}', ...); calibrate the model "
            "(or load a calibrated state_dict) first"
        )
    return unreached


def finish_calibration(model: nn.Module, stacklevel: int = 3) -> list[str]:
    """Ask every reached quantized layer to give the quantizers its data left without qparams what the layer defines
    for them (``QuantMixin.finish_calibration``: an MoE expert no token reached takes its siblings' input scales);
    one warning names them. Returns the layers' sentences, ``"layer: sentence"``."""
    notes = []
    for name, module in model.named_modules():
        if isinstance(module, QuantMixin) and not module.unreached:
            note = module.finish_calibration()
            if note is not None:
                notes.append(f"{name or '<model>'}: {note}")
    if notes:
        warnings.warn("; ".join(notes), stacklevel=stacklevel)
    return notes


def report_coverage(model: nn.Module, record: dict[str, Any]) -> None:
    """After calibration: warn about quantized layers no forward reached (marked so size reports count them as
    float), about the parts of reached layers that saw no data (``finish_calibration``: MoE experts no token was
    routed to) and about Parameters that a forward fed to a weight op with no quantizer between (kept on the model
    for ``float_layers``)."""
    unreached = unreached_layers(model, record["reached"])
    if unreached:
        warnings.warn(
            f"quantized layer(s) that no forward reached during calibration (their quantizers saw no data, so they are "
            f"not counted as quantized): {unreached}",
            stacklevel=4,
        )
    finish_calibration(model, stacklevel=4)
    uses: dict[str, list[str]] = {}
    for param, op in record["functional"].items():
        owner, _, attr = param.rpartition(".")
        uses.setdefault(owner, []).append(f"'{attr}' ({op})")
    ensure_quant_state(model).functional_uses = uses
    tied = [f for f in functional_float(model, uses) if f.layer_type.startswith("Quant")]
    warn_float_layers(tied, stacklevel=4)


def functional_float(model: nn.Module, uses: dict[str, list[str]]) -> list[FloatLayer]:
    """Float entries for the Parameters of quantized layers that a forward also used outside the layer."""
    out = []
    for owner, found in uses.items():
        module = submodule(model, owner)
        if isinstance(module, QuantMixin):
            out.append(
                FloatLayer(
                    owner,
                    type(module).__name__,
                    f"Parameter {', '.join(found)} also used outside the layer, float there",
                )
            )
    return out
