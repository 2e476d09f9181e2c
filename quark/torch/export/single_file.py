"""This project's single-file layout, both ways: ``model.safetensors`` holding every tensor of the model as the
engine computes it (codes, scales and zero points of every slot and format) with the quark Config and a per-tensor
encoding table in its metadata. ``write_single_file`` / ``read_single_file``; amd-quark's names
(``export_safetensors(custom_mode=None)``, ``import_model_from_safetensors``) reach them too."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.codec import (
    activation_key,
    decode_weight,
    encode_weight,
    first_of_its_storage,
    has_qparams,
    is_quantizer_state,
    quant_slots,
    quantizer_prefixes,
    require_safetensors,
    stored_quantizer,
)
from quark.torch.export.files import write_atomically
from quark.torch.export.rotation_export import exported_rotations, stored_config_dict, stored_tensor
from quark.torch.export.skeleton import materialize
from quark.torch.export.tied import TiedWeights
from quark.torch.export.validation import (
    check_header,
    check_import,
    unreached_layers,
)
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import (
    slot_tensor,
    slot_tensor_name,
)
from quark.torch.quantization.online_rotation import decoded_rotations, install_online_rotations
from quark.torch.quantization.resolve import config_from_stored
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize

FILENAME = "model.safetensors"


def write_single_file(model: nn.Module, output_dir: str | Path, filename: str = FILENAME) -> Path:
    """Write the quantized ``model`` (prepared and calibrated, or frozen) as this project's single file
    ``output_dir/filename`` (what ``export_safetensors(custom_mode=None)`` writes: see its docstring); atomic.
    Returns the file's path."""
    st = require_safetensors()
    config: Config | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("export_safetensors needs a model prepared by ModelQuantizer (it has no quant_config)")
    floated = unreached_layers(model)  # written in float, and excluded in the stored config so an import runs them so
    if floated:
        warnings.warn(
            f"layer(s) that no calibration forward reached are exported in float and excluded in the stored config: "
            f"{floated}",
            stacklevel=3,
        )
        config = dataclasses.replace(
            config, exclude=list(config.exclude) + [n for n in floated if n not in config.exclude]
        )
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    skip: set[str] = set()

    def put(key: str, value: torch.Tensor) -> None:
        if key in tensors:
            raise ValueError(f"export_safetensors: two tensors of the model would be stored as '{key}'")
        tensors[key] = value.detach().contiguous()

    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin) or name in floated:  # a floated layer's tensors go out with the state_dict
            continue
        prefix = f"{name}." if name else ""
        for slot in quant_slots(m):
            q = getattr(m, slot.attr, None)
            if slot.tensor is not None:
                tensor = slot_tensor(m, slot)
                if not isinstance(tensor, torch.Tensor):
                    continue
                skip.add(prefix + slot.tensor)  # the Parameter (a stacked one: all of its parts are stored)
                key = prefix + slot_tensor_name(slot)  # type: ignore[operator]
                stored, meta = encode_weight(tensor, stored_quantizer(tensor, q))
                for suffix, value in stored.items():
                    put(key + suffix, value)
                info[key] = meta
            elif q is not None and not bool(q.fake_quant_enabled):
                info[prefix + activation_key(slot)] = {"encoding": "float"}  # the model runs it unquantized
            elif has_qparams(q):
                scale, zp = q.calculate_qparams()  # type: ignore[union-attr]
                key = prefix + activation_key(slot)
                put(key + "_scale", scale.float().clone())
                put(key + "_zero_point", zp.clone())
                info[key] = {"encoding": "qparams"}
    prefixes = quantizer_prefixes(model)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if key in skip or is_quantizer_state(key, prefixes) or key in tensors:
            continue
        if first_of_its_storage(value, seen):  # a tied tensor (an lm_head sharing the input embedding) is stored once
            put(key, stored_tensor(key, value, config))
    config = dataclasses.replace(config, algo_config=exported_rotations(config, model))  # online_rotation_layers
    metadata = {
        "format": "pt",
        "quant_method": "quark",
        "quantization_config": json.dumps(stored_config_dict(config)),
        "quark_tensors": json.dumps(info),
    }
    tensors = {k: v.cpu() for k, v in tensors.items()}
    return write_atomically(output_dir, filename, lambda tmp: st.save_file(tensors, tmp, metadata=metadata))


