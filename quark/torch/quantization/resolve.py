"""Resolution: which QuantizationConfig each layer gets, the one rule eager mode and graph mode share.

Per layer, the first of ``layer_quant_config`` (exact name, then fnmatch patterns in the order given),
``layer_type_quant_config`` (the class name, or a base class's) and ``global_quant_config`` that matches is the
layer's QuantizationConfig (amd-quark's rule). ``levels`` are those entries, most specific first; with
``Config.inherit_roles=False`` (amd-quark's rule) the first entry is the layer's whole QuantizationConfig, so a role
left None there is not quantized. With ``inherit_roles=True`` each role is taken from the first entry that sets it
(``merge_levels``). ``exclude`` (fnmatch, ``excluded``) leaves a layer float. A ``kv_cache_quant_config`` entry
(``kv_cache_entry``) comes before all of these, and an excluded layer it matches keeps its output quantizer only
(amd-quark's ``setup_kv_cache_config``). Also here: the shape checks of the
specs against the layer's tensors (``check_layer``) and against the activations of one forward
(``check_activation_shapes``), and the plans as a table (``format_plans``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.config import Config, LSQSpec, QuantizationConfig, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import QSchemeType, TQTThresholdInitMeth
from quark.torch.quantization.formats import BLOCK_FORMATS
from quark.torch.quantization.hf import hf_conv1d_class, hf_linear_equivalent, is_hf_conv1d, no_kv_cache
from quark.torch.quantization.nn.modules.quant_modules import (
    EXPLICIT_ONLY,
    QUANT_MODULE_MAP,
    QuantHFConv1DMixin,
    QuantLinear,
    QuantMixin,
    iter_quantizers,
    slot_tensor,
    slot_tensor_name,
    structural_twin,
    twin_of_foreign_class,
)
from quark.torch.quantization.state import paused_quantizers, preserve_modes
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "LayerPlan",
    "merge_levels",
    "config_from_stored",
    "excluded",
    "kv_cache_entry",
    "layer_matches",
    "name_levels",
    "type_level",
    "explicit_levels",
    "resolve_layer",
    "unmatched_names",
    "type_names",
    "float_type",
    "layer_types",
    "custom_forward_layers",
    "owners",
    "check_layer",
    "activation_axes_to_check",
    "check_activation_shapes",
    "qparams_source",
    "format_plans",
    "submodule",
    "parent_of",
]

ROLES = QuantizationConfig.ROLES


@dataclass(frozen=True)
class LayerPlan:
    """What resolution decided for one layer."""

    name: str
    layer_type: str
    qconfig: QuantizationConfig
    source: dict[str, str]  # role -> "layer 'pattern'" | "type 'Linear'" | "global"


# ----------------------------------------------------------------------------------------------- levels
def merge_levels(
    levels: Sequence[tuple[str, QuantizationConfig]], roles: Collection[str], inherit: bool
) -> tuple[QuantizationConfig | None, dict[str, str]]:
    """The QuantizationConfig of one layer from its matching ``levels`` (``(where, config)``, most specific first),
    restricted to the tensor ``roles`` the layer has, and which level each quantized role came from. None when no
    role ends up quantized."""
    used = list(levels) if inherit else list(levels[:1])
    chosen: dict[str, QuantizationSpec | None] = dict.fromkeys(QuantizationConfig.ROLES)
    source: dict[str, str] = {}
    for role in QuantizationConfig.ROLES:
        if role not in roles:
            continue
        for where, qc in used:
            spec = getattr(qc, role)
            if spec is not None:
                chosen[role], source[role] = spec, where
                break
    if not any(chosen.values()):
        return None, {}
    target = next((qc.target_device for _, qc in used if qc.target_device is not None), None)
    return QuantizationConfig(**chosen, target_device=target), source


def config_from_stored(data: dict[str, Any]) -> Config:
    """A Config this project stored (export metadata, checkpoint state). Files written before ``inherit_roles``
    existed were resolved role by role, so a stored config without the key keeps that rule."""
    if isinstance(data, dict) and "inherit_roles" not in data:
        data = {**data, "inherit_roles": True}
    return Config.from_dict(data)


def excluded(config: Config, name: str) -> bool:
    """Whether ``Config.exclude`` (fnmatch patterns of a full module name) leaves the layer ``name`` float."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in config.exclude)


def kv_cache_entry(config: Config, name: str) -> tuple[str, QuantizationConfig] | None:
    """The ``kv_cache_quant_config`` entry of the layer ``name`` as ``(pattern, config)``: the last pattern that
    matches (amd-quark's loop assigns each match in turn), or None."""
    found = None
    for pattern, qc in config.kv_cache_quant_config.items():
        if fnmatch.fnmatchcase(name, pattern):
            found = (pattern, qc)
    return found


