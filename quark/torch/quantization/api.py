"""ModelQuantizer: resolve the Config per layer and role, swap layers for their quantized twins, calibrate, freeze.

Resolution, per layer: the first of ``layer_quant_config`` (exact name, then fnmatch patterns in the order given),
``layer_type_quant_config`` (the class name, or a base class's) and ``global_quant_config`` that matches is the
layer's QuantizationConfig (amd-quark's rule; ``Config.inherit_roles=True`` fills a role left None from the next level
instead, see ``resolve.merge_levels``); ``exclude`` (fnmatch) leaves a layer float.
Everything that can be checked is checked before the model is touched, and a failure midway restores it.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize

from quark.torch.quantization import graph
from quark.torch.quantization.config.config import (
    CLEConfig,
    Config,
    LSQSpec,
    QuantizationConfig,
    QuantizationSpec,
    TQTSpec,
)
from quark.torch.quantization.config.type import QSchemeType, QuantizationMode, TQTThresholdInitMeth
from quark.torch.quantization.coverage import (
    FloatLayer,
    format_float_layers,
    is_norm,
    track_forward,
    unreached_layers,
    warn_float_layers,
)
from quark.torch.quantization.formats import BLOCK_FORMATS, is_scaled
from quark.torch.quantization.hf import hf_conv1d_class, hf_linear_equivalent, is_hf_conv1d, no_kv_cache
from quark.torch.quantization.nn.modules.quant_modules import (
    EXPLICIT_ONLY,
    PREPARE_HOOKS,
    QUANT_MODULE_MAP,
    QuantHFConv1DMixin,
    QuantLinear,
    QuantMixin,
    bakeable,
    iter_quantizers,
    refresh_computed_tensors,
    shared_tensors,
    slot_label,
    twin_of_foreign_class,
)
from quark.torch.quantization.resolve import merge_levels
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FakeQuantizeBase

logger = logging.getLogger(__name__)

__all__ = ["ModelQuantizer", "LayerPlan", "activation_axes_to_check", "check_activation_shapes", "unmatched_names"]

ROLES = QuantizationConfig.ROLES
SUPPORTED_TYPE_NAMES = sorted(c.__name__ for c in QUANT_MODULE_MAP)


@dataclass(frozen=True)
class LayerPlan:
    """What resolution decided for one layer."""

    name: str
    layer_type: str
    qconfig: QuantizationConfig
    source: dict[str, str]  # role -> "layer 'pattern'" | "type 'Linear'" | "global"


# ----------------------------------------------------------------------------------------------- resolution
def unmatched_names(config: Config, names: list[str]) -> dict[str, list[str]]:
    """The ``layer_quant_config`` / ``exclude`` entries (fnmatch patterns of a full module name) that match none of
    the module ``names``, per field (fields with none left out). The engine warns about them, as amd-quark does;
    the app refuses them."""
    out = {}
    for field_name, keys in (("layer_quant_config", list(config.layer_quant_config)), ("exclude", list(config.exclude))):
        dead = [k for k in keys if not any(fnmatch.fnmatchcase(n, k) for n in names)]
        if dead:
            out[field_name] = dead
    return out


def _type_names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__ if issubclass(c, nn.Module) and c is not nn.Module]


def _float_type(module: nn.Module) -> type[nn.Module] | None:
    """The supported float class ``module`` is (or subclasses without its own forward), else None."""
    conv1d, linear = hf_conv1d_class(type(module)), hf_linear_equivalent(type(module))
    if conv1d is not None and conv1d not in QUANT_MODULE_MAP and is_hf_conv1d(module):
        twin_of_foreign_class(conv1d, QuantHFConv1DMixin)  # transformers' Conv1D: its twin is made on first sight
    elif linear is not None and linear not in QUANT_MODULE_MAP:
        twin_of_foreign_class(linear, QuantLinear)
    for cls in type(module).__mro__:
        if cls in QUANT_MODULE_MAP:
            return cls if type(module).forward is cls.forward else None
    return None


def _layer_types(model: nn.Module) -> list[str]:
    """The supported float types of the model's layers (a quantized twin counts as its float type), sorted."""
    found = set()
    for m in model.modules():
        float_type = m._float_class if isinstance(m, QuantMixin) else _float_type(m)
        if float_type is not None:
            found.add(float_type.__name__)
    return sorted(found)


def _custom_forward_layers(model: nn.Module) -> list[str]:
    """Subclasses of supported layers with their own forward: swapping would drop that forward, so they stay float."""
    return [
        name
        for name, m in model.named_modules()
        if _float_type(m) is None and not isinstance(m, QuantMixin) and any(c in QUANT_MODULE_MAP for c in type(m).__mro__)
    ]


