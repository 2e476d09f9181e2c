"""amd-quark 0.13's export directory, both ways: ``config.json`` (the model's config, for a Hugging Face model, plus
``quantization_config`` with ``quant_method: "quark"``) and ``model.safetensors`` with amd-quark's key names, dtypes and
packing. This is what amd-quark's ``import_model_from_safetensors`` and vLLM's quark loader read.

Per quantized layer (a twin with a ``weight`` slot), for ``weight_format="real_quantized"``. Rows marked (ext.) are
formats amd-quark 0.13 does not export; they follow the same rules (codes under the weight's name, ``_scale`` /
``_zero_point`` beside them, per-group weights transposed, 4-bit codes packed eight per int32):

| weight spec | ``<layer>.weight`` | ``weight_scale`` | ``weight_zero_point`` |
|---|---|---|---|
| int8 / uint8, per tensor or channel (axis 0) | int8 / uint8 codes, the weight's shape | float32, () or [out] | int8 / uint8, same shape |
| int8 / uint8 per group (axis 1) | int8 / uint8 [in, out]: transposed | float32 [in/g, out] | int8 / uint8 [in/g, out] |
| int4 / uint4 per channel | int32 [out, in/8], 8 nibbles each | float32 [out] | int32 [out/8], packed |
| int4 / uint4 per group (axis 1) | int32 [in, out/8]: transposed, packed | float32 [in/g, out] | int32 [in/g, out/8] |
| fp8 e4m3 / e5m2, per tensor or channel | float8 values, the weight's shape | float32, () or [out] | none |
| OCP MX fp4 (blocks along in) | uint8 [out, in/2], element 2k in the low nibble | uint8 E8M0 [out, in/32] | none |
| OCP MX fp6 e3m2 / e2m3 | uint8 [out, 3 in/4]: 4 codes per 24-bit little-endian word | uint8 E8M0 [out, in/32] | none |
| (ext.) OCP MX fp8 / int8 | float8 / int8 (element x 64) [out, in] | uint8 E8M0 [out, in/32] | none |
| (ext.) fp8 or integer per_block [r, c] | as per tensor | float32 [out/r, in/c] | integers: [out/r, in/c] |
| (ext.) int2/3/5-7 (int8 / uint8), int9-16 (int16), uint9-16 (int32) | codes as the 8-bit rows | as the 8-bit rows | as the codes |
| (ext.) int4 per tensor / channel of a conv | int32 [out, k/8]: the weight flattened per output channel | float32 | int32 / int8 |
| (ext.) bf16 / fp16 | the rounded weight in that dtype | none | none |
| (ext.) mx6 / mx9 (blocks along in) | int8 sign-magnitude codes [out, in] | float32 step per block [out, in/b] | ``weight_shift`` uint8 0/1 per pair [out, in/2] |
| (ext.) fp6 / fp4 per tensor or channel | uint8 codes per output channel: fp6 as MX fp6, fp4 two per byte | float32, () or [out] | none |

4-bit packing puts element ``8c + order[i]`` in bits ``4i..4i+3`` of int32 ``c``, with ``order = 0 2 4 6 1 3 5 7``
for ``pack_method="reorder"`` (amd-quark's default) and ``0..7`` for ``"order"``. Static activation quantizers
store ``input_scale`` (float32) and ``input_zero_point`` (integer formats, in the codes' dtype); ``output_*``
likewise; dynamic and MX activations store nothing. A transformers ``Conv1D`` (GPT-2; weight kept [in, out]) is
stored as the equivalent ``nn.Linear``: the rows above apply to its transposed weight, [out, in]. Everything else of
the state_dict is stored as it is. Not
expressible here (a ValueError before anything is written; ``custom_mode=None`` stores them): bfp16, per-group
minifloats, quantized biases and the extra slots of LSTMs and attention.

Fused MoE experts (transformers 5's ``gate_up_proj`` / ``down_proj`` stacks) are stored per expert, each projection
as a Linear with the rows above (``weight``, ``weight_scale``, ``weight_zero_point``, ``input_scale``; gate and up
carry their expert's one input scale), under the names of the family's hub checkpoints that transformers' own
conversion gives (``checkpoint_names``: Mixtral ``block_sparse_moe.experts.{e}.w1|w3|w2`` and
``block_sparse_moe.gate``, the Qwen2-MoE group ``mlp.experts.{e}.gate_proj|up_proj|down_proj``), which is what vLLM's
loaders map; the whole file then uses those names, and so do exact layer names in the stored config. The import
maps them back and decodes each expert into its block of the stacked Parameters.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.checkpoint_names import CheckpointNames, checkpoint_names
from quark.torch.export.codec import require_safetensors
from quark.torch.export.files import write_atomically
from quark.torch.export.packing import (
    pack_int4,
    unpack_int4,
)
from quark.torch.export.quark_attention import (
    activation_prefix,
    check_prob_scales,
)
from quark.torch.export.quark_codec import (
    decode_quark_weight,
    unsupported_layout,
    weight_layout,
)
from quark.torch.export.quark_config import (
    check_export_options,
    from_quark_dict,
    json_mapping,
    to_quark_dict,
)
from quark.torch.export.quark_files import WEIGHTS_FILE, read_weights, weight_source
from quark.torch.export.quark_tensors import as_linear, quark_tensors, stored_part_quantizer, stored_weight_quantizer
from quark.torch.export.quark_validation import check_before_import
from quark.torch.export.rotation_export import exported_rotations
from quark.torch.export.skeleton import materialize
from quark.torch.export.tied import TiedWeights, embeddings_stored_apart
from quark.torch.export.validation import (
    quantized_modules,
    unreached_layers,
)
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_attention import QuantAttentionProbs
from quark.torch.quantization.nn.modules.quant_modules import (
    DEFAULT_SLOTS,
    slot_label,
    slot_tensor,
)
from quark.torch.quantization.online_rotation import decoded_rotations, install_online_rotations
from quark.torch.quantization.resolve import kv_cache_entry
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize

__all__ = [
    "export_quark_dir",
    "quark_document",
    "import_quark_dir",
    "is_quark_dir",
    "to_quark_dict",
    "from_quark_dict",
    "pack_int4",
    "unpack_int4",
]


CONFIG_FILE = "config.json"


# ----------------------------------------------------------------------------------------------- export / import
def export_quark_dir(
    model: nn.Module, output_dir: str | Path, weight_format: str = "real_quantized", pack_method: str = "reorder"
) -> Path:
    """Write amd-quark 0.13's export directory for a model prepared and calibrated (or frozen) by ModelQuantizer.
    Returns the directory. Each file is written atomically."""
    st = require_safetensors()
    check_export_options(weight_format, pack_method)
    config: Config | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("export needs a model prepared by ModelQuantizer (it has no quant_config)")
    check_quark_exportable(model)
    names = checkpoint_names(model)  # experts stored per expert: the family's hub names (a ValueError without them)
    floated = _unreached_for_export(model)
    tensors = quark_tensors(model, config, pack_method, names, floated)
    document = quark_document(model, config, names, floated, weight_format, pack_method)
    if embeddings_stored_apart(model, tensors):  # two quantized versions of one tied weight: a loader must not tie
        document["tie_word_embeddings"] = False
    out = Path(output_dir)
    write_atomically(
        out,
        WEIGHTS_FILE,
        lambda tmp: st.save_file({k: v.cpu() for k, v in tensors.items()}, tmp, metadata={"format": "pt"}),
    )
    write_atomically(
        out, CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    )
    return out


def quark_document(
    model: nn.Module,
    config: Config,
    names: CheckpointNames | None,
    floated: list[str],
    weight_format: str = "real_quantized",
    pack_method: str = "reorder",
) -> dict[str, Any]:
    """config.json of the export directory: the Hugging Face model's config (``architectures`` added as
    ``save_pretrained`` writes it) and ``quantization_config``, amd-quark's form of ``config`` (``floated`` layers
    excluded, exact layer names in the hub checkpoint's ``names``). Reads no weight (works on a meta skeleton)."""
    hf = getattr(model, "config", None)
    document = hf.to_dict() if hasattr(hf, "to_dict") else {}
    if document and not document.get("architectures") and type(model).__module__.startswith("transformers."):
        document["architectures"] = [
            type(model).__name__
        ]  # what save_pretrained writes: import with model=None builds it
    stored = _as_amd_quark(config, model)
    stored = dataclasses.replace(stored, algo_config=exported_rotations(config, model))  # online_rotation_layers
    if floated:
        stored = dataclasses.replace(
            stored, exclude=list(stored.exclude) + [n for n in floated if n not in stored.exclude]
        )
    if names is not None:
        stored = _renamed_config(stored, names)
    document["quantization_config"] = to_quark_dict(stored, weight_format, pack_method)
    return document


