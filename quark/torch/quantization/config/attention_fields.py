"""Checks of the KV-cache and attention fields of ``Config`` (amd-quark 0.13's ``kv_cache_quant_config``,
``kv_cache_group``, ``min_kv_scale``, ``kv_cache_post_rope`` and ``softmax_quant_spec``) that need no model: the
formats each path can hold, and the types of the plain fields. The checks against a model (a pattern that matches
no layer, an attention that is not eager) run in ``quark.torch.quantization.attention`` before anything is changed.
"""

from __future__ import annotations

import math
from typing import Any

from quark.torch.quantization.config.spec import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType

__all__ = [
    "KV_CACHE_DTYPES",
    "SOFTMAX_DTYPES",
    "check_kv_cache_group",
    "check_kv_spec",
    "check_min_kv_scale",
    "check_softmax_spec",
]

#: what a KV cache can store: one scale per k or v tensor, zero point 0 (vLLM reads fp8_e4m3 only)
KV_CACHE_DTYPES = (Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.int8)
#: the attention probabilities (in [0, 1]): one scale per attention, zero point 0 (amd-quark stores the scale only)
SOFTMAX_DTYPES = (Dtype.fp8_e4m3, Dtype.fp8_e5m2, Dtype.int8, Dtype.uint8)


def _check_per_tensor(where: str, spec: QuantizationSpec, allowed: tuple[Dtype, ...], what: str) -> None:
    """``spec`` is one of ``allowed`` dtypes, per tensor (a ValueError naming ``where`` otherwise)."""
    names = [d.name for d in allowed]
    if spec.dtype not in allowed:
        raise ValueError(f"{where}.dtype={spec.dtype.name}: {what} cannot hold it; allowed: {names}")
    if spec.qscheme not in (None, QSchemeType.per_tensor):
        raise ValueError(
            f"{where}.qscheme={spec.qscheme.name}: {what} has one scale per tensor; allowed: per_tensor"  # type: ignore[union-attr]
        )


def check_kv_spec(where: str, spec: QuantizationSpec | None) -> None:
    """The ``output_tensors`` of a ``kv_cache_quant_config`` entry: set, a KV-cache dtype, per tensor, symmetric.

    Args:
        where: How messages name the entry (``Config.kv_cache_quant_config['*k_proj']``).
        spec: The entry's ``output_tensors``.

    Raises:
        ValueError: Naming the entry, the value and what is allowed.
    """
    if spec is None:
        raise ValueError(
            f"{where}.output_tensors is None: a KV-cache entry quantizes the layer's output (the keys or values it "
            "computes); set output_tensors, e.g. FP8E4M3PerTensorSpec(observer_method='min_max', "
            "is_dynamic=False).to_quantization_spec()"
        )
    _check_per_tensor(f"{where}.output_tensors", spec, KV_CACHE_DTYPES, "a KV cache")
    if spec.dtype == Dtype.int8 and spec.symmetric is False:
        raise ValueError(
            f"{where}.output_tensors.symmetric=False: the KV cache stores keys and values with zero point 0 (the "
            "k/v scale merge of kv_cache_group assumes it); set symmetric=True"
        )


def check_softmax_spec(spec: QuantizationSpec | None) -> None:
    """``Config.softmax_quant_spec``: None, or a per-tensor spec of a dtype the probabilities can be stored in."""
    if spec is not None:
        _check_per_tensor("Config.softmax_quant_spec", spec, SOFTMAX_DTYPES, "the attention probabilities")


def check_kv_cache_group(value: Any) -> list[str]:
    """``Config.kv_cache_group``: a list of layer-name patterns (``["*k_proj", "*v_proj"]``), the first one's
    matches paired with the layers named alike by the others."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"Config.kv_cache_group={value!r} must be a list of layer-name patterns, e.g. ['*k_proj', '*v_proj']"
        )
    return list(value)


def check_min_kv_scale(value: Any) -> float:
    """``Config.min_kv_scale``: a finite number >= 0, the smallest k/v scale an export writes."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value and math.isfinite(value)):
        raise ValueError(f"Config.min_kv_scale={value!r} must be a finite number >= 0")
    return float(value)
