"""The names a model's tensors have in its hub checkpoint, for models whose layers a twin stores in parts (fused MoE
experts: one expert's gate, up and down projections each stored as a Linear of its own).

transformers 5 fuses the per-expert tensors of the hub checkpoints when it loads them, and ``save_pretrained`` splits
them again (``revert_weight_conversion``, the family's entry in ``transformers.conversion_mapping``): Mixtral, PhiMoE
and MiniMax write ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) beside
``block_sparse_moe.gate``, the Qwen2-MoE group (Qwen3-MoE, OLMoE, DeepSeek-V2/V3, ...) ``mlp.experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj``. ``checkpoint_names`` runs that very reversal on stand-in tensors (each expert's block
marked by its value, every other tensor as it is) and reads off where each expert's projections and every other
tensor go: nothing is written here per family. A family whose conversion does not split the experts (no entry, or a
model that is not a transformers model) cannot be named: a ValueError says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from quark.torch.extras import import_extra
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QUANT_MODULE_MAP, QuantSlot
from quark.torch.quantization.resolve import float_type

__all__ = ["CheckpointNames", "checkpoint_names", "part_layers"]


def part_layers(model: nn.Module) -> dict[str, tuple[tuple[str, QuantSlot, QuantSlot | None], ...]]:
    """Layer name -> its Linear-equivalent parts (``QuantMixin.linear_parts_for``), for every layer of ``model``,
    prepared (a twin) or float (the twin it would get), that is stored in parts."""
    out = {}
    for name, module in model.named_modules():
        twin = type(module) if isinstance(module, QuantMixin) else QUANT_MODULE_MAP.get(float_type(module))  # type: ignore[arg-type]
        parts = twin.linear_parts_for(module) if twin is not None else ()
        if parts:
            out[name] = parts
    return out


@dataclass
class CheckpointNames:
    """Our names -> the hub checkpoint's: state-dict keys, module names (of every module with a ``weight`` key: the
    quantized layers' companions ``weight_scale`` / ``input_scale`` go beside it), the module name of each part
    ``"<layer>.<part>"`` (``"model.layers.0.mlp.experts.3.gate_proj"`` -> ``"...block_sparse_moe.experts.3.w1"``) and
    of each layer stored in parts (``"...block_sparse_moe.experts"``)."""

    keys: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)
    parts: dict[str, str] = field(default_factory=dict)
    layers: dict[str, str] = field(default_factory=dict)
    #: the state-dict keys stored as parts (the stacked Parameters)
    stacked: set[str] = field(default_factory=set)

    def hub_key(self, key: str) -> str:
        """The hub name of one of our keys: a state-dict key, or ``<module or part>.<companion>``."""
        if key in self.keys:
            return self.keys[key]
        module, _, leaf = key.rpartition(".")
        for table in (self.parts, self.modules):
            if module in table:
                return f"{table[module]}.{leaf}"
        raise ValueError(f"'{key}' has no name in the hub checkpoint (neither a tensor nor a layer of the model)")

    def our_key(self, hub: str) -> str:
        """Our name of a hub key (``hub_key`` reversed); a key of neither kind is returned as it is (the import's
        checks then name it as a tensor that belongs to no layer)."""
        back = self._inverse
        if hub in back["keys"]:
            return back["keys"][hub]
        module, _, leaf = hub.rpartition(".")
        for table in (back["parts"], back["modules"]):
            if module in table:
                return f"{table[module]}.{leaf}"
        return hub

    def layer(self, name: str, inverse: bool = False) -> str:
        """A module name (a layer stored in parts included) in the hub checkpoint (``inverse``: back to ours); a name
        with none (a pattern, a module without a weight) as it is."""
        table = self._inverse["layers"] if inverse else {**self.modules, **self.layers}
        return table.get(name, name)

    @cached_property
    def _inverse(self) -> dict[str, dict[str, str]]:
        """Each table reversed (hub name -> ours), built once."""
        return {
            "keys": {v: k for k, v in self.keys.items()},
            "parts": {v: k for k, v in self.parts.items()},
            "modules": {v: k for k, v in self.modules.items()},
            "layers": {v: k for k, v in {**self.modules, **self.layers}.items()},
        }


def _stand_ins(
    model: nn.Module, layers: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[int, str], dict[int, tuple[str, str]]]:
    """The state dict handed to transformers' reversal: each stacked Parameter as [E, parts per expert, 1] values that
    mark (layer, part), every other tensor as itself (a detached view: its identity names it). Returns it, id -> key
    of the others, and mark -> (layer, part)."""
    state: dict[str, torch.Tensor] = {}
    marks: dict[int, tuple[str, str]] = {}
    for name, parts in layers.items():
        by_tensor: dict[str, list[tuple[str, QuantSlot]]] = {}
        for part, weight, _ in parts:
            by_tensor.setdefault(weight.tensor, []).append((part, weight))  # type: ignore[arg-type]
        for tensor, blocks in by_tensor.items():
            experts = 1 + max(w.part.index for _, w in blocks)  # type: ignore[union-attr]
            starts = sorted({w.part.start for _, w in blocks})  # type: ignore[union-attr]
            values = torch.full((experts, len(starts), 1), -1.0)
            for part, w in blocks:
                marks[len(marks)] = (name, part)
                values[w.part.index, starts.index(w.part.start), 0] = float(len(marks) - 1)  # type: ignore[union-attr]
            state[f"{name}.{tensor}" if name else tensor] = values
    ids: dict[int, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key not in state and "_quantizer." not in key:
            state[key] = value.detach()
            ids[id(state[key])] = key
    return state, ids, marks


def _common_module(hubs: list[str]) -> str:
    """The module the hub names of one layer's parts share (``...experts.3.w1``, ``...experts.5.w2`` ->
    ``...experts``; an expert index left at the end, as with a single expert, dropped)."""
    split = [h.split(".") for h in hubs]
    common = []
    for column in zip(*split, strict=False):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    while common and common[-1].isdigit() and len(common) == min(len(s) for s in split) - 1:
        common.pop()
    return ".".join(common)


def checkpoint_names(model: nn.Module) -> CheckpointNames | None:
    """The hub names of ``model``'s tensors (see the module docstring); None when no layer is stored in parts (the
    exports keep the state-dict names). A ValueError names the layer when transformers' conversion does not give
    its parts names."""
    layers = part_layers(model)
    if not layers:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    first = next(iter(layers))
    refusal = (
        f"the experts of layer '{first}' ({type(model.get_submodule(first)).__name__}) are stored one by one under the "
        f"names transformers' checkpoint conversion gives the family's hub checkpoints (model_type {model_type!r})"
    )
    core = import_extra("transformers.core_model_loading", "hf", "the hub names of fused MoE experts")
    state, ids, marks = _stand_ins(model, layers)
    try:
        reverted = core.revert_weight_conversion(model, state)
    except Exception as err:  # not a transformers model, a conversion that needs the real tensors: no names
        raise ValueError(f"{refusal}; it failed on this model: {err}") from err
    names = CheckpointNames(stacked={k for k in state if id(state[k]) not in ids})
    for hub, value in reverted.items():
        if id(value) in ids:
            names.keys[ids[id(value)]] = hub
        elif value.numel() == 1 and hub.endswith(".weight") and int(value.item()) in marks:
            layer, part = marks[int(value.item())]
            names.parts[f"{layer}.{part}" if layer else part] = hub.removesuffix(".weight")
    if len(names.parts) != len(marks):
        unnamed = sorted({layer for layer, _ in marks.values()})
        raise ValueError(
            f"{refusal}; for this model it does not split {unnamed} into per-expert tensors, so they have no names. "
            "custom_mode=None writes this project's single file, which stores them under the model's own names"
        )
    for key, hub in names.keys.items():
        if key.endswith(".weight") and hub.endswith(".weight"):
            names.modules[key.removesuffix(".weight")] = hub.removesuffix(".weight")
    for layer in layers:
        names.layers[layer] = _common_module([v for k, v in names.parts.items() if k.startswith(f"{layer}.")])
    return names