def _renamed_config(config: Config, names: CheckpointNames, inverse: bool = False) -> Config:
    """``config`` with the exact layer names of ``exclude`` and ``layer_quant_config`` in the hub checkpoint's names
    (``inverse``: back to the model's); patterns are left as they are."""
    return dataclasses.replace(
        config,
        exclude=[names.layer(n, inverse) for n in config.exclude],
        layer_quant_config={names.layer(k, inverse): v for k, v in config.layer_quant_config.items()},
    )


def _unreached_for_export(model: nn.Module) -> list[str]:
    """``unreached_layers``, with a warning naming them: amd-quark and vLLM load them as float rather than with a
    placeholder input scale."""
    floated = unreached_layers(model)
    if floated:
        warnings.warn(
            f"layer(s) that no calibration forward reached are exported in float and excluded in the stored config: "
            f"{floated}. vLLM quantizes a fused MoE layer's experts alike, whatever exclude says of one "
            "expert: calibrate with data that reaches every expert before serving such a model there.",
            stacklevel=3,
        )
    return floated


_STORED_SLOTS = {"_weight_quantizer", "_input_quantizer", "_output_quantizer"}


_WEIGHT_SLOT = next(s for s in DEFAULT_SLOTS if s.attr == "_weight_quantizer")


def _switched_off(where: str, what: str) -> ValueError:
    """A quantizer with fake quant off, which config.json cannot express: the model runs that tensor in float."""
    return ValueError(
        f"{where}: its quantizer's fake quant is switched off, so the model computes with the float {what}, but "
        "amd-quark's config.json would say it is quantized (and the import would quantize it). Switch it back on "
        "(quantizer.enable_fake_quant()) to export it quantized, or exclude the layer (Config.exclude) or give it a "
        "layer_quant_config entry without that tensor and quantize again to export it in float; custom_mode=None "
        "writes this project's single file, which stores what the model computes"
    )


