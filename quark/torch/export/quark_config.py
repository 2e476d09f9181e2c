"""amd-quark 0.13's ``quantization_config`` (config.json) both ways: ``to_quark_dict`` / ``from_quark_dict``, and
the export options it records (``check_export_options``)."""

from __future__ import annotations

from typing import Any

from quark.torch.export.packing import (
    PACK_ORDER,
)
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.config.type import Dtype

QUARK_VERSION = "0.13"
_SPEC_KEYS = (
    "dtype",
    "is_dynamic",
    "observer_cls",
    "qscheme",
    "ch_axis",
    "group_size",
    "symmetric",
    "round_method",
    "scale_type",
    "mx_element_dtype",
    "zero_point_type",
    "scale_format",
    "scale_calculation_mode",
    "block_size",
)


def _spec_to_quark(spec: QuantizationSpec | None) -> dict[str, Any] | None:
    """One QuantizationSpec as amd-quark 0.13 writes a QTensorConfig (MX with its element dtype and e8m0)."""
    if spec is None:
        return None
    d = {k: v for k, v in spec.to_dict().items() if k in _SPEC_KEYS}
    if spec.dtype == Dtype.mx and spec.mx_element_dtype != Dtype.int8:
        d.update(
            dtype=spec.mx_element_dtype.name,
            mx_element_dtype=None,
            scale_format="e8m0",  # type: ignore[union-attr]
            scale_calculation_mode=spec.mx_scale_mode,
        )
    d.setdefault("block_size", None)
    d.update(enable_buffer_reuse=False, is_scale_quant=False, max_input_numel=4 * 1024 * 1024)
    d.pop("qat_spec", None)
    return dict(sorted(d.items()))


def _layer_to_quark(qc: QuantizationConfig) -> dict[str, Any]:
    return {role: _spec_to_quark(getattr(qc, role)) for role in QuantizationConfig.ROLES} | {"target_device": None}


def to_quark_dict(
    config: Config, weight_format: str = "real_quantized", pack_method: str = "reorder"
) -> dict[str, Any]:
    """The ``quantization_config`` amd-quark 0.13 writes into config.json for ``config``.

    KV cache and attention as amd-quark's exporter writes them: ``kv_cache_quant_config``, ``kv_cache_post_rope`` and
    ``softmax_quant_spec`` beside the layer configs, ``kv_cache_group`` (empty without a KV-cache config) and
    ``min_kv_scale`` in the ``export`` block. Each KV-cache entry is also the ``layer_quant_config`` entry of its
    pattern (what its layers get, as amd-quark's LLMTemplate writes it): readers that resolve layers from
    ``layer_quant_config`` alone (vLLM, transformers' quark integration) find the k/v output quantizers there.
    """
    kv = {k: _layer_to_quark(v) for k, v in config.kv_cache_quant_config.items()}
    layers = {k: _layer_to_quark(v) for k, v in config.layer_quant_config.items()} | kv
    return {
        # the others are applied to the weights; a rotation's online part (input_rotation) is applied at run time
        "algo_config": [a.to_amd_quark_dict() for a in config.algo_configs if a.name == "rotation"] or None,  # type: ignore[attr-defined]
        "exclude": list(config.exclude),
        "export": {
            "kv_cache_group": list(config.kv_cache_group) if kv else [],
            "min_kv_scale": config.min_kv_scale,
            "pack_method": pack_method,
            "weight_format": weight_format,
            "weight_merge_groups": None,
        },
        "global_quant_config": _layer_to_quark(config.global_quant_config),
        "kv_cache_post_rope": config.kv_cache_post_rope,
        "kv_cache_quant_config": kv,
        "layer_quant_config": layers,
        "layer_type_quant_config": {k: _layer_to_quark(v) for k, v in config.layer_type_quant_config.items()},
        "quant_method": "quark",
        "quant_mode": config.quant_mode.name,
        "softmax_quant_spec": _spec_to_quark(config.softmax_quant_spec),
        "version": QUARK_VERSION,
    }


def json_mapping(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a ValueError naming the key ``where`` of config.json."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, found {type(value).__name__} {value!r}")
    return value


