"""Named PTQ recipes as plain dicts (the YAML shape of a quark Config), shared by benchmarks and tests."""

from __future__ import annotations

from typing import Any

from quark.torch.quantization.config.config import Config

_STATIC = {"is_dynamic": False, "round_method": "half_even", "scale_type": "float"}

INT8_PER_CHANNEL_WEIGHT = {
    "dtype": "int8",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "observer_cls": "PerChannelMinMaxObserver",
    "symmetric": True,
    **_STATIC,
}
INT8_PER_TENSOR_ACT = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    **_STATIC,
}
INT4_G32_WEIGHT = {
    "dtype": "int4",
    "qscheme": "per_group",
    "ch_axis": 1,
    "group_size": 32,
    "observer_cls": "PerGroupMinMaxObserver",
    "symmetric": True,
    **_STATIC,
}
FP8_PER_TENSOR = {
    "dtype": "fp8_e4m3",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "is_dynamic": False,
}
INT4_POF2_WEIGHT = {
    "dtype": "int4",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "is_dynamic": False,
    "round_method": "half_even",
    "scale_type": "pof2",
}
INT8_POF2_ACT = {**INT4_POF2_WEIGHT, "dtype": "int8"}
MXFP4 = {"dtype": "mx", "mx_element_dtype": "fp4", "ch_axis": -1, "group_size": 32, "is_dynamic": True}
MXFP4_CONV_INPUT = {**MXFP4, "ch_axis": 1}  # NCHW activations: blocks along channels


def _tqt(spec: dict[str, Any], init: str) -> dict[str, Any]:
    return {**spec, "qat_spec": {"method": "tqt", "threshold_init_meth": init}}


def recipe(name: str, first_layer: str = "conv1") -> Config:
    """The Config of a named recipe. ``first_layer`` (too few input channels for a group of 32) keeps int8 weights."""
    recipes: dict[str, dict[str, Any]] = {
        "w8a8_int8": {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}},
        "w4_int4_g32": {
            "global_quant_config": {"weight": INT4_G32_WEIGHT},
            "layer_quant_config": {first_layer: {"weight": INT8_PER_CHANNEL_WEIGHT}},
        },
        "w8a8_fp8_e4m3": {"global_quant_config": {"weight": FP8_PER_TENSOR, "input_tensors": FP8_PER_TENSOR}},
        "w4a8_pof2": {"global_quant_config": {"weight": INT4_POF2_WEIGHT, "input_tensors": INT8_POF2_ACT}},
        "w4a8_tqt_3sd": {
            "global_quant_config": {
                "weight": _tqt(INT4_POF2_WEIGHT, "_3SD"),
                "input_tensors": _tqt(INT8_POF2_ACT, "_3SD"),
            }
        },
        "w4a8_tqt_ll_j": {
            "global_quant_config": {
                "weight": _tqt(INT4_POF2_WEIGHT, "_LL_J"),
                "input_tensors": _tqt(INT8_POF2_ACT, "_LL_J"),
            }
        },
        "mxfp4": {
            "global_quant_config": {"weight": {**MXFP4, "ch_axis": 1}, "input_tensors": MXFP4},
            "layer_type_quant_config": {
                "Conv2d": {"weight": {**MXFP4, "ch_axis": 1}, "input_tensors": MXFP4_CONV_INPUT}
            },
        },
    }
    if name not in recipes:
        raise ValueError(f"recipe {name!r} is not known; allowed: {sorted(recipes)}")
    return Config.from_dict(recipes[name])


RECIPES = ("w8a8_int8", "w4_int4_g32", "w8a8_fp8_e4m3", "mxfp4")