def _layer_matches(config: Config, name: str) -> list[str]:
    """Keys of layer_quant_config that match ``name``: the exact name first, then patterns in the order given."""
    exact = [k for k in config.layer_quant_config if k == name]
    patterns = [k for k in config.layer_quant_config if k != name and fnmatch.fnmatchcase(name, k)]
    return exact + patterns


def _explicit_levels(config: Config, name: str, module: nn.Module) -> tuple[list[tuple[str, QuantizationConfig]], list[tuple[str, QuantizationConfig]]]:
    """The layer-name levels and the layer-type level that match one module, most specific first."""
    by_name = [(f"layer '{k}'", config.layer_quant_config[k]) for k in _layer_matches(config, name)]
    type_keys = [n for n in _type_names(module) if n in config.layer_type_quant_config]
    by_type = [(f"type '{type_keys[0]}'", config.layer_type_quant_config[type_keys[0]])] if type_keys else []
    return by_name, by_type


def _owners(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Child name -> (owner name, owner) for the children a twin owns (an attention's ``out_proj``): they follow
    the owner's configuration unless named themselves."""
    owners = {}
    for name, module in model.named_modules():
        float_type = module._float_class if isinstance(module, QuantMixin) else _float_type(module)
        for child in QUANT_MODULE_MAP[float_type].owned_children if float_type else ():
            if isinstance(getattr(module, child, None), nn.Module):
                owners[f"{name}.{child}" if name else child] = (name, module)
    return owners


def _resolve(config: Config, name: str, module: nn.Module, owner: tuple[str, nn.Module] | None = None) -> LayerPlan | None:
    """The merged QuantizationConfig of one layer, or None when it stays float."""
    float_type = _float_type(module)
    if float_type is None or isinstance(module, QuantMixin):
        return None
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude):
        return None
    by_name, by_type = _explicit_levels(config, name, module)
    levels = list(by_name)
    if owner is not None:
        if any(fnmatch.fnmatchcase(owner[0], pattern) for pattern in config.exclude):
            return None
        owner_name, owner_type = _explicit_levels(config, *owner)
        levels += [(f"{where} (owner)", qc) for where, qc in owner_name + owner_type]
    levels += by_type
    explicit = bool(levels)
    if float_type in EXPLICIT_ONLY and not explicit:
        return None  # embeddings only when named by type or layer
    levels.append(("global", config.global_quant_config))
    roles = {slot.role for slot in QUANT_MODULE_MAP[float_type].slots_for(module)}
    qconfig, source = merge_levels(levels, roles, config.inherit_roles)
    if qconfig is None:
        return None
    return LayerPlan(name, float_type.__name__, qconfig, source)


def _float_reason(config: Config, name: str, module: nn.Module, owner: tuple[str, nn.Module] | None) -> str:
    """Why a module with Parameters of its own is not quantized (it resolved to no plan)."""
    base = next((c for c in type(module).__mro__ if c in QUANT_MODULE_MAP), None)
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude):
        return "excluded by Config.exclude"
    if owner is not None and any(fnmatch.fnmatchcase(owner[0], pattern) for pattern in config.exclude):
        return f"excluded with its owner '{owner[0]}'"
    if base is not None and _float_type(module) is None:
        return f"subclass of {base.__name__} with its own forward (a quantized twin would drop it)"
    if base in EXPLICIT_ONLY:
        by_name, by_type = _explicit_levels(config, name, module)
        if not by_name and not by_type:
            return "embeddings are quantized only when named in layer_type_quant_config or layer_quant_config"
    if base is not None:
        return "no QuantizationSpec for any of its tensors at any config level"
    if is_norm(module):
        return "normalization layer (kept float)"
    params = _own_parameters(module)
    return f"no quantized twin for {type(module).__name__}: its Parameters {params} are used in its own forward"


def _float_layers(config: Config, model: nn.Module, planned: set[str]) -> list[FloatLayer]:
    """Every module holding Parameters of its own that no plan covers, with the reason (before the swap)."""
    owners = _owners(model)
    out = []
    for name, module in model.named_modules():
        if name in planned or isinstance(module, _NOT_LAYERS) or _inside_quantized(model, name):
            continue
        if not _own_parameters(module):
            continue
        out.append(FloatLayer(name, type(module).__name__, _float_reason(config, name, module, owners.get(name))))
    return out


#: modules whose Parameters belong to another: a quantizer's thresholds, the originals of a parametrized tensor (the
#: layer holding the parametrization is the one quantized or reported float)
_NOT_LAYERS = (QuantMixin, FakeQuantizeBase, parametrize.ParametrizationList)


def _own_parameters(module: nn.Module) -> list[str]:
    """The Parameters a module holds itself, its parametrized tensors (weight_norm's ``weight``) included."""
    params = [n for n, _ in module.named_parameters(recurse=False)]
    return params + list(module.parametrizations) if parametrize.is_parametrized(module) else params


