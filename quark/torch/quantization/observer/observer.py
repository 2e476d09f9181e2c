"""Observers: statistics of a tensor -> (scale, zero_point). One class per entry of Quark's observer doc.

Conventions (Quark's): symmetric integer scale = max(|min|, |max|) / ((qmax - qmin) / 2); asymmetric scale =
(max - min) / (qmax - qmin) with zero point ``qmin - round(min / scale)`` (int32, clamped) or ``qmin - min / scale``
(float32); minifloat scale = amax / max_normal. Ranges always include 0; a constant or all-zero tensor gives a finite
positive scale (>= eps); NaN or Inf in an observed tensor raises ValueError naming the layer and role (``where``,
set with the observer's quantizer). Every finite input up to float32's largest gives a finite scale: spans and
errors that would overflow float32 are computed in float64, histograms over the range normalised to [-1, 1], and
float16 / bfloat16 scales saturate (``apply_scale_type``). Static observers keep running statistics across batches;
dynamic ones (``is_dynamic=True``) recompute them on every call.

The classes live in sibling modules by family (``base``, ``minmax``, ``block``, ``histogram``, ``pow2``, ``qat``);
this module is amd-quark's path to all of them (and to ``MinMaxPlan``, ``minmax_qparams``, ``channel_minmax``,
``group_minmax``). Importing it registers every observer, in the order below.
"""

from __future__ import annotations

# isort: off
# the families in the order they register (base first: the others subclass it)
from quark.torch.quantization.observer.base import (
    MinMaxPlan,
    ObserverBase,
    PlaceholderObserver,
    channel_minmax,
    group_minmax,
    ObserverResets,
    minmax_qparams,
    reset_observers,
)
from quark.torch.quantization.observer.minmax import (
    PerBlock2DMinMaxObserver,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    UniformScalingObserver,
)
from quark.torch.quantization.observer.block import PerBlockBFPObserver, PerBlockMXObserver
from quark.torch.quantization.observer.histogram import (
    PerTensorHistogramObserver,
    PerTensorHistogramObserverPro,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
)
from quark.torch.quantization.observer.pow2 import (
    PerChannelPowOf2MinMaxObserver,
    PerTensorPowOf2MinMaxObserver,
    PerTensorPowOf2MinMSEObserver,
)
from quark.torch.quantization.observer.qat import LSQObserver, TQTObserver, threshold_3sd, threshold_kl_j
from quark.torch.quantization.observer.registry import OBSERVER_MAP, register_observer
# isort: on

__all__ = [
    "ObserverBase",
    "PlaceholderObserver",
    "UniformScalingObserver",
    "PerTensorMinMaxObserver",
    "PerChannelMinMaxObserver",
    "PerBlockMXObserver",
    "PerBlockBFPObserver",
    "PerGroupMinMaxObserver",
    "PerBlock2DMinMaxObserver",
    "PerTensorHistogramObserver",
    "PerTensorHistogramObserverPro",
    "PerTensorPercentileObserver",
    "PerTensorMSEObserver",
    "PerTensorPowOf2MinMaxObserver",
    "PerTensorPowOf2MinMSEObserver",
    "PerChannelPowOf2MinMaxObserver",
    "TQTObserver",
    "LSQObserver",
    "threshold_3sd",
    "threshold_kl_j",
    "OBSERVER_CLASSES",
    "OBSERVER_MAP",
    # the min-max arithmetic the fused pass shares (public here before the split; the reference page lists them)
    "minmax_qparams",
    "channel_minmax",
    "group_minmax",
    "MinMaxPlan",
    # many observers reset at once (QAT's per-batch weight reset)
    "reset_observers",
    "ObserverResets",
]

register_observer(ObserverBase)  # the base too, as amd-quark's ``observer_cls`` type
#: the observers this module defines (``OBSERVER_MAP`` also holds those registered later)
OBSERVER_CLASSES: frozenset[type[ObserverBase]] = frozenset(OBSERVER_MAP.values())