def read_single_file(model: nn.Module, path: str | Path, device: str | torch.device | None = None) -> nn.Module:
    """Rebuild the quantized model from the single file ``path`` and a float ``model`` (or skeleton) of the same
    architecture, checked first (``check_import``); what ``import_model_from_safetensors`` does for that layout."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (written by export_safetensors?)")
    tensors, info, config = _read(path)
    tensors = dict(decoded_rotations(model, tensors))  # a stored input_rotation as the [in, in] buffer
    install_online_rotations(model, tensors, config)  # <layer>.input_rotation of a rotated model: buffer and pre-hook
    check_import(model, config, tensors, info, str(path))
    materialize(model, device, set(tensors))
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        ModelQuantizer(config).prepare(model)
    owned = {k for key in info for k in (key, key + "_scale", key + "_zero_point")}
    plain = {k: v for k, v in tensors.items() if k not in owned}
    tied = TiedWeights(model)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, QuantMixin):
                _load_layer(name, m, tensors, info, tied)
        tied.finish(plain)  # Parameters several layers hold: tie kept, or untied where their quantized values differ
    # the float tensors last: a Parameter a quantized layer shares with a float one (an lm_head tied to the input
    # embeddings) holds the float values, as in the model exported; the layer's frozen quantizer applies its codes
    model.load_state_dict(plain, strict=False)
    return ModelQuantizer.freeze(model).eval()


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Config]:
    st = require_safetensors()
    from safetensors import safe_open

    check_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = st.load_file(str(path))
    except Exception as err:  # a truncated or corrupt file: the reader's own errors vary
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    if metadata.get("quant_method") != "quark":
        raise ValueError(f"{path} is not a quark export (metadata quant_method={metadata.get('quant_method')!r})")
    try:
        info = json.loads(metadata["quark_tensors"])
        config = config_from_stored(json.loads(metadata["quantization_config"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: the metadata 'quark_tensors' / 'quantization_config' cannot be read: {err}") from err
    if not isinstance(info, dict):
        raise ValueError(f"{path}: the metadata 'quark_tensors' is not a mapping")
    return tensors, info, config


def _load_layer(
    name: str, m: QuantMixin, tensors: dict[str, torch.Tensor], info: dict[str, Any], tied: TiedWeights
) -> None:
    """One quantized layer ``name`` from the single file: each stored weight decoded into its tensor with the
    quantizer ``decoded_weight_quantizer`` gives (none where it was stored as the model used it, unquantized; a
    Parameter other layers hold is settled by ``tied``), each activation slot frozen with its stored qparams, or
    emptied where the exported model ran it unquantized."""
    prefix = f"{name}." if name else ""
    for slot in quant_slots(m):
        q = getattr(m, slot.attr, None)
        key = prefix + (slot_tensor_name(slot) if slot.tensor is not None else activation_key(slot))  # type: ignore[operator]
        meta = info.get(key)
        if meta is None:
            continue
        encoding = meta["encoding"]
        unquantized = q is None or (encoding == "float" and "dtype" not in meta)  # stored as the model used it
        if slot.tensor is not None:
            values = decode_weight(tensors, key, meta)
            view = slot_tensor(m, slot)
            if unquantized:
                tied.load(name, m, slot, view, values, None)  # type: ignore[arg-type]
            else:
                scaled = encoding.startswith(("int", "float8", "minifloat"))  # an MX _scale: E8M0 exponents
                scale = tensors[key + "_scale"].float() if scaled else None
                zp = tensors.get(key + "_zero_point", torch.zeros((), dtype=torch.int32)) if scaled else None
                tied.load(name, m, slot, view, values, q.spec, scale, zp)  # type: ignore[arg-type, union-attr]
        elif q is not None and unquantized:
            m.set_quantizer(slot, None)
        elif q is not None:
            m.set_quantizer(
                slot, FrozenScaledFakeQuantize(q.spec, tensors[key + "_scale"], tensors[key + "_zero_point"])
            )
