"""The tensors of amd-quark's export directory for a model (or a part of one): each quantized layer's codes and
qparams in amd-quark's layout (``quark_codec``), static activation scales, and the rest of the state dict as it is.
``quark_format.export_quark_dir`` writes them for a whole model; ``quark.torch.streaming`` for one decoder layer at a
time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.export.checkpoint_names import CheckpointNames
from quark.torch.export.codec import first_of_its_storage, is_quantizer_state, quantizer_prefixes, stored_quantizer
from quark.torch.export.quark_attention import activation_prefix, merge_kv_scales, skips_zero_point
from quark.torch.export.quark_codec import BLOCK_DTYPES, encode_quark_weight, int_container
from quark.torch.export.rotation_export import stored_tensor
from quark.torch.export.validation import quantized_modules
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.formats import IntFormat, format_of
from quark.torch.quantization.hf import is_hf_conv1d, linear_weight, transpose_weight_spec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QuantSlot, slot_tensor
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "quark_tensors",
    "activation_qparams",
    "as_linear",
    "stored_weight_quantizer",
    "stored_part_quantizer",
    "hub_key",
    "TransposedQuantizer",
]


def quark_tensors(
    model: nn.Module,
    config: Config,
    pack_method: str,
    names: CheckpointNames | None,
    floated: list[str],
    skip: str | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor the export directory stores for ``model``, by key: quantized layers encoded (``floated`` ones,
    which no calibration reached, in float), the rest of the state dict as it is (tied tensors once), in the hub
    checkpoint's ``names`` when given. ``skip``: a module name whose subtree is left out (a decoder stack written
    layer by layer)."""

    def kept(key: str) -> bool:
        return skip is None or not (key == skip or key.startswith(skip + "."))

    tensors: dict[str, torch.Tensor] = {}
    modules = [(name, m) for name, m in quantized_modules(model) if kept(name)]
    for name, m in modules:
        if name in floated:
            continue  # its float weights go out with the rest of the state dict; the config excludes it
        prefix = f"{name}." if name else ""
        wq = stored_weight_quantizer(m)
        if wq is not None:
            weight, wq = as_linear(m, wq)
            for suffix, value in encode_quark_weight(weight, wq, pack_method, f"layer '{name}'").items():  # type: ignore[arg-type]
                tensors[prefix + "weight" + suffix] = value.detach().contiguous()
        prefix = activation_prefix(name, m)  # an attention's probabilities: <attention>.prob_output_scale
        for role in ("input", "output"):
            q = getattr(m, f"_{role}_quantizer", None)
            tensors.update(activation_qparams(q, f"{prefix}{role}", m, f"layer '{name}'"))
        for part, weight_slot, input_slot in m.linear_parts():
            where = f"layer '{name}' ({part})"
            view, wq = slot_tensor(m, weight_slot), stored_part_quantizer(m, weight_slot)
            for suffix, value in encode_quark_weight(view, wq, pack_method, where).items():  # type: ignore[arg-type]
                tensors[f"{prefix}{part}.weight{suffix}"] = value.detach().contiguous()
            source = getattr(m, input_slot.attr, None) if input_slot is not None else None
            tensors.update(activation_qparams(source, f"{prefix}{part}.input"))
    merge_kv_scales(model, config, tensors)  # kv_cache_group: k and v written with max(k, v, min_kv_scale)
    prefixes = quantizer_prefixes(model)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, value in model.state_dict(keep_vars=True).items():  # the rest as it is (quantized weights are stored)
        if key in tensors or not kept(key) or is_quantizer_state(key, prefixes):  # quantizer state is never stored
            continue
        if names is not None and key in names.stacked and not floated_stack(key, floated):
            continue  # stored per expert above
        if first_of_its_storage(value, seen):  # a tied tensor (an lm_head sharing the input embedding): stored once
            tensors[key] = stored_tensor(
                key, value.detach(), config
            ).contiguous()  # input_rotation: amd-quark's int8 form
    if names is not None:
        tensors = {hub_key(names, key, floated): value for key, value in tensors.items()}
    return tensors


def activation_qparams(
    q: FakeQuantizeBase | None, name: str, module: QuantMixin | None = None, where: str = ""
) -> dict[str, torch.Tensor]:
    """``<name>_scale`` (and ``_zero_point`` for integers, unless amd-quark stores none for ``module``: the attention
    probabilities) of a static activation quantizer; nothing for none, a dynamic one or a block format."""
    if q is None or q.is_dynamic or not hasattr(q, "calculate_qparams") or q.spec.dtype in BLOCK_DTYPES:
        return {}
    scale, zp = q.calculate_qparams()
    out = {f"{name}_scale": scale.detach().float().clone()}
    fmt = format_of(q.spec.dtype)
    if isinstance(fmt, IntFormat) and not (module is not None and skips_zero_point(module, zp, where)):
        out[f"{name}_zero_point"] = zp.detach().to(int_container(fmt)).clone()
    return out


def floated_stack(key: str, floated: list[str]) -> bool:
    """Whether the stacked Parameter ``key`` belongs to a layer exported in float (stored as it is)."""
    return key.rpartition(".")[0] in floated


def hub_key(names: CheckpointNames, key: str, floated: list[str]) -> str:
    """The hub name of a stored key; a floated layer's stacked Parameter keeps its layer's hub name."""
    if key in names.stacked:
        layer, _, leaf = key.rpartition(".")
        return f"{names.layer(layer)}.{leaf}"
    return names.hub_key(key)


class TransposedQuantizer:
    """A transformers ``Conv1D``'s weight quantizer seen from the equivalent ``nn.Linear``: its spec transposed back,
    called on [out, in]. Its qparams already have Linear's layout."""

    def __init__(self, quantizer: FakeQuantizeBase) -> None:
        self.quantizer = quantizer
        self.spec = transpose_weight_spec(quantizer.spec)
        self.fake_quant_enabled = quantizer.fake_quant_enabled
        self.round_method = quantizer.round_method

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.quantizer.calculate_qparams()

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return self.quantizer(w.t()).t()


def as_linear(m: nn.Module, wq: Any) -> tuple[torch.Tensor, Any]:
    """(weight, quantizer) as for ``nn.Linear``: a ``Conv1D`` is stored as the equivalent Linear ([out, in] weight,
    amd-quark's Linear layouts), so every layout rule and reader of Linear weights applies to it unchanged."""
    if is_hf_conv1d(m):
        return linear_weight(m), TransposedQuantizer(wq)
    return m.weight, wq


def stored_part_quantizer(m: QuantMixin, slot: QuantSlot) -> FakeQuantizeBase | None:
    """``stored_quantizer`` of a part's weight (one expert's projection)."""
    return stored_quantizer(slot_tensor(m, slot), getattr(m, slot.attr, None))  # type: ignore[arg-type]


def stored_weight_quantizer(m: QuantMixin) -> FakeQuantizeBase | None:
    """The quantizer whose codes the directory stores for ``m``'s weight (``stored_quantizer``: with fake quant
    switched off, a pass-through one when the weight is on its grid); None: no quantized weight to store."""
    wq = getattr(m, "_weight_quantizer", None)
    if wq is None or not isinstance(getattr(m, "weight", None), torch.Tensor):
        return None
    return stored_quantizer(m.weight, wq)
