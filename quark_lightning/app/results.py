"""A run's ``results.json`` (what was run, the metric float vs quantized, size, SQNR, timings, configs) and the short
table printed at its end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from quark.torch.export.files import write_text_atomically
from quark.torch.quantization.config.config import Config
from quark_lightning.app.conf import QuantFlow, nominal_bits


def build_results(
    cfg: DictConfig,
    flow: QuantFlow,
    config: Config | None,
    metric: str,
    higher_is_better: bool,
    float_metrics: dict[str, float],
    quant_metrics: dict[str, float] | None,
    report: dict[str, Any],
    float_bits: int,
    timings: dict[str, float],
) -> dict[str, Any]:
    """The run's ``results.json`` content; ValueError when the test step did not log ``metric``."""
    if metric not in float_metrics:
        raise ValueError(f"metric.name={metric!r} was not logged by the test step; logged: {sorted(float_metrics)}")
    float_value = float_metrics[metric]
    quant_value = quant_metrics.get(metric) if quant_metrics else None
    size = report.get("size") or {
        "fp32_bits": float_bits,
        "quantized_bits": float_bits,
        "fp32_bytes": math.ceil(float_bits / 8),
        "quantized_bytes": math.ceil(float_bits / 8),
        "compression": 1.0,
    }
    return {
        "task": {"data": cfg.data.get("_target_"), "model": cfg.model.get("_target_")},
        "quant": {
            "name": flow.name,
            "mode": flow.mode,
            "weight_bits": nominal_bits(config, "weight"),
            "act_bits": nominal_bits(config, "input_tensors"),
            "weight_bits_knob": flow.weight_bits,
            "act_bits_knob": flow.act_bits,
        },
        "metric": {
            "name": metric,
            "mode": "max" if higher_is_better else "min",
            "float": float_value,
            "quantized": quant_value,
            "delta": None if quant_value is None else quant_value - float_value,
        },
        "float_metrics": float_metrics,
        "quantized_metrics": quant_metrics,
        "size": size,
        "sqnr_db": report.get("sqnr_db"),
        "export": report.get("export"),
        "wall_time_s": timings,
        "quark_config": config.to_dict() if config is not None else None,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomic write: a temporary file in the same folder, synced, then a rename (``write_atomically``)."""
    write_text_atomically(path, json.dumps(data, indent=2, default=str))


def format_table(results: dict[str, Any]) -> str:
    """The short table printed at the end of a run."""
    m, q, size = results["metric"], results["quant"], results["size"]
    label = f"{q['name']} ({q['mode']}, weights {_weight_bits(results)}, activations {q['act_bits']:g} bits)"
    rows = [("model", m["name"], "size")]
    rows.append(("float", f"{m['float']:.2f}", _bytes(size["fp32_bytes"])))
    if m["quantized"] is not None:
        rows.append((q["name"], f"{m['quantized']:.2f} ({format_delta(m['delta'])})", _bytes(size["quantized_bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{label}; wall time {results['wall_time_s']['total_s']:.1f} s"]
    for i, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_delta(delta: float, decimals: int = 2) -> str:
    """A signed difference with ``decimals`` decimals, or two significant digits when it is nonzero but would round
    to zero there (a perplexity moving by 0.004 prints -0.004, not -0.00)."""
    if delta != 0 and abs(delta) < 0.5 * 10**-decimals:
        return f"{delta:+.2g}"
    return f"{delta:+.{decimals}f}"


def _weight_bits(results: dict[str, Any]) -> str:
    """The weights' width in the table's title: a mixed run names both of its averages, per element and with the
    per-channel / per-group scales counted (the budget quant.target_bits counts the scales)."""
    mixed = results.get("mixed_precision")
    if mixed:
        return f"{mixed['avg_element_bits']:g} bits per element, {mixed['avg_bits']:.4f} with scales"
    return f"{results['quant']['weight_bits']:g} bits"


def _bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.2f} MiB"
