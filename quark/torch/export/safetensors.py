"""Real-quantized safetensors: integer codes (int4/uint4 packed two per byte), fp8 as torch float8, fp4/fp6 and MX
elements as packed codes with their E8M0 scales, plus scales, zero points and the quark Config in the metadata.

``import_model_from_safetensors`` rebuilds the quantized model from a float instance of the same architecture; its
outputs equal the exported (fake-quantized) model's bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quark.torch.export.files import write_atomically
from quark.torch.export.packing import pack_nibbles, unpack_nibbles
from quark.torch.quantization.api import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    TORCH_FLOAT8,
    FloatFormat,
    IntFormat,
    decode,
    dequantize_int,
    encode,
    format_of,
    from_blocks,
    quantize_int,
    quantize_mx,
    round_to_grid,
    to_blocks,
)
from quark.torch.quantization.formats.grouping import channel_view
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QUANTIZER_ROLES
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase, FrozenScaledFakeQuantize

FILENAME = "model.safetensors"
ACT_ROLES = ("input_tensors", "output_tensors")
_ROLE_KEY = {"input_tensors": "input", "output_tensors": "output", "weight": "weight", "bias": "bias"}


def _require_safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("export needs the `safetensors` package: pip install 'quark-lightning[export]'") from err
    return st


# ----------------------------------------------------------------------------------------------- encoding
def _has_qparams(q: FakeQuantizeBase | None) -> bool:
    """A static quantizer with a scale (integers, minifloats): its qparams are part of the export."""
    return q is not None and not q.is_dynamic and isinstance(format_of(q.spec.dtype), IntFormat | FloatFormat)


def _scale_view(scale: torch.Tensor, x: torch.Tensor, qscheme: QSchemeType, ch_axis: int | None) -> torch.Tensor:
    """A per-tensor or per-channel scale shaped to broadcast over ``x``."""
    if qscheme == QSchemeType.per_channel:
        return channel_view(scale.float(), x.ndim, ch_axis)  # type: ignore[arg-type]
    return scale.float().reshape(())


def encode_weight(w: torch.Tensor, q: FakeQuantizeBase | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The stored tensors of one weight (codes, scales) and how to read them back."""
    shape = list(w.shape)
    if q is None:
        return {"": w.detach().float()}, {"encoding": "float", "shape": shape}
    spec = q.spec
    fmt = format_of(spec.dtype)
    if _has_qparams(q):
        scale, zp = q.calculate_qparams()
        info: dict[str, Any] = {"dtype": spec.dtype.name, "shape": shape, "qscheme": spec.qscheme.name,
                                "ch_axis": spec.ch_axis, "group_size": spec.group_size}  # fmt: skip
        if isinstance(fmt, IntFormat):
            codes = quantize_int(w.detach(), scale, zp, fmt.qmin, fmt.qmax, round_method=spec.round_method,
                                 qscheme=spec.qscheme, axis=spec.ch_axis, group_size=spec.group_size)  # fmt: skip
            stored = _store_int(codes, fmt)
            info["encoding"] = "int_nibbles" if fmt.bits <= 4 else "int"
            return {"": stored, "_scale": scale.detach().float(), "_zero_point": zp.detach()}, info
        if spec.qscheme == QSchemeType.per_group:
            raise ValueError(f"export of per-group {spec.dtype.name} weights is not supported (per tensor / channel are)")
        values = round_to_grid(q(w.detach()).float() / _scale_view(scale, w, spec.qscheme, spec.ch_axis), fmt)
        if spec.dtype in TORCH_FLOAT8:
            info["encoding"] = "float8"
            return {"": values.to(TORCH_FLOAT8[spec.dtype]), "_scale": scale.detach().float()}, info
        codes = encode(values, fmt)
        info["encoding"] = "minifloat_nibbles" if fmt.bits <= 4 else "minifloat"
        return {"": pack_nibbles(codes) if fmt.bits <= 4 else codes, "_scale": scale.detach().float()}, info
    if spec.dtype == Dtype.mx:
        element = Dtype(spec.mx_element_dtype)
        block, axis = spec.group_size or 32, -1 if spec.ch_axis is None else spec.ch_axis
        elements, e8m0 = quantize_mx(w.detach(), element, block, axis)
        info = {"dtype": "mx", "element": element.name, "shape": shape, "block": block, "axis": axis,
                "blocked_shape": list(elements.shape)}  # fmt: skip
        if element == Dtype.int8:
            info["encoding"] = "mx_int8"
            return {"": torch.round(elements * 64).to(torch.int8), "_scale": e8m0}, info
        efmt = FLOAT_FORMATS[element]
        codes = encode(elements, efmt)
        info["encoding"] = "mx_nibbles" if efmt.bits <= 4 else "mx_codes"
        return {"": pack_nibbles(codes) if efmt.bits <= 4 else codes, "_scale": e8m0}, info
    # casts (bf16 / fp16) are stored in that dtype; mx6 / mx9 / bfp16 as their dequantized values
    value = q(w.detach())
    if spec.dtype in (Dtype.bfloat16, Dtype.float16):
        return {"": value.to(torch.bfloat16 if spec.dtype == Dtype.bfloat16 else torch.float16)}, {"encoding": "cast", "shape": shape}
    return {"": value.float()}, {"encoding": "float", "shape": shape, "dtype": spec.dtype.name}