def check_quark_exportable(model: nn.Module) -> None:
    """Before anything is written: every quantized tensor of ``model`` has a layout here, and every quantizer
    config.json names is applied by the model: fake quant on, or a weight on its quantizer's grid, which is stored as
    its codes (a ValueError names the first layer and slot that fails)."""
    for name, m in quantized_modules(model):
        parts = {s.attr: s for _, w, i in m.linear_parts() for s in (w, i) if s is not None}
        for slot, q in m.quantizer_slots():
            where = f"layer '{name}' ({slot_label(slot)})"
            if slot.attr not in _STORED_SLOTS and slot.attr not in parts:
                raise ValueError(
                    f"{where}: amd-quark's layout stores the weight, input and output quantizers of a layer "
                    "only; custom_mode=None writes this project's single-file format, which stores every slot"
                )
            if slot.attr in parts and slot.tensor is not None:
                stored = stored_part_quantizer(m, slot)
            else:
                stored = stored_weight_quantizer(m) if slot.attr == "_weight_quantizer" else q
            if not bool(q.fake_quant_enabled) and stored is q:
                raise _switched_off(where, f"{slot.role.removesuffix('_tensors')}s")
            if stored is None:
                raise _switched_off(where, "weight, which is not on the grid of its quantizer's qparams")
            if slot.attr in parts and slot.tensor is not None:
                if weight_layout(stored.spec, slot_tensor(m, slot)) is None:  # type: ignore[arg-type]
                    raise unsupported_layout(where, stored.spec)
            elif slot.attr == "_weight_quantizer":
                weight, wq = as_linear(m, stored)
                if weight_layout(wq.spec, weight) is None:
                    raise unsupported_layout(where, wq.spec)