def layer_matches(config: Config, name: str) -> list[str]:
    """Keys of layer_quant_config that match ``name``: the exact name first, then patterns in the order given."""
    exact = [k for k in config.layer_quant_config if k == name]
    patterns = [k for k in config.layer_quant_config if k != name and fnmatch.fnmatchcase(name, k)]
    return exact + patterns


def name_levels(config: Config, name: str) -> list[tuple[str, QuantizationConfig]]:
    """The ``layer_quant_config`` levels that match the layer ``name``, most specific first."""
    return [(f"layer '{k}'", config.layer_quant_config[k]) for k in layer_matches(config, name)]


def type_level(config: Config, names: Sequence[str]) -> list[tuple[str, QuantizationConfig]]:
    """The ``layer_type_quant_config`` level of the first of the class ``names`` (the layer's class, then its bases)
    that has one, as a list of zero or one level."""
    key = next((t for t in names if t in config.layer_type_quant_config), None)
    return [] if key is None else [(f"type '{key}'", config.layer_type_quant_config[key])]


def unmatched_names(config: Config, names: list[str]) -> dict[str, list[str]]:
    """The ``layer_quant_config`` / ``exclude`` entries (fnmatch patterns of a full module name) that match none of
    the module ``names``, per field (fields with none left out). The engine warns about them, as amd-quark does;
    the app refuses them."""
    out = {}
    for field_name, keys in (
        ("layer_quant_config", list(config.layer_quant_config)),
        ("exclude", list(config.exclude)),
    ):
        dead = [k for k in keys if not any(fnmatch.fnmatchcase(n, k) for n in names)]
        if dead:
            out[field_name] = dead
    return out


# ----------------------------------------------------------------------------------------------- eager layers
def type_names(module: nn.Module) -> list[str]:
    """The class names ``layer_type_quant_config`` matches a module by: its class, then its bases (nn.Module left out)."""
    return [c.__name__ for c in type(module).__mro__ if issubclass(c, nn.Module) and c is not nn.Module]


def float_type(module: nn.Module) -> type[nn.Module] | None:
    """The supported float class ``module`` is (or subclasses without its own forward), else None. A class without a
    twin, or subclassing a supported class with a forward of its own, whose module has a structure a twin is
    registered for (``register_structural_twin``: fused MoE experts, MoE routers such as Llama4's ``nn.Linear``
    subclass) gets its twin here, made on first sight."""
    conv1d, linear = hf_conv1d_class(type(module)), hf_linear_equivalent(type(module))
    if conv1d is not None and conv1d not in QUANT_MODULE_MAP and is_hf_conv1d(module):
        twin_of_foreign_class(conv1d, QuantHFConv1DMixin)  # transformers' Conv1D: its twin is made on first sight
    elif linear is not None and linear not in QUANT_MODULE_MAP:
        twin_of_foreign_class(linear, QuantLinear)
    for cls in type(module).__mro__:
        if cls in QUANT_MODULE_MAP:
            if type(module).forward is cls.forward:
                return cls
            if isinstance(module, QuantMixin):
                return None  # a twin already
            break  # its own forward: a twin of ``cls`` would drop it; only a structural twin keeps it
    base, _ = structural_twin(module)
    if base is not None:
        twin_of_foreign_class(type(module), base)
        return type(module)
    return None


def _own_float_type(module: nn.Module) -> type[nn.Module] | None:
    """The float class of a layer, a quantized twin's being the class it was made from (None for a twin of no layer
    type: an attention's probabilities)."""
    if isinstance(module, QuantMixin):
        return module._float_class if module._float_class in QUANT_MODULE_MAP else None
    return float_type(module)


def layer_types(model: nn.Module) -> list[str]:
    """The supported float types of the model's layers (a quantized twin counts as its float type), sorted."""
    return sorted({t.__name__ for t in map(_own_float_type, model.modules()) if t is not None})


def custom_forward_layers(model: nn.Module) -> list[str]:
    """Subclasses of supported layers with their own forward: swapping would drop that forward, so they stay float."""
    return [
        name
        for name, m in model.named_modules()
        if float_type(m) is None
        and not isinstance(m, QuantMixin)
        and any(c in QUANT_MODULE_MAP for c in type(m).__mro__)
    ]


def explicit_levels(
    config: Config, name: str, module: nn.Module
) -> tuple[list[tuple[str, QuantizationConfig]], list[tuple[str, QuantizationConfig]]]:
    """The layer-name levels and the layer-type level that match one module, most specific first."""
    return name_levels(config, name), type_level(config, type_names(module))