def _inside_quantized(model: nn.Module, name: str) -> bool:
    """Whether ``name`` lies inside a quantizer module or a parametrization (see ``_NOT_LAYERS``)."""
    parts = name.split(".")
    return any(isinstance(_get_submodule(model, ".".join(parts[:i])), _NOT_LAYERS[1:]) for i in range(1, len(parts)))


def _check_layer(plan: LayerPlan, module: nn.Module) -> None:
    """Shape checks of the weight/bias specs against the layer's tensors (activations are checked when seen)."""
    twin = QUANT_MODULE_MAP[_float_type(module)]  # type: ignore[index]
    for slot in twin.slots_for(module):
        spec: QuantizationSpec | None = twin.slot_spec(slot, getattr(plan.qconfig, slot.role))
        tensor = getattr(module, slot.tensor, None) if slot.tensor else None
        if spec is None or not isinstance(tensor, torch.Tensor):
            continue
        where = f"layer '{plan.name}' ({plan.layer_type}, {slot.tensor} of shape {tuple(tensor.shape)})"
        if spec.qscheme == QSchemeType.per_block and tensor.ndim != 2:
            raise ValueError(
                f"{where}: qscheme=per_block (block_size={spec.block_size}) quantizes 2-D weights [out, in] only; use "
                "per_channel or per_group for this layer, exclude it, or override it in layer_type_quant_config"
            )
        if spec.ch_axis is not None and spec.qscheme in (QSchemeType.per_channel, QSchemeType.per_group):
            if not -tensor.ndim <= spec.ch_axis < tensor.ndim:
                raise ValueError(f"{where}: ch_axis={spec.ch_axis} is out of range for {tensor.ndim} dimensions")
            size = tensor.shape[spec.ch_axis]
            blocky = spec.dtype in BLOCK_FORMATS
            if spec.qscheme == QSchemeType.per_group and not blocky and size % spec.group_size:  # type: ignore[operator]
                raise ValueError(
                    f"{where}: group_size={spec.group_size} does not divide dimension {spec.ch_axis} of size {size}; "
                    f"use a divisor of {size}, exclude the layer, or override it in layer_quant_config"
                )


_AXIS_SCHEMES = (QSchemeType.per_channel, QSchemeType.per_group)


def _activation_shape_error(q: FakeQuantizeBase, role: str, x: Any) -> str | None:
    """Why the activation ``x`` does not fit the spec of ``q`` (its channel axis, a per_block 2-D shape), or None."""
    spec = q.spec
    if not isinstance(x, torch.Tensor):
        return None
    shape = tuple(x.shape)
    where = q.where if role in q.where else f"{q.where} ({role})"
    if spec.qscheme in _AXIS_SCHEMES and spec.ch_axis is not None and not -max(x.ndim, 1) <= spec.ch_axis < max(x.ndim, 1):
        return (
            f"{where}: ch_axis={spec.ch_axis} ({spec.qscheme.name}) is out of range for the activation of shape "
            f"{shape} ({x.ndim} dimension(s): allowed {-max(x.ndim, 1)}..{max(x.ndim, 1) - 1}); set the spec's ch_axis to "
            "the tensor's feature axis (-1 for a Linear's input/output, 1 for a convolution's)"
        )
    if spec.qscheme == QSchemeType.per_block and x.ndim != 2:
        return f"{where}: qscheme=per_block (block_size={spec.block_size}) quantizes 2-D tensors only; the activation has shape {shape}"
    return None


def activation_axes_to_check(model: nn.Module) -> bool:
    """Whether a prepared model has an activation quantizer whose spec has an axis (per_channel / per_group along
    ``ch_axis``, per_block): those are what ``check_activation_shapes`` checks."""
    return any(
        role in ("input_tensors", "output_tensors") and q.spec.qscheme in (*_AXIS_SCHEMES, QSchemeType.per_block)
        for role, q in iter_quantizers(model)
    )


def check_activation_shapes(model: nn.Module, feed: Callable[[nn.Module], Any]) -> bool:
    """Check the activation specs of a prepared model against the tensors of one forward, before any training or
    calibration: ``feed(model)`` runs once (eval, no_grad) with every quantizer off (observers and fake quantization;
    a float forward that changes no statistic) and each activation quantizer with an axis (per_channel / per_group
    ``ch_axis``, per_block) checks the tensor it is given. A mismatch raises a ValueError naming the layer, the role,
    the axis and the tensor's shape (instead of an IndexError from the observer at calibration). Nothing runs when no
    activation spec has an axis; returns whether ``feed`` ran."""
    if not activation_axes_to_check(model):
        return False
    quantizers = list(iter_quantizers(model))
    flags = [(q, bool(q.observer_enabled), bool(q.fake_quant_enabled)) for _, q in quantizers]

    def check(role: str) -> Callable[..., None]:
        def hook(q: FakeQuantizeBase, args: tuple[Any, ...]) -> None:
            problem = _activation_shape_error(q, role, args[0] if args else None)
            if problem:
                raise ValueError(problem)

        return hook

    hooks = [q.register_forward_pre_hook(check(role)) for role, q in quantizers if role in ("input_tensors", "output_tensors")]
    modes = [(m, m.training) for m in model.modules()]
    try:
        for q, _, _ in flags:
            FakeQuantizeBase.enable_observer(q, False)  # the base switch: no qparams are computed from old statistics
            q.disable_fake_quant()
        model.eval()
        with torch.no_grad(), no_kv_cache(model):
            feed(model)
    finally:
        for h in hooks:
            h.remove()
        for q, observe, fake_quant in flags:
            FakeQuantizeBase.enable_observer(q, observe)
            q.enable_fake_quant(fake_quant)
        for m, training in modes:
            m.training = training
    return True