def _as_amd_quark(config: Config, model: nn.Module) -> Config:
    """``config`` under amd-quark's rule (an entry is a layer's whole config). With ``inherit_roles`` the per-layer
    and per-type entries become, for each layer whose config differs from the global one, the config it got; a
    KV-cache layer's goes into ``kv_cache_quant_config`` under its name (the KV-cache fields are kept)."""
    if not config.inherit_roles or not (
        config.layer_quant_config or config.layer_type_quant_config or config.kv_cache_quant_config
    ):
        return config
    layers = [(name, m) for name, m in quantized_modules(model) if not isinstance(m, QuantAttentionProbs)]
    kv = {name: m.quant_config for name, m in layers if kv_cache_entry(config, name) is not None}
    own = {n: m.quant_config for n, m in layers if n not in kv and m.quant_config != config.global_quant_config}
    return Config(
        global_quant_config=config.global_quant_config,
        layer_quant_config=own,
        exclude=list(config.exclude),
        quant_mode=config.quant_mode,
        kv_cache_quant_config=kv,
        kv_cache_group=list(config.kv_cache_group),
        min_kv_scale=config.min_kv_scale,
        kv_cache_post_rope=config.kv_cache_post_rope,
        softmax_quant_spec=config.softmax_quant_spec,
    )


def is_quark_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds an amd-quark style export (config.json with a quark quantization_config)."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("quantization_config", {}).get("quant_method") == "quark"
    except (json.JSONDecodeError, AttributeError):
        return False