def owners(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Child name -> (owner name, owner) for the children a twin owns (an attention's ``out_proj``): they follow
    the owner's configuration unless named themselves."""
    found = {}
    for name, module in model.named_modules():
        ftype = _own_float_type(module)
        for child in QUANT_MODULE_MAP[ftype].owned_children if ftype else ():
            if isinstance(getattr(module, child, None), nn.Module):
                found[f"{name}.{child}" if name else child] = (name, module)
    return found


def resolve_layer(
    config: Config, name: str, module: nn.Module, owner: tuple[str, nn.Module] | None = None
) -> LayerPlan | None:
    """The merged QuantizationConfig of one layer, or None when it stays float."""
    ftype = float_type(module)
    if ftype is None or isinstance(module, QuantMixin):
        return None
    kv = kv_cache_entry(config, name)
    if excluded(config, name) or (owner is not None and excluded(config, owner[0])):
        if kv is None:
            return None
        only_output = QuantizationConfig(output_tensors=kv[1].output_tensors)
        return LayerPlan(name, ftype.__name__, only_output, {"output_tensors": f"kv_cache '{kv[0]}' (layer excluded)"})
    by_name, by_type = explicit_levels(config, name, module)
    levels = [(f"kv_cache '{kv[0]}'", kv[1])] if kv is not None else []
    levels += by_name
    if owner is not None:
        owner_name, owner_type = explicit_levels(config, *owner)
        levels += [(f"{where} (owner)", qc) for where, qc in owner_name + owner_type]
    levels += by_type
    if ftype in EXPLICIT_ONLY and not levels:
        return None  # embeddings only when named by type or layer
    levels.append(("global", config.global_quant_config))
    roles = {slot.role for slot in QUANT_MODULE_MAP[ftype].slots_for(module)}
    qconfig, source = merge_levels(levels, roles, config.inherit_roles)
    if qconfig is None:
        return None
    return LayerPlan(name, ftype.__name__, qconfig, source)


def check_layer(plan: LayerPlan, module: nn.Module) -> None:
    """Shape checks of the weight/bias specs against the layer's tensors (activations are checked when seen)."""
    twin = QUANT_MODULE_MAP[float_type(module)]  # type: ignore[index]
    for slot in twin.slots_for(module):
        spec: QuantizationSpec | None = twin.slot_spec(slot, getattr(plan.qconfig, slot.role))
        tensor = slot_tensor(module, slot)
        if spec is None or not isinstance(tensor, torch.Tensor):
            continue
        where = f"layer '{plan.name}' ({plan.layer_type}, {slot_tensor_name(slot)} of shape {tuple(tensor.shape)})"
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


# ----------------------------------------------------------------------------------------------- activations
_AXIS_SCHEMES = (QSchemeType.per_channel, QSchemeType.per_group)


def _activation_shape_error(q: FakeQuantizeBase, role: str, x: Any) -> str | None:
    """Why the activation ``x`` does not fit the spec of ``q`` (its channel axis, a per_block 2-D shape), or None."""
    spec = q.spec
    if not isinstance(x, torch.Tensor):
        return None
    shape = tuple(x.shape)
    where = q.where if role in q.where else f"{q.where} ({role})"
    if (
        spec.qscheme in _AXIS_SCHEMES
        and spec.ch_axis is not None
        and not -max(x.ndim, 1) <= spec.ch_axis < max(x.ndim, 1)
    ):
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

    def check(role: str) -> Callable[..., None]:
        def hook(q: FakeQuantizeBase, args: tuple[Any, ...]) -> None:
            problem = _activation_shape_error(q, role, args[0] if args else None)
            if problem:
                raise ValueError(problem)

        return hook

    hooks = [
        q.register_forward_pre_hook(check(role))
        for role, q in quantizers
        if role in ("input_tensors", "output_tensors")
    ]
    try:  # a float run: no qparams are computed from old statistics
        with (
            paused_quantizers(model, fake_quant=True),
            preserve_modes(model, mode=False),
            torch.no_grad(),
            no_kv_cache(model),
        ):
            feed(model)
    finally:
        for h in hooks:
            h.remove()
    return True


# ----------------------------------------------------------------------------------------------- plans
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


# ----------------------------------------------------------------------------------------------- module tree
def submodule(model: nn.Module, name: str) -> nn.Module:
    """The module ``name`` of ``model`` (``""``: the model itself)."""
    return model if name == "" else model.get_submodule(name)


def parent_of(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding the layer ``name`` and its attribute name there (what a layer swap sets)."""
    if name == "":
        raise ValueError("the model itself is a single layer; wrap it in a container module to quantize it")
    parent_name, _, attr = name.rpartition(".")
    return submodule(model, parent_name), attr