def _store_int(codes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    if fmt.bits <= 4:
        return pack_nibbles(codes)
    if fmt.bits <= 8:
        return codes.to(torch.int8 if fmt.signed else torch.uint8)
    return codes.to(torch.int16 if fmt.bits <= 16 and fmt.signed else torch.int32)


def decode_weight(tensors: dict[str, torch.Tensor], key: str, info: dict[str, Any]) -> torch.Tensor:
    """The dequantized weight from its stored form: equal to the exported model's fake-quantized weight."""
    shape = info["shape"]
    stored = tensors[key]
    encoding = info["encoding"]
    if encoding in ("float", "cast"):
        return stored.float().reshape(shape)
    if encoding.startswith("int"):
        fmt = format_of(info["dtype"])
        if not isinstance(fmt, IntFormat):
            raise ValueError(f"{key}: encoding {encoding!r} with the non-integer dtype {info['dtype']!r}")
        count = int(torch.Size(shape).numel())
        codes = unpack_nibbles(stored, count, fmt.signed).reshape(shape) if encoding == "int_nibbles" else stored.to(torch.int32)
        return dequantize_int(codes, tensors[key + "_scale"], tensors[key + "_zero_point"], qscheme=QSchemeType(info["qscheme"]),
                              axis=info["ch_axis"], group_size=info["group_size"])  # fmt: skip
    if encoding in ("float8", "minifloat", "minifloat_nibbles"):
        fmt = FLOAT_FORMATS[Dtype(info["dtype"])]
        if encoding == "float8":
            values = stored.float()
        else:
            count = int(torch.Size(shape).numel())
            codes = unpack_nibbles(stored, count, signed=False).reshape(shape) if encoding == "minifloat_nibbles" else stored
            values = decode(codes, fmt)
        values = values.reshape(shape)
        return values * _scale_view(tensors[key + "_scale"], values, QSchemeType(info["qscheme"]), info["ch_axis"])
    if encoding.startswith("mx"):
        blocked = info["blocked_shape"]
        if encoding == "mx_int8":
            elements = stored.float() / 64
        else:
            efmt = FLOAT_FORMATS[Dtype(info["element"])]
            count = int(torch.Size(blocked).numel())
            codes = unpack_nibbles(stored, count, signed=False) if encoding == "mx_nibbles" else stored
            elements = decode(codes.reshape(blocked), efmt)
        exp = tensors[key + "_scale"].to(torch.int32) - 127
        values = torch.ldexp(elements.reshape(blocked), exp.unsqueeze(-1))
        _, layout = to_blocks(torch.zeros(shape), info["axis"], info["block"])
        return from_blocks(values, layout, torch.Size(shape))
    raise ValueError(f"{key}: unknown encoding {encoding!r}")


# ----------------------------------------------------------------------------------------------- export / import
def export_safetensors(model: nn.Module, output_dir: str | Path, filename: str = FILENAME) -> Path:
    """Write the quantized ``model`` (prepared and calibrated, or frozen) as real-quantized safetensors.

    Quantized layers' weights are stored as codes with their scales; static activation quantizers' scales and zero
    points are stored; everything else as in the state_dict. The write is atomic (a temporary file renamed).
    """
    st = _require_safetensors()
    config: Config | None = getattr(model, "quant_config", None)
    if config is None:
        raise ValueError("export_safetensors needs a model prepared by ModelQuantizer (it has no quant_config)")
    tensors: dict[str, torch.Tensor] = {}
    info: dict[str, dict[str, Any]] = {}
    skip: set[str] = set()
    for name, m in model.named_modules():
        if not isinstance(m, QuantMixin):
            continue
        prefix = f"{name}." if name else ""
        skip.update({prefix + "weight", prefix + "bias"})
        for role in ("weight", "bias"):
            tensor = getattr(m, role, None)
            if isinstance(tensor, torch.Tensor):
                quantizer = getattr(m, QUANTIZER_ROLES[role], None)
                if quantizer is not None and not bool(quantizer.fake_quant_enabled):
                    quantizer = None
                stored, meta = encode_weight(tensor, quantizer)
                for suffix, value in stored.items():
                    tensors[prefix + role + suffix] = value.contiguous()
                info[prefix + role] = meta
        for role in ACT_ROLES:
            q = getattr(m, QUANTIZER_ROLES[role], None)
            if _has_qparams(q):
                scale, zp = q.calculate_qparams()  # type: ignore[union-attr]
                key = prefix + _ROLE_KEY[role]
                tensors[key + "_scale"], tensors[key + "_zero_point"] = scale.detach().float().clone(), zp.detach().clone()
                info[key] = {"encoding": "qparams"}
    for key, value in model.state_dict().items():
        if key not in skip and "_quantizer." not in key and key not in tensors:
            tensors[key] = value.detach().contiguous()
    metadata = {
        "format": "pt", "quant_method": "quark",
        "quantization_config": json.dumps(config.to_dict()), "quark_tensors": json.dumps(info),
    }  # fmt: skip
    tensors = {k: v.cpu() for k, v in tensors.items()}
    return write_atomically(output_dir, filename, lambda tmp: st.save_file(tensors, tmp, metadata=metadata))


def import_model_from_safetensors(model: nn.Module, model_dir: str | Path, filename: str = FILENAME) -> nn.Module:
    """Rebuild the quantized model from a float ``model`` of the same architecture and an exported directory.

    Returns the model prepared with the stored Config, weights set to their dequantized codes, every static
    quantizer frozen with the stored qparams, in eval mode."""
    st = _require_safetensors()
    path = Path(model_dir) / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (written by export_safetensors?)")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("quant_method") != "quark":
        raise ValueError(f"{path} is not a quark export (metadata quant_method={metadata.get('quant_method')!r})")
    tensors = st.load_file(str(path))
    info: dict[str, dict[str, Any]] = json.loads(metadata["quark_tensors"])
    config = Config.from_dict(json.loads(metadata["quantization_config"]))
    if not any(isinstance(m, QuantMixin) for m in model.modules()):
        ModelQuantizer(config).prepare(model)
    owned = {k for key in info for k in (key, key + "_scale", key + "_zero_point")}
    plain = {k: v for k, v in tensors.items() if k not in owned}
    missing, unexpected = model.load_state_dict(plain, strict=False)
    if unexpected:
        raise ValueError(f"{path}: tensors {unexpected} do not belong to {type(model).__name__}")
    with torch.no_grad():
        for name, m in model.named_modules():
            if not isinstance(m, QuantMixin):
                continue
            prefix = f"{name}." if name else ""
            for role in ("weight", "bias"):
                if prefix + role in info:
                    getattr(m, role).copy_(decode_weight(tensors, prefix + role, info[prefix + role]))
                    q = getattr(m, QUANTIZER_ROLES[role], None)
                    if prefix + role + "_scale" in tensors and info[prefix + role]["encoding"].startswith(("int", "float8", "minifloat")):
                        m.register_module(QUANTIZER_ROLES[role], FrozenScaledFakeQuantize(
                            q.spec, tensors[prefix + role + "_scale"], tensors.get(prefix + role + "_zero_point", torch.zeros((), dtype=torch.int32))))  # fmt: skip
            for role in ACT_ROLES:
                key = prefix + _ROLE_KEY[role]
                q = getattr(m, QUANTIZER_ROLES[role], None)
                if key in info and q is not None:
                    m.register_module(QUANTIZER_ROLES[role], FrozenScaledFakeQuantize(q.spec, tensors[key + "_scale"], tensors[key + "_zero_point"]))
    still = [k for k in missing if "_quantizer." not in k and k not in info]
    if still:
        raise ValueError(f"{path}: no tensors for {still}")
    return ModelQuantizer.freeze(model).eval()


def size_report(path: str | Path, model: nn.Module) -> dict[str, float]:
    """Bytes of an exported file against the FP32 state of ``model``'s parameters, and bits per parameter."""
    file_bytes = Path(path).stat().st_size
    params = [p for n, p in model.named_parameters() if "_quantizer" not in n]
    count = sum(p.numel() for p in params)
    fp32_bytes = 4 * count
    return {
        "file_bytes": file_bytes, "fp32_bytes": fp32_bytes, "ratio": file_bytes / fp32_bytes if fp32_bytes else 0.0,
        "bits_per_parameter": 8 * file_bytes / count if count else 0.0,
    }  # fmt: skip
