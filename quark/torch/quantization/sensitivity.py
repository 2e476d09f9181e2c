"""Moved to ``quark.torch.algorithm.sensitivity`` (it quantizes with the algorithms' round-to-nearest); this import
path keeps working for code written against it. The layer contracts allow this one upward import."""

from quark.torch.algorithm.sensitivity import (
    METHODS,
    LayerSensitivity,
    allocate,
    average_bits,
    hessian_sensitivity,
    hessian_trace,
    measure_sensitivity,
    mixed_precision_config,
    model_output,
    weight_bits,
)

__all__ = [
    "LayerSensitivity",
    "weight_bits",
    "measure_sensitivity",
    "hessian_trace",
    "hessian_sensitivity",
    "allocate",
    "mixed_precision_config",
    "average_bits",
    "METHODS",
    "model_output",
]
