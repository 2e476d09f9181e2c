"""``quant.layer_bits``: per-layer (or per-group-of-layers) weight widths and formats on top of a preset.

    python train.py +quant.layer_bits.fc1=3 +quant.layer_bits.conv2=4          # the digits CNN: net.fc1, net.conv2
    python train.py experiment=char_lm quant=int4_per_group +quant.layer_bits.down_proj=8 +quant.layer_bits.lm_head=mxfp4

A key names layers by a run of their dotted name's parts: ``fc1`` is ``net.fc1``; ``self_attn`` is every attention
projection of every decoder layer, ``layers.0`` every layer of the first block, ``layers.0.mlp.down_proj`` one layer.
Keys with ``*``, ``?`` or ``[`` (quoted in YAML) are fnmatch patterns of the whole name. A layer several keys match
takes the value of the narrowest one (whose layers are a subset of the others': ``fc1=3`` over ``net=8``); keys
that disagree on a layer without being nested that way are an error. The value is an int (2..16: the layer's
resolved weight spec at that width, its family kept: int stays int, fp8 becomes fp6/fp4, MX keeps its block) or the
name of a spec of conf/quant/spec (``mxfp4``, ``int4_g32``, ...), which replaces the layer's weight spec. Every key
must match a layer the preset quantizes (checked on the built model, before any training); each matched layer gets
an exact-name ``layer_quant_config`` entry with its resolved config and the new weight spec, so the rest of the
layer's quantization (activations, bias) is the preset's.
"""

from __future__ import annotations

import fnmatch
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark_lightning.app.conf import SPEC_DIR, QuantConfigError, with_bits

_PATTERN_CHARS = "*?["
_SHOWN = 40  # layer names listed in an error message


def matches(key: str, name: str) -> bool:
    """``key`` names the layer ``name``: a run of its dotted parts, or (with ``*?[``) an fnmatch pattern of it."""
    if any(c in key for c in _PATTERN_CHARS):
        return fnmatch.fnmatchcase(name, key)
    return f".{key}." in f".{name}."


def assign(layer_bits: dict[str, Any], names: list[str]) -> dict[str, tuple[str, Any]]:
    """Layer name -> (the key that sets it, its value), for the layers ``names`` (in order). Of the keys that match
    a layer, the narrowest wins: the one whose layers are a subset of every other's (``fc1`` over ``net``). QuantConfigError
    when a key matches none of the layers, or when keys that disagree on a layer are not nested that way."""
    hits: dict[str, set[str]] = {}
    for key in layer_bits:
        hits[key] = {n for n in names if matches(key, n)}
        if not hits[key]:
            shown = names[:_SHOWN] + (["..."] if len(names) > _SHOWN else [])
            raise QuantConfigError(
                f"quant.layer_bits.{key}: matches no quantized layer; a key is a run of a layer name's dotted parts "
                f"(fc1, self_attn, layers.0.mlp) or an fnmatch pattern; the quantized layers: {shown}"
            )
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        keys = [k for k in layer_bits if name in hits[k]]
        if not keys:
            continue
        narrowest = [k for k in keys if all(hits[k] < hits[o] for o in keys if o != k)]
        if narrowest:
            out[name] = (narrowest[0], layer_bits[narrowest[0]])
        elif len({repr(layer_bits[k]) for k in keys}) == 1:
            out[name] = (keys[0], layer_bits[keys[0]])
        else:
            settings = ", ".join(f"quant.layer_bits.{k}={layer_bits[k]!r}" for k in keys)
            raise QuantConfigError(
                f"{settings} all set layer {name} and none is narrower; name that layer (group) more specifically"
            )
    return out


def apply_layer_bits(config: Config, model: nn.Module, layer_bits: dict[str, Any] | None) -> Config:
    """``config`` with an exact-name ``layer_quant_config`` entry for every layer ``layer_bits`` sets."""
    if not layer_bits:
        return config
    quantizer = ModelQuantizer(config)
    if quantizer.graph_mode:
        raise QuantConfigError("quant.layer_bits needs an eager-mode preset (graph mode resolves layers at capture)")
    plans = {plan.name: plan for plan in quantizer.resolve(model, warn=False)}
    entries: dict[str, Any] = {}
    for name, (key, value) in assign(layer_bits, list(plans)).items():
        qconfig = plans[name].qconfig.to_dict()
        where = f"quant.layer_bits.{key}={value!r} on layer {name}"
        if isinstance(value, str):
            spec = OmegaConf.to_container(OmegaConf.load(SPEC_DIR / f"{value}.yaml"))
        elif qconfig.get("weight") is None:
            raise QuantConfigError(
                f"{where}: the preset leaves this layer's weight float; give a spec name (e.g. int8_per_channel_sym)"
            )
        else:
            spec = with_bits(qconfig["weight"], value, where)
        entries[name] = {**qconfig, "weight": spec}
    data = config.to_dict()
    data["layer_quant_config"] = {**data.get("layer_quant_config", {}), **entries}
    try:
        updated = Config.from_dict(data)
        ModelQuantizer(updated).resolve(model, warn=False)  # each new spec must fit its layer (group sizes, axes)
    except (ValueError, TypeError) as err:
        raise QuantConfigError(f"quant.layer_bits: {err}") from None
    return updated
