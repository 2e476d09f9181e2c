"""Observers: statistics -> (scale, zero_point). See ``observer.py``."""

from quark.torch.quantization.observer.observer import (
    OBSERVER_CLASSES,
    OBSERVER_MAP,
    ObserverBase,
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorHistogramObserverPro,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
    PlaceholderObserver,
    UniformScalingObserver,
)

__all__ = [
    "OBSERVER_CLASSES",
    "OBSERVER_MAP",
    "ObserverBase",
    "PlaceholderObserver",
    "UniformScalingObserver",
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerGroupMinMaxObserver",
    "PerBlockMXObserver",
    "PerBlockBFPObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
]
