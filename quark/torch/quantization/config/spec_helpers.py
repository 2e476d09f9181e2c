"""amd-quark's data-type spec helpers (0.11 and later): ``Int8PerTensorSpec(...).to_quantization_spec()`` and friends.

Each helper is a small dataclass with amd-quark 0.13's fields and defaults; ``to_quantization_spec()`` returns the
``QuantizationSpec`` (``QTensorConfig``) amd-quark builds from it. The helpers are generated from one table,
``_HELPERS``: a row names the dtype, the scheme and the fields. String options (``observer_method``, ``scale_type``,
``round_method``, ``zero_point_type``) take amd-quark's names. Not provided: amd-quark's ``FP8E5M3PerTensorSpec`` and
``AmdFP4Spec`` (fp8 e5m3 values / e5m3 scales) and ``OCP_MXFP4DiffsSpec`` (its observer), formats this engine lacks.
amd-quark 0.13 has no helper for ``qscheme=per_block`` (2-D ``block_size``): write that QuantizationSpec directly; the
``block_size`` of MX6Spec / MX9Spec is their 1-D block, i.e. ``group_size``. ``scale_type="float8_e8m0fnu"`` is
accepted here too (amd-quark's helpers do not take it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Any

from quark.torch.quantization.config.spec import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, RoundType, ScaleType, ZeroPointType
from quark.torch.quantization.observer.registry import observer_methods

#: amd-quark's names for per-tensor observers (from the observer registry), scale types, rounding and zero points
OBSERVER_METHODS = observer_methods()
SCALE_TYPES = {
    "float32": ScaleType.float32,
    "float16": ScaleType.float16,
    "bfloat16": ScaleType.bfloat16,
    "float": ScaleType.float,
    "power_of_2": ScaleType.pof2,
    "float8_e8m0fnu": ScaleType.float8_e8m0fnu,  # ours: amd-quark 0.13's helpers do not take it
}
ROUND_METHODS = {"round": RoundType.round, "floor": RoundType.floor, "half_even": RoundType.half_even}
ZERO_POINT_TYPES = {"int32": ZeroPointType.int32, "float32": ZeroPointType.float32}

REQUIRED = MISSING
_MX_KW = {
    "qscheme": "per_group",
    "group_size": 32,
    "scale_format": "e8m0",
    "observer_cls": "PerBlockMXObserver",
    "scale_type": ScaleType.float,
    "round_method": RoundType.half_even,
}
_PER_GROUP_FLOAT_FIELDS = {
    "ch_axis": REQUIRED,
    "group_size": REQUIRED,
    "scale_format": "float32",
    "scale_calculation_mode": None,
    "is_dynamic": True,
}


def _lookup(helper: str, field: str, table: dict[str, Any], value: Any) -> Any:
    if value is None:
        return None
    if value not in table:
        raise ValueError(f"{helper}.{field}={value!r}; allowed: {list(table)}")
    return table[value]


class DataTypeSpec:
    """Base of the spec helpers: ``to_quantization_spec()`` builds the QuantizationSpec from the fields."""

    _dtype: Dtype
    _qscheme: str | None = None
    _fixed: dict[str, Any] = {}

    def to_quantization_spec(self) -> QuantizationSpec:
        own = type(self).__name__
        kw: dict[str, Any] = {"dtype": self._dtype, **self._fixed}
        if self._qscheme is not None:
            kw["qscheme"] = self._qscheme
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "observer_method":
                kw["observer_cls"] = _lookup(own, f.name, observer_methods(), value)
            elif f.name == "scale_type":
                kw["scale_type"] = _lookup(own, f.name, SCALE_TYPES, value)
            elif f.name == "round_method":
                kw["round_method"] = _lookup(own, f.name, ROUND_METHODS, value)
            elif f.name == "zero_point_type":
                kw["zero_point_type"] = _lookup(own, f.name, ZERO_POINT_TYPES, value)
            elif f.name == "block_size":
                kw["group_size"] = value
            else:
                kw[f.name] = value
        if kw.get("scale_format") == "e8m0":  # OCP MX: the block observer whatever the float32 variant uses
            kw["observer_cls"] = "PerBlockMXObserver"
        return QuantizationSpec(**kw)


def _per_tensor(symmetric: bool) -> dict[str, Any]:
    return {
        "observer_method": "min_max",
        "symmetric": symmetric,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }


def _per_channel(symmetric: bool, is_dynamic: bool | None = False, **extra: Any) -> dict[str, Any]:
    return {
        "ch_axis": REQUIRED,
        "symmetric": symmetric,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": is_dynamic,
        **extra,
    }


def _per_group(symmetric: bool) -> dict[str, Any]:
    return {
        "ch_axis": REQUIRED,
        "group_size": REQUIRED,
        "symmetric": symmetric,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }


_CHANNEL = ("per_channel", {"observer_cls": "PerChannelMinMaxObserver"})
_GROUP = ("per_group", {"observer_cls": "PerGroupMinMaxObserver"})  # FP*PerGroupSpec too: float32 scales ("e8m0": MX)
_TENSOR = ("per_tensor", {})
_MX_FIELDS = {"ch_axis": REQUIRED, "is_dynamic": True, "scale_calculation_mode": "even"}

#: name -> (dtype, (qscheme, fixed QuantizationSpec fields), the helper's fields and defaults), as in amd-quark 0.13
_HELPERS: dict[str, tuple[Dtype, tuple[str | None, dict[str, Any]], dict[str, Any]]] = {
    "Uint4PerTensorSpec": (Dtype.uint4, _TENSOR, _per_tensor(False)),
    "Uint4PerChannelSpec": (Dtype.uint4, _CHANNEL, _per_channel(False, None, zero_point_type="int32")),
    "Uint4PerGroupSpec": (Dtype.uint4, _GROUP, _per_group(False)),
    "Int2PerGroupSpec": (Dtype.int2, _GROUP, _per_group(True)),
    "Int3PerGroupSpec": (Dtype.int3, _GROUP, _per_group(True)),
    "Int3PerChannelSpec": (Dtype.int3, _CHANNEL, _per_channel(False)),
    "Int4PerTensorSpec": (Dtype.int4, _TENSOR, _per_tensor(True)),
    "Int4PerChannelSpec": (Dtype.int4, _CHANNEL, _per_channel(True)),
    "Int4PerGroupSpec": (Dtype.int4, _GROUP, _per_group(True)),
    "Uint8PerTensorSpec": (Dtype.uint8, _TENSOR, _per_tensor(False)),
    "Uint8PerChannelSpec": (Dtype.uint8, _CHANNEL, _per_channel(True)),
    "Uint8PerGroupSpec": (Dtype.uint8, _GROUP, _per_group(False)),
    "Int8PerTensorSpec": (Dtype.int8, _TENSOR, _per_tensor(True)),
    "Int8PerChannelSpec": (Dtype.int8, _CHANNEL, _per_channel(False)),
    "Int8PerGroupSpec": (Dtype.int8, _GROUP, _per_group(True)),
    "FP8E4M3PerTensorSpec": (
        Dtype.fp8_e4m3,
        ("per_tensor", {"symmetric": True, "round_method": RoundType.half_even}),
        {"observer_method": "min_max", "scale_type": None, "is_dynamic": False},
    ),
    "FP8E5M2PerTensorSpec": (Dtype.fp8_e5m2, _TENSOR, _per_tensor(True)),
    "FP8E4M3PerChannelSpec": (Dtype.fp8_e4m3, _CHANNEL, _per_channel(True)),
    "FP8E5M2PerChannelSpec": (Dtype.fp8_e5m2, _CHANNEL, _per_channel(True)),
    "FP8E4M3PerGroupSpec": (Dtype.fp8_e4m3, _GROUP, dict(_PER_GROUP_FLOAT_FIELDS)),
    "FP8E5M2PerGroupSpec": (Dtype.fp8_e5m2, _GROUP, dict(_PER_GROUP_FLOAT_FIELDS)),
    "FP6E2M3PerGroupSpec": (Dtype.fp6_e2m3, _GROUP, dict(_PER_GROUP_FLOAT_FIELDS)),
    "FP6E3M2PerGroupSpec": (Dtype.fp6_e3m2, _GROUP, dict(_PER_GROUP_FLOAT_FIELDS)),
    "FP4PerGroupSpec": (Dtype.fp4, _GROUP, {**_PER_GROUP_FLOAT_FIELDS, "scale_type": "float"}),
    "Float16Spec": (Dtype.float16, (None, {"observer_cls": "PlaceholderObserver"}), {}),
    "Bfloat16Spec": (Dtype.bfloat16, (None, {"observer_cls": "PlaceholderObserver"}), {}),
    "OCP_MXFP8E4M3Spec": (Dtype.fp8_e4m3, (None, _MX_KW), dict(_MX_FIELDS)),
    "OCP_MXFP8E5M2Spec": (Dtype.fp8_e5m2, (None, _MX_KW), dict(_MX_FIELDS)),
    "OCP_MXFP6E3M2Spec": (Dtype.fp6_e3m2, (None, _MX_KW), dict(_MX_FIELDS)),
    "OCP_MXFP6E2M3Spec": (Dtype.fp6_e2m3, (None, _MX_KW), dict(_MX_FIELDS)),
    "OCP_MXFP4Spec": (Dtype.fp4, (None, _MX_KW), dict(_MX_FIELDS)),
    "OCP_MXINT8Spec": (Dtype.mx, (None, {"mx_element_dtype": Dtype.int8, "group_size": 32}), dict(_MX_FIELDS)),
    "MX6Spec": (Dtype.mx6, (None, {}), {"ch_axis": REQUIRED, "block_size": REQUIRED, "scale_calculation_mode": "even"}),
    "MX9Spec": (Dtype.mx9, (None, {}), {"ch_axis": REQUIRED, "block_size": REQUIRED, "scale_calculation_mode": "even"}),
    "BFP16Spec": (Dtype.bfp16, (None, {"group_size": 8}), {"ch_axis": REQUIRED, "scale_calculation_mode": "even"}),
}


def _make(name: str, dtype: Dtype, scheme: tuple[str | None, dict[str, Any]], fields: dict[str, Any]) -> type:
    required = [(k, Any) for k, v in fields.items() if v is REQUIRED]
    optional = [(k, Any, dataclasses.field(default=v)) for k, v in fields.items() if v is not REQUIRED]
    qscheme, fixed = scheme
    shown = ", ".join(f"{k}" if v is REQUIRED else f"{k}={v!r}" for k, v in fields.items())
    doc = f"{name}({shown}): {dtype.name}{' ' + qscheme if qscheme else ''} (amd-quark's spec helper)."
    namespace = {"_dtype": dtype, "_qscheme": qscheme, "_fixed": dict(fixed), "__doc__": doc, "__module__": __name__}
    return dataclasses.make_dataclass(name, [*required, *optional], bases=(DataTypeSpec,), namespace=namespace, eq=True)


for _name, (_dtype, _scheme, _fields) in _HELPERS.items():
    globals()[_name] = _make(_name, _dtype, _scheme, _fields)

__all__ = ["DataTypeSpec", *_HELPERS]