def _spec_from_quark(d: Any, where: str) -> QuantizationSpec | None:
    """One QTensorConfig of amd-quark's config.json (None: not quantized); a ValueError names its key otherwise."""
    if d is None:
        return None
    fields = {k: v for k, v in json_mapping(d, where).items() if k in _SPEC_KEYS}
    try:
        return QuantizationSpec.from_dict(fields)
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: {err}") from None


def _layer_from_quark(d: Any, where: str) -> QuantizationConfig:
    """One layer entry of amd-quark's config.json (a spec per role)."""
    roles = json_mapping(d, where)
    return QuantizationConfig(
        **{role: _spec_from_quark(roles.get(role), f"{where}.{role}") for role in QuantizationConfig.ROLES}
    )


def _entries_from_quark(q: dict[str, Any], key: str) -> dict[str, QuantizationConfig]:
    """``layer_quant_config`` / ``layer_type_quant_config``: name -> layer entry (absent or null: none)."""
    where = f"quantization_config.{key}"
    return {str(k): _layer_from_quark(v, f"{where}.{k}") for k, v in json_mapping(q.get(key) or {}, where).items()}


def check_export_options(weight_format: Any, pack_method: Any, where: str = "") -> None:
    """The export options this layout reads and writes (one rule for export and import): real_quantized weights,
    ``pack_method`` one of PACK_ORDER."""
    if weight_format != "real_quantized":
        raise ValueError(f"{where}weight_format={weight_format!r}; allowed here: 'real_quantized'")
    if not isinstance(pack_method, str) or pack_method not in PACK_ORDER:
        raise ValueError(f"{where}pack_method={pack_method!r}; allowed: {list(PACK_ORDER)}")


def from_quark_dict(q: dict[str, Any]) -> tuple[Config, dict[str, Any]]:
    """Our Config from amd-quark's ``quantization_config``, and its ``export`` block (checked); a malformed entry
    is a ValueError naming its key."""
    q = json_mapping(q, "quantization_config")
    if q.get("quant_method") != "quark":
        raise ValueError(
            f"quantization_config.quant_method={q.get('quant_method')!r}; only 'quark' directories are read"
        )
    if "global_quant_config" not in q:
        raise ValueError("quantization_config.global_quant_config is missing (amd-quark writes it in every export)")
    exclude = q.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise ValueError(f"quantization_config.exclude must be a list of layer names, found {exclude!r}")
    export = dict(json_mapping(q.get("export") or {}, "quantization_config.export"))
    export.setdefault("weight_format", "real_quantized")
    export.setdefault("pack_method", "reorder")
    check_export_options(export["weight_format"], export["pack_method"], "quantization_config.export.")
    layers = {
        "global_quant_config": _layer_from_quark(q["global_quant_config"], "quantization_config.global_quant_config"),
        "layer_quant_config": _entries_from_quark(q, "layer_quant_config"),
        "layer_type_quant_config": _entries_from_quark(q, "layer_type_quant_config"),
    }
    attention = {
        "kv_cache_quant_config": _entries_from_quark(q, "kv_cache_quant_config"),
        "kv_cache_post_rope": q.get("kv_cache_post_rope", False),
        "softmax_quant_spec": _spec_from_quark(q.get("softmax_quant_spec"), "quantization_config.softmax_quant_spec"),
        "kv_cache_group": export.get("kv_cache_group") or [],  # amd-quark keeps these two in the export block
        "min_kv_scale": export.get("min_kv_scale", 0.0),
    }
    try:
        algos = q.get("algo_config") or []
        rotations = (
            [a for a in algos if isinstance(a, dict) and a.get("name") == "rotation"] if isinstance(algos, list) else []
        )
        config = Config(
            **layers,
            **attention,
            exclude=list(exclude),
            quant_mode=q.get("quant_mode", "eager_mode"),
            algo_config=rotations or None,  # the online part of a rotation is applied at run time
        )
        return config, export
    except (ValueError, TypeError, KeyError) as err:  # the Config's own checks name the field
        raise ValueError(f"quantization_config: {err}") from None
