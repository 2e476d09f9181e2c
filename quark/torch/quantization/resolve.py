"""How the Config's levels combine for one layer: the one rule eager mode and graph mode share.

``levels`` are the entries that match the layer, most specific first (layer name, owner, layer type, global). With
``Config.inherit_roles=False`` (amd-quark's rule) the first entry is the layer's whole QuantizationConfig, so a role
left None there is not quantized. With ``inherit_roles=True`` each role is taken from the first entry that sets it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec

__all__ = ["merge_levels", "config_from_stored"]


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
