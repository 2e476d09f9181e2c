"""Spec builders shared by the quantization tests (not collected: no test_ prefix)."""

from __future__ import annotations

from typing import Any

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.observer.observer import PerTensorMinMaxObserver


def int_spec(**overrides: Any) -> QuantizationSpec:
    """An int8 symmetric per-tensor static spec with every required field, overridden by ``overrides``."""
    kwargs: dict[str, Any] = dict(
        dtype=Dtype.int8,
        qscheme=QSchemeType.per_tensor,
        observer_cls=PerTensorMinMaxObserver,
        symmetric=True,
        scale_type=ScaleType.float,
        round_method=RoundType.half_even,
        is_dynamic=False,
    )
    kwargs.update(overrides)
    return QuantizationSpec(**kwargs)
