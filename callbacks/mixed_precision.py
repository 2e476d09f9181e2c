"""Mixed precision for ``QuantCallback(mode="ptq", mixed_precision=...)``: at calibration time, measure each layer's
sensitivity to each candidate format on calibration batches, allocate formats under an average-bits budget, and
quantize with the resulting Config (the engine's ``quark.torch.quantization.sensitivity``). Also writes what it found:
``sensitivity.csv`` and the chosen Config as YAML (``mixed_precision.yaml``), reusable as a Hydra ``quant`` preset."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from quark.torch.algorithm.sensitivity import (
    METHODS,
    LayerSensitivity,
    allocate,
    average_bits,
    measure_sensitivity,
    mixed_precision_config,
)
from quark.torch.export.files import write_text_atomically
from quark.torch.quantization.config.config import Config, QuantizationConfig

__all__ = ["MixedPrecision", "choose", "write_sensitivity_csv", "write_config_yaml"]


@dataclass
class MixedPrecision:
    """What ``QuantCallback(mixed_precision=...)`` searches.

    Args:
        candidates: name -> QuantizationConfig (or its dict) each layer may get; the callback's Config supplies the
            rest (``exclude``, ...).
        target_bits: the budget, average weight bits per parameter over the layers chosen (scales counted).
        method: output divergence used without a metric: ``"kl"`` (logits) or ``"mse"``.
        metric: optional ``metric(module) -> float`` (e.g. validation accuracy on a held-out batch set): the
            sensitivity is its drop from the float model's value.
        higher_is_better: the metric's direction.
        batches: calibration batches the sensitivity is measured on.
    """

    candidates: dict[str, QuantizationConfig | dict[str, Any]]
    target_bits: float
    method: str = "kl"
    metric: Callable[[nn.Module], float] | None = None
    higher_is_better: bool = True
    batches: int = 8
    resolved: dict[str, QuantizationConfig] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.candidates, dict) or not self.candidates:
            raise ValueError(
                "mixed_precision.candidates must be a non-empty dict: name -> QuantizationConfig (or its dict)"
            )
        self.resolved = {
            name: qc if isinstance(qc, QuantizationConfig) else QuantizationConfig.from_dict(dict(qc))
            for name, qc in self.candidates.items()
        }
        bits = self.target_bits
        if isinstance(bits, bool) or not isinstance(bits, int | float) or not 0 < bits < math.inf:
            raise ValueError(
                f"mixed_precision.target_bits={bits!r} must be a finite number > 0 (average weight bits per parameter)"
            )
        if self.method not in METHODS:
            raise ValueError(f"mixed_precision.method={self.method!r}; allowed: {list(METHODS)}")
        if isinstance(self.batches, bool) or not isinstance(self.batches, int) or self.batches < 1:
            raise ValueError(f"mixed_precision.batches={self.batches!r} must be an int >= 1")
        if self.metric is not None and not callable(self.metric):
            raise ValueError("mixed_precision.metric must be callable as metric(module) -> float")


def choose(
    model: nn.Module, base: Config, search: MixedPrecision, batches: Sequence[Any], run: Callable[[nn.Module, Any], Any]
) -> tuple[Config, dict[str, str], list[LayerSensitivity]]:
    """(the mixed Config, the candidate per layer, the measured sensitivities) for the float ``model``."""
    sensitivities = measure_sensitivity(
        model,
        search.resolved,
        batches,
        metric=search.metric,
        higher_is_better=search.higher_is_better,
        method=search.method,
        base_config=base,
        run=run,
    )
    choice = allocate(sensitivities, float(search.target_bits))
    return mixed_precision_config(base, choice, search.resolved), choice, sensitivities


def write_sensitivity_csv(path: str | Path, sensitivities: Sequence[LayerSensitivity], choice: dict[str, str]) -> Path:
    """One row per layer and candidate: layer, parameters, candidate, bits per parameter, loss, chosen (0/1)."""
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["layer", "params", "candidate", "bits", "loss", "chosen"])
    for s in sensitivities:
        for c in s.loss:
            writer.writerow(
                [s.layer, s.numel, c, f"{s.bits[c]:.6g}", f"{s.loss[c]:.9g}", int(choice.get(s.layer) == c)]
            )
    return write_text_atomically(path, text.getvalue(), newline="")  # complete or absent, as every file written here


def write_config_yaml(
    path: str | Path, config: Config, sensitivities: Sequence[LayerSensitivity], choice: dict[str, str]
) -> Path:
    """The chosen Config as YAML (``Config.from_dict`` reads it back), headed by the average bits it reached."""
    header = f"# mixed precision: {average_bits(choice, sensitivities):.4f} weight bits per parameter on average\n"
    return write_text_atomically(path, header + yaml.safe_dump(plain_data(config.to_dict()), sort_keys=False))


def plain_data(obj: Any) -> Any:
    """Config.to_dict output with enums and classes as their names, so YAML holds only plain values."""
    if isinstance(obj, dict):
        return {k: plain_data(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [plain_data(v) for v in obj]
    if isinstance(obj, str | int | float | bool) or obj is None:
        return obj
    return getattr(obj, "value", None) if hasattr(obj, "value") else getattr(obj, "__name__", str(obj))