# ----------------------------------------------------------------------------------------------- batches
def _to_device(obj: Any, device: torch.device | None) -> Any:
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def run_batch(model: nn.Module, batch: Any, device: torch.device | None = None) -> Any:
    """Call ``model`` on one batch: tensor -> model(x); dict -> model(**batch); (input, target...) -> the input."""
    if isinstance(batch, list | tuple):
        if not batch:
            raise ValueError("a calibration batch is an empty tuple/list")
        batch = batch[0]
    batch = _to_device(batch, device)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def _model_device(model: nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


# ----------------------------------------------------------------------------------------------- ModelQuantizer
class AlgorithmRunner(Protocol):
    """What ``quark.torch.algorithm`` provides (it registers itself on import: the algorithms depend on this module,
    never the reverse)."""

    def before_calibration(self, model: nn.Module, config: Config, batches: list[Any], device: torch.device | None) -> None: ...

    def after_calibration(self, model: nn.Module, config: Config, batches: list[Any], device: torch.device | None) -> None: ...


_ALGORITHMS: list[AlgorithmRunner] = []


def register_algorithms(runner: AlgorithmRunner) -> None:
    """Install the runner of ``algo_config`` / ``pre_quant_opt_config`` (called by ``quark.torch.algorithm``)."""
    _ALGORITHMS[:] = [runner]


class ModelQuantizer:
    """Quantize a float model with a Quark ``Config``.

    Example::

        quantizer = ModelQuantizer(config)
        model = quantizer.quantize_model(model, calib_dataloader)   # prepare + calibrate, in place
        model = ModelQuantizer.freeze(model)                         # fixed qparams, no observers

    Training-time callers use the halves: ``prepare(model)`` then ``calibrate(model, data)`` (or QAT).
    """

    def __init__(self, config: Config | dict[str, Any]) -> None:
        if isinstance(config, dict):
            config = Config.from_dict(config)
        if not isinstance(config, Config):
            raise ValueError(f"ModelQuantizer needs a Config (or its dict), got {type(config).__name__}")
        self.graph_mode = config.quant_mode == QuantizationMode.fx_graph_mode
        unknown = [k for k in config.layer_type_quant_config if k not in SUPPORTED_TYPE_NAMES]
        if unknown and not self.graph_mode:  # graph mode also matches the class names of the model's own modules
            raise ValueError(
                f"Config.layer_type_quant_config names unsupported layer type(s) {unknown}; supported: {SUPPORTED_TYPE_NAMES}"
            )
        self.config = config
        self._warned: set[str] = set()  # each unmatched-entry warning once per quantizer (resolve, then prepare)

    # -- planning
    def resolve(self, model: nn.Module, warn: bool = True) -> list[LayerPlan]:
        """Per-layer plans, in module order, without changing the model; warns about names that match nothing
        and about subclasses of supported layers that define their own forward (those stay float). Graph mode:
        one plan per compute op of the captured graph."""
        if self.graph_mode:
            return self._graph_plans(model)
        names = [n for n, _ in model.named_modules()]
        owners = _owners(model)
        plans = []
        for name, module in model.named_modules():
            plan = _resolve(self.config, name, module, owners.get(name))
            if plan is not None:
                _check_layer(plan, module)
                plans.append(plan)
        if warn:
            self._warn_unmatched(model, names)
            custom = _custom_forward_layers(model)
            if custom:
                warnings.warn(f"layers that subclass a supported type but define their own forward stay float: {custom}", stacklevel=2)
        return plans

    def absent_layer_types(self, model: nn.Module) -> list[str]:
        """The keys of ``layer_type_quant_config`` that name no class of the model's modules (they configure nothing)."""
        present = {t for m in model.modules() for t in _type_names(m)}
        return [k for k in self.config.layer_type_quant_config if k not in present]

    def _warn_unmatched(self, model: nn.Module, names: list[str]) -> None:
        messages = [
            f"Config.{field_name} entries match no layer of the model (typo?): {dead}"
            for field_name, dead in unmatched_names(self.config, names).items()
        ]
        unused = self.absent_layer_types(model)
        if unused:
            messages.append(
                f"Config.layer_type_quant_config entries name layer types the model does not have, so they configure "
                f"nothing: {unused}; the model's quantizable layer types: {_layer_types(model)}"
            )
        for message in messages:
            if message not in self._warned:
                self._warned.add(message)
                warnings.warn(message, stacklevel=3)

    def _graph_plans(self, model: nn.Module) -> list[LayerPlan]:
        prepared = model if hasattr(model, "_graph_units") else graph.prepare_graph(self._require_graph(model), self.config)
        return [
            LayerPlan(u.name or "<top>", u.type_name or u.op, u.qconfig, u.source)
            for u in prepared._graph_units  # type: ignore[union-attr]
            if u.qconfig is not None
        ]  # fmt: skip

    def _require_graph(self, model: nn.Module) -> Any:
        if not graph.is_graph_module(model):
            raise graph.GraphModeError(
                f"quant_mode=fx_graph_mode works on a captured graph, got {type(model).__name__}: capture it first with "
                "quark.torch.quantization.graph.capture(model, example_inputs) (torch.export.export(model, args).module() "
                "works too), or pass it with a dataloader to quantize_model, which captures it on the first batch"
            )
        return model

    def float_layers(self, model: nn.Module) -> list[FloatLayer]:
        """Modules holding Parameters that stay float, each with the reason (excluded, unsupported type, ...); on a
        calibrated model also the Parameters a forward used functionally, outside any quantizer."""
        if self.graph_mode:
            prepared = model if hasattr(model, "_graph_float_layers") else graph.prepare_graph(self._require_graph(model), self.config)
            return list(prepared._graph_float_layers)  # type: ignore[arg-type]
        plans = self.resolve(model, warn=False)
        uses: dict[str, list[str]] = getattr(model, "_quant_functional_uses", {})
        out = []
        for f in _float_layers(self.config, model, {p.name for p in plans}):
            if f.reason.startswith("no quantized twin") and f.name in uses:
                f = FloatLayer(f.name, f.layer_type, f"no quantized twin for {f.layer_type}: Parameter {', '.join(uses[f.name])} used functionally")
            out.append(f)
        return out + _functional_float(model, uses)

    def summary(self, model: nn.Module) -> str:
        """A readable table of what resolution decides: layer, type, role -> dtype/qscheme/observer (source), then
        the layers that stay float and why."""
        plans = self.resolve(model)
        floats = format_float_layers(self.float_layers(model))
        return format_plans(plans) + (f"\n\n{floats}" if floats else "")

    # -- the two halves
    def prepare(self, model: nn.Module, name_prefix: str = "") -> nn.Module:
        """Swap every configured layer for its quantized twin (same Parameters), in place. Idempotent.

        Graph mode: returns a new, quantized graph module (same Parameter objects; conv + BatchNorm units simulate
        the folding for QAT); the captured graph passed in is left as it was. ``name_prefix``: what the graph's module
        names are under in the Config (``"net."`` for a captured ``self.net`` of a LightningModule)."""
        if self.graph_mode:
            prepared = graph.prepare_graph(self._require_graph(model), self.config, name_prefix)
            warn_float_layers(prepared._graph_float_layers, stacklevel=3)  # type: ignore[arg-type]
            return prepared
        return self._prepare(model, self.resolve(model))

    def _prepare(self, model: nn.Module, plans: list[LayerPlan]) -> nn.Module:
        floats = _float_layers(self.config, model, {p.name for p in plans})
        swapped: list[tuple[nn.Module, str, nn.Module]] = []
        try:
            for plan in plans:
                parent, attr = _parent_of(model, plan.name)
                original = getattr(parent, attr)
                twin = QUANT_MODULE_MAP[_float_type(original)].from_float(original, plan.qconfig)  # type: ignore[index]
                for slot, q in twin.quantizer_slots():
                    q.where = f"layer '{plan.name}' ({plan.layer_type}, {slot_label(slot)})"
                setattr(parent, attr, twin)
                swapped.append((parent, attr, original))
        except BaseException:
            _restore(swapped)
            raise
        model.quant_config = self.config
        for hook in PREPARE_HOOKS:
            hook(model)
        logger.info("prepared %d layer(s) for quantization", len(plans))
        warn_float_layers(floats, stacklevel=4)
        return model

    def calibrate(
        self,
        model: nn.Module,
        dataloader: Iterable[Any] | None = None,
        forward_loop: Callable[[nn.Module], Any] | None = None,
        max_batches: int | None = None,
    ) -> nn.Module:
        """Run the observers of a prepared model on calibration data (eval mode, no_grad), then fix static qparams.

        Weights and biases are observed directly; activations see ``dataloader``'s batches (or ``forward_loop(model)``).
        Weight-only and fully dynamic configs need no data. The model's train/eval mode is restored.
        """
        if self.graph_mode:  # PTQ: fold BatchNorm, then equalize, on the float function, before any statistic
            graph.fold_and_equalize(model, self.config)
        quantizers = [q for _, q in iter_quantizers(model)]
        needs_data = _needs_data(model)
        if needs_data:
            _check_data(dataloader, forward_loop)
        batches = self._algorithm_batches(dataloader, forward_loop, max_batches)
        with no_kv_cache(model):  # the forwards here are statistics, not generation: a KV cache would only grow
            self._calibrate(model, quantizers, needs_data, batches, dataloader, forward_loop, max_batches)
        return model

    def _calibrate(
        self, model: nn.Module, quantizers: list[FakeQuantizeBase], needs_data: bool, batches: list[Any] | None,
        dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None, max_batches: int | None,
    ) -> None:  # fmt: skip
        modes = [(m, m.training) for m in model.modules()]  # per module: a frozen BatchNorm stays in eval
        model.eval()
        try:
            if batches is not None:  # SmoothQuant / AWQ rescale the float weights: before any statistic is taken
                for q in quantizers:
                    q.enable_observer(False)
                    q.disable_fake_quant()
                _ALGORITHMS[0].before_calibration(model, self.config, batches, _model_device(model))
                dataloader, max_batches = batches, None
            for q in quantizers:
                q.enable_observer()
                q.disable_fake_quant()
            with torch.no_grad():
                _observe_params(model)
                if needs_data:
                    seen, record = _feed(model, dataloader, forward_loop, max_batches)
                    if dataloader is not None and seen == 0:
                        raise ValueError("the calibration dataloader yielded no batch; static activation quantization needs data")
                    _report_coverage(model, record)
        finally:
            for q in quantizers:
                q.enable_observer(q.is_dynamic)  # dynamic quantizers keep observing every call
                q.enable_fake_quant()
            for m, training in modes:
                m.training = training
        if batches is not None:  # GPTQ: on the calibrated model, it sets the weights and their qparams
            model.eval()
            try:
                _ALGORITHMS[0].after_calibration(model, self.config, batches, _model_device(model))
            finally:
                for m, training in modes:
                    m.training = training

    def _algorithm_batches(
        self, dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None, max_batches: int | None
    ) -> list[Any] | None:
        """The calibration batches as a list when the Config has algorithms (they pass over them several times)."""
        algos = self.config.algo_configs + [a for a in self.config.pre_quant_opt_configs if not isinstance(a, CLEConfig)]
        if not algos:
            return None
        names = [a.name for a in algos]  # type: ignore[attr-defined]
        if not _ALGORITHMS:
            raise RuntimeError(f"{names} need quark.torch.algorithm: `import quark.torch` registers it")
        if dataloader is None:
            raise ValueError(f"{names} need calibration batches: pass a dataloader (a forward_loop cannot be replayed per layer)")
        batches = list(itertools.islice(dataloader, max_batches))
        if not batches:
            raise ValueError(f"{names}: the calibration dataloader yielded no batch")
        return batches

    def quantize_model(
        self,
        model: nn.Module,
        dataloader: Iterable[Any] | None = None,
        forward_loop: Callable[[nn.Module], Any] | None = None,
        max_batches: int | None = None,
    ) -> nn.Module:
        """Prepare and calibrate ``model`` in place and return it. On failure the model is left as it was.

        Graph mode: returns the quantized graph module (a plain ``nn.Module`` is first captured with the first
        calibration batch as example input); the model passed in is not changed."""
        if self.graph_mode:
            return self._quantize_graph(model, dataloader, forward_loop, max_batches)
        plans = self.resolve(model)
        if any(_plan_needs_data(p) for p in plans):
            _check_data(dataloader, forward_loop)
        originals = {p.name: _get_submodule(model, p.name) for p in plans}
        had_config = hasattr(model, "quant_config")
        # algorithms change weights (and norms) in place: keep their values to put back on failure
        saved = (
            [(t, t.detach().clone()) for t in itertools.chain(model.parameters(), model.buffers())]
            if self.config.algo_configs or self.config.pre_quant_opt_configs else []
        )  # fmt: skip
        try:
            self._prepare(model, plans)
            self.calibrate(model, dataloader, forward_loop, max_batches)
        except BaseException:
            for name, module in originals.items():
                parent, attr = _parent_of(model, name)
                setattr(parent, attr, module)
            with torch.no_grad():
                for tensor, value in saved:
                    tensor.copy_(value)
            if not had_config and "quant_config" in model.__dict__:
                del model.quant_config
            raise
        return model

    def _quantize_graph(
        self, model: nn.Module, dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None, max_batches: int | None
    ) -> nn.Module:
        if not graph.is_graph_module(model):
            if dataloader is None:
                self._require_graph(model)
            first = next(iter(dataloader), None)  # type: ignore[arg-type]
            if first is None:
                raise ValueError("the calibration dataloader yielded no batch; graph capture needs an example input")
            example = _to_device(first[0] if isinstance(first, list | tuple) else first, _model_device(model))
            if isinstance(example, dict):  # called as model(**batch) (Hugging Face models): captured with keywords
                model = graph.capture(model, (), example)
            else:
                model = graph.capture(model, example)
        return self.calibrate(self.prepare(model), dataloader, forward_loop, max_batches)  # it checks the data

    @staticmethod
    def freeze(model: nn.Module, bake_weights: bool = False) -> nn.Module:
        """Fix every quantizer for inference (observers leave the forward path) and return the model.

        ``bake_weights=True`` also writes the quantized weights into the float weight tensors (in place) and puts a
        ``BakedFakeQuantize`` in their slots, which passes the weight through, so inference does not re-quantize them
        on every call; it keeps the spec and qparams, so the exports store the same codes and scales as an unbaked
        frozen model. Two kinds of weights keep their frozen quantizer: one computed at each forward (weight_norm's:
        there is no stored tensor to write) and one another module holds too (an lm_head tied to the input
        embeddings, which need its float values). Conv + BatchNorm units of graph mode become plain convs with the
        folded weights first.
        """
        graph.fold_batch_norms(model)
        unreached = uncalibrated_layers(model)  # checked before anything is changed
        if unreached:
            warnings.warn(
                f"layer(s) that no calibration or training forward reached run in float from now on (their activation "
                f"quantizers have no qparams; size reports count them as float): {sorted(unreached)}. Calibrate with "
                "data that reaches them to quantize them.",
                stacklevel=2,
            )
        shared = shared_tensors(model)
        for name, module in model.named_modules():
            if not isinstance(module, QuantMixin):
                continue
            if name in unreached:
                for slot, _ in list(module.quantizer_slots()):
                    module.set_quantizer(slot, None)
                module._quant_unreached = True
                continue
            for slot, q in list(module.quantizer_slots()):
                frozen = q.to_frozen()
                if not q.is_dynamic:
                    frozen.enable_observer(False)  # block formats and casts: nothing left to record
                if bake_weights and bakeable(module, slot, shared):
                    tensor = getattr(module, slot.tensor)
                    with torch.no_grad():
                        tensor.copy_(frozen(tensor))
                    frozen = BakedFakeQuantize.of(frozen)
                module.set_quantizer(slot, frozen)
        return model


# ----------------------------------------------------------------------------------------------- helpers
_ACTIVATION_ROLES = ("input_tensors", "output_tensors")


def uncalibrated_layers(model: nn.Module) -> set[str]:
    """Names of the quantized layers that calibration (or QAT) never reached: none of their static activation
    quantizers has qparams (their weight quantizers may have them: PTQ observes weights directly, QAT in the forward).

    Raises a ValueError naming the layer and role for a layer that was reached (an activation quantizer has qparams)
    but has a quantizer without them, and when no quantizer of the model has qparams (it was never calibrated)."""
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


def qparams_source(spec: QuantizationSpec) -> str:
    """What sets a spec's qparams, as one token: its observer, or for QAT specs the learned quantity and how it is
    initialised (TQT and LSQ learn from the first batch on; the spec's observer_cls is not used by them)."""
    if isinstance(spec.qat_spec, TQTSpec):
        init = spec.qat_spec.threshold_init_meth or TQTThresholdInitMeth._3SD
        return f"TQT(learned,init={init.name})"
    if isinstance(spec.qat_spec, LSQSpec):
        return "LSQ(learned,init=2mean|x|/sqrt(qmax))"
    return spec.observer_cls.__name__ if spec.observer_cls else "-"


def format_plans(plans: list[LayerPlan]) -> str:
    """Plans as a fixed-width table."""
    rows = [("layer", "type", "role", "dtype", "qscheme", "observer", "from")]
    for plan in plans:
        for role in ROLES:
            spec: QuantizationSpec | None = getattr(plan.qconfig, role)
            if spec is None:
                continue
            qscheme = spec.qscheme.name if spec.qscheme else "-"
            if spec.group_size is not None and spec.qscheme == QSchemeType.per_group:
                qscheme += f"(g{spec.group_size})"
            dtype = spec.dtype.name + (f"[{spec.mx_element_dtype.name}]" if spec.mx_element_dtype else "")
            dtype += ", dynamic" if spec.is_dynamic else ""
            rows.append((plan.name, plan.layer_type, role, dtype, qscheme, qparams_source(spec), plan.source[role]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _get_submodule(model: nn.Module, name: str) -> nn.Module:
    return model if name == "" else model.get_submodule(name)


def _parent_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    if name == "":
        raise ValueError("the model itself is a single layer; wrap it in a container module to quantize it")
    parent_name, _, attr = name.rpartition(".")
    return _get_submodule(model, parent_name), attr


def _restore(swapped: list[tuple[nn.Module, str, nn.Module]]) -> None:
    for parent, attr, original in reversed(swapped):
        setattr(parent, attr, original)


def _spec_needs_data(spec: QuantizationSpec | None) -> bool:
    """A static activation spec with a scale (or a learnable one, initialised from data) needs calibration data."""
    return spec is not None and not spec.is_dynamic and is_scaled(spec.dtype)


def _plan_needs_data(plan: LayerPlan) -> bool:
    return _spec_needs_data(plan.qconfig.input_tensors) or _spec_needs_data(plan.qconfig.output_tensors)


def _needs_data(model: nn.Module) -> bool:
    """Whether calibration must run the model: a static activation quantizer, or a weight quantizer of a slot that
    holds no Parameter (graph mode's functional weight: the weight reaches it only through the forward)."""
    return any(
        _spec_needs_data(q.spec)
        for m in model.modules()
        if isinstance(m, QuantMixin)
        for slot, q in m.quantizer_slots()
        if slot.role in _ACTIVATION_ROLES or slot.tensor is None
    )


def _check_data(dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None) -> None:
    if dataloader is None and forward_loop is None:
        raise ValueError(
            "static activation quantization needs calibration data: pass a dataloader (or a forward_loop(model) "
            "callable), or make the activation specs dynamic (is_dynamic=True) or weight-only"
        )
    if dataloader is not None and hasattr(dataloader, "__len__") and len(dataloader) == 0:  # type: ignore[arg-type]
        raise ValueError("the calibration dataloader is empty; static activation quantization needs data")


def _observe_params(model: nn.Module) -> None:
    """Weights and biases are observed once, directly (no data needed)."""
    refresh_computed_tensors(model)
    for m in model.modules():
        if isinstance(m, QuantMixin):
            for param, q in m.param_quantizers():
                tensor = getattr(m, param, None)
                if isinstance(tensor, torch.Tensor):
                    observer = getattr(q, "observer", None)
                    if observer is not None:
                        observer.reset_state()  # statistics of the current values only, not of earlier ones
                    q(tensor)
                    if not q.is_dynamic:
                        q.disable_observer()


def _feed(
    model: nn.Module, dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None, max_batches: int | None
) -> tuple[int, dict[str, Any]]:
    """Run the calibration data; returns the batch count and what the forwards reached (see ``track_forward``:
    functional uses of Parameters are looked for on the first batch only, which is enough and keeps the rest fast)."""
    record: dict[str, Any] = {"reached": set(), "functional": {}}
    if forward_loop is not None:
        with track_forward(model, functional=True) as seen_by_loop:
            forward_loop(model)
        return 1, seen_by_loop
    device = _model_device(model)
    seen = 0
    if max_batches is not None and max_batches <= 0:
        return 0, record
    for batch in dataloader:  # type: ignore[union-attr]
        with track_forward(model, functional=seen == 0) as one:
            run_batch(model, batch, device)
        record["reached"] |= one["reached"]
        record["functional"].update(one["functional"])
        seen += 1
        if max_batches is not None and seen >= max_batches:
            break  # before asking the loader for a batch that would not be used
    return seen, record


def _report_coverage(model: nn.Module, record: dict[str, Any]) -> None:
    """After calibration: warn about quantized layers no forward reached (marked so size reports count them as
    float) and about Parameters that a forward fed to a weight op with no quantizer between (kept on the model for
    ``float_layers``)."""
    unreached = unreached_layers(model, record["reached"])
    if unreached:
        warnings.warn(
            f"quantized layer(s) that no forward reached during calibration (their quantizers saw no data, so they are "
            f"not counted as quantized): {unreached}",
            stacklevel=4,
        )
    uses: dict[str, list[str]] = {}
    for param, op in record["functional"].items():
        owner, _, attr = param.rpartition(".")
        uses.setdefault(owner, []).append(f"'{attr}' ({op})")
    model._quant_functional_uses = uses
    tied = [f for f in _functional_float(model, uses) if f.layer_type.startswith("Quant")]
    warn_float_layers(tied, stacklevel=4)


def _functional_float(model: nn.Module, uses: dict[str, list[str]]) -> list[FloatLayer]:
    """Float entries for the Parameters of quantized layers that a forward also used outside the layer."""
    out = []
    for owner, found in uses.items():
        module = _get_submodule(model, owner)
        if isinstance(module, QuantMixin):
            out.append(FloatLayer(owner, type(module).__name__, f"Parameter {', '.join(found)} also used outside the layer, float there"))
    return out