def _read_quark_config(path: Path) -> tuple[Config, dict[str, Any]]:
    """``from_quark_dict`` of config.json's ``quantization_config``; any problem is a ValueError naming the file."""
    try:
        document = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err})") from None
    try:
        return from_quark_dict(json_mapping(document, "the document").get("quantization_config"))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def import_quark_dir(model: nn.Module, model_dir: str | Path, device: str | torch.device | None = None) -> nn.Module:
    """Rebuild a quantized model from amd-quark's export directory and a float ``model`` of the same architecture:
    prepared with the stored Config, weights set to their dequantized values with the quantizer
    ``decoded_weight_quantizer`` gives (pass-through: they are on the grid), static activation quantizers frozen with
    the stored qparams, in eval mode. Meta Parameters (a skeleton) are given storage on ``device`` first. The
    tensors are read from ``model.safetensors`` or, in a sharded directory (``stream_quantize``'s), from the shards
    ``model.safetensors.index.json`` names, each tensor when it is looked up (``quark_files.read_weights``)."""
    root = Path(model_dir)
    config, export = _read_quark_config(root / CONFIG_FILE)
    pack_method = export["pack_method"]
    t = read_weights(root)  # model.safetensors, or the shards its index names, a file at a time
    source = weight_source(root)
    names = checkpoint_names(model)  # a model with experts: the file uses the family's hub names
    if names is not None:
        t = {_our_key(names, key): value for key, value in t.items()}
        config = _renamed_config(config, names, inverse=True)
    t = decoded_rotations(model, t)  # a stored input_rotation (int8 signs of one block) as the [in, in] buffer
    install_online_rotations(model, t, config)  # <layer>.input_rotation of a rotated model: buffer and pre-hook
    prob_scales = check_prob_scales(model, config, t, source)
    check_before_import(model, config, t, source, prob_scales)  # every problem found before the model is touched
    materialize(model, device, set(t))  # a skeleton's meta Parameters get storage (every one is filled below)
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        ModelQuantizer(config).prepare(model)
    plain = {k: v for k, v in t.items() if not k.endswith(("_scale", "_zero_point", "weight_shift"))}
    tied = TiedWeights(model)
    with torch.no_grad():
        for name, m in quantized_modules(model):
            prefix = f"{name}." if name else ""
            wq = getattr(m, "_weight_quantizer", None)
            key = prefix + "weight"
            if wq is not None and key in t:
                weight, linear_quantizer = as_linear(m, wq)  # a Conv1D's weight through its [out, in] view
                values, scale, zp = decode_quark_weight(t, key, weight.shape, linear_quantizer.spec, pack_method)
                plain.pop(key, None)
                tied.load(name, m, _WEIGHT_SLOT, weight, values, wq.spec, scale, zp)
            prefix = activation_prefix(name, m)
            for role in ("input", "output"):
                aq = getattr(m, f"_{role}_quantizer", None)
                if aq is not None and f"{prefix}{role}_scale" in t:
                    s = t[f"{prefix}{role}_scale"].float()
                    z = t.get(f"{prefix}{role}_zero_point", torch.zeros_like(s)).to(torch.int32)
                    setattr(m, f"_{role}_quantizer", FrozenScaledFakeQuantize(aq.spec, s, z))
            _load_parts(name, m, prefix, t, pack_method, tied, plain)
        tied.finish(plain)  # Parameters several layers hold: tie kept, or untied where their quantized values differ
    model.load_state_dict(plain, strict=False)  # check_before_import made sure every key has its place
    return ModelQuantizer.freeze(model).eval()


def _our_key(names: CheckpointNames, hub: str) -> str:
    """The model's name of a key of the file (``quark_tensors.hub_key`` reversed)."""
    layer, _, leaf = hub.rpartition(".")
    back = names.layer(layer, inverse=True)
    if back != layer and f"{back}.{leaf}" in names.stacked:
        return f"{back}.{leaf}"
    return names.our_key(hub)


def _load_parts(
    name: str,
    m: QuantMixin,
    prefix: str,
    t: dict[str, torch.Tensor],
    pack_method: str,
    tied: TiedWeights,
    plain: dict[str, torch.Tensor],
) -> None:
    """Decode each stored part (one expert's projection) into its block of the stacked Parameter, with the quantizer
    ``decoded_weight_quantizer`` gives, and freeze its input quantizer with the stored scale (gate and up of an
    expert share one: ``check_before_import`` made sure their stored scales agree)."""
    for part, weight_slot, input_slot in m.linear_parts():
        key = f"{prefix}{part}.weight"
        wq = getattr(m, weight_slot.attr, None)
        if wq is not None and key in t:
            view = slot_tensor(m, weight_slot)
            values, scale, zp = decode_quark_weight(t, key, view.shape, wq.spec, pack_method)  # type: ignore[union-attr]
            plain.pop(key, None)
            tied.load(name, m, weight_slot, view, values, wq.spec, scale, zp)  # type: ignore[arg-type]
        aq = getattr(m, input_slot.attr, None) if input_slot is not None else None
        if aq is None or f"{prefix}{part}.input_scale" not in t:
            continue
        s = t[f"{prefix}{part}.input_scale"].float()
        z = t.get(f"{prefix}{part}.input_zero_point", torch.zeros_like(s)).to(torch.int32)
        m.set_quantizer(input_slot, FrozenScaledFakeQuantize(aq.spec, s, z))  # type: ignore[arg-type]
