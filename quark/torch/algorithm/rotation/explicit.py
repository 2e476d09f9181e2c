"""The rotation plan from amd-quark's explicit ``RotationConfig.scaling_layers`` (``first_layer`` for layer 0,
``middle_layers`` for every later layer, ``last_layer`` once with ``layer_id`` the last layer; ``layer_id`` and
``pre_layer_id`` stand for a layer's index and the one before). Names may be full or suffixes of full names (a
LightningModule's ``net.model.layers.0...`` matches ``model.layers.0...``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from quark.torch.algorithm.rotation.sites import HeadSite, RotationPlan, check_rms_norm, head_dim_of
from quark.torch.quantization.hf import is_linear, linear_weight

if TYPE_CHECKING:
    from quark.torch.quantization.config.config import RotationConfig

__all__ = ["explicit_plan"]


def _substitute(name: str, layer: int) -> str:
    """``name`` with its ``layer_id`` / ``pre_layer_id`` parts replaced by ``layer`` / ``layer - 1``."""
    parts = {"layer_id": str(layer), "pre_layer_id": str(layer - 1)}
    return ".".join(parts.get(p, p) for p in name.split("."))


def _resolve(name: str, names: list[str], where: str) -> str:
    """The full module name ``name`` stands for (itself, or the one module ending with ``.name``); ValueError."""
    found = [n for n in names if n == name or n.endswith("." + name)]
    if len(found) != 1:
        raise ValueError(
            f"rotation: RotationConfig.scaling_layers{where} names {name!r}, which matches "
            f"{'no module' if not found else found} of the model (give a full or unique name)"
        )
    return found[0]


def explicit_plan(model: nn.Module, config: RotationConfig, stack_name: str, stack: nn.ModuleList) -> RotationPlan:
    """The plan ``config.scaling_layers`` describes (R2 / R4 sites from ``v_proj``, ``o_proj`` and ``mlp``).

    Raises:
        ValueError: For a name matching no module (or several), a prev module that is neither an embedding nor a
            linear, or a norm that is no RMS norm.
    """
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    layers = config.scaling_layers or {}
    steps = [(i, "first_layer" if i == 0 else "middle_layers") for i in range(len(stack))]
    steps.append((len(stack) - 1, "last_layer"))
    embeddings: list[str] = []
    readers: list[str] = []
    writers: list[str] = []
    norms: list[tuple[str, tuple[str, ...]]] = []
    for layer, part in steps:
        for j, entry in enumerate(layers.get(part, [])):
            where = f"[{part!r}][{j}] (layer {layer})"
            if entry.get("target_modules") and not entry.get("next_modules"):
                raise ValueError(f"rotation: scaling_layers{where} has target_modules only (online R1): not supported")
            nexts = [_resolve(_substitute(n, layer), names, where) for n in entry.get("next_modules", [])]
            for prev in entry.get("prev_modules", []):
                full = _resolve(_substitute(prev, layer), names, where)
                if isinstance(modules[full], nn.Embedding | nn.Linear) or is_linear(modules[full]):
                    target = embeddings if isinstance(modules[full], nn.Embedding) else writers
                    if full not in target:
                        target.append(full)
                else:
                    raise ValueError(f"rotation: scaling_layers{where} prev module {full} is no Embedding or Linear")
            if entry.get("norm_module"):
                norm = _resolve(_substitute(entry["norm_module"], layer), names, where)
                check_rms_norm(norm, modules[norm], "explicit")
                norms.append((norm, tuple(nexts)))
            readers.extend(n for n in nexts if n not in readers)
    heads, downs = [], []
    for i in range(len(stack)):
        prefix = f"{stack_name}.{i}"
        attn = modules.get(f"{prefix}.{config.self_attn}")
        if attn is not None and f"{prefix}.{config.v_proj}" in modules:
            heads.append(HeadSite(f"{prefix}.{config.v_proj}", f"{prefix}.{config.o_proj}", head_dim_of(prefix, attn)))
        if f"{prefix}.{config.mlp}.down_proj" in modules:
            downs.append(f"{prefix}.{config.mlp}.down_proj")
    if not readers:
        raise ValueError("rotation: RotationConfig.scaling_layers names no next_modules")
    hidden = linear_weight(modules[readers[0]]).shape[1]
    return RotationPlan(
        hidden, tuple(embeddings), tuple(readers), tuple(writers), tuple(norms), tuple(heads), tuple(downs), "explicit"
    )
