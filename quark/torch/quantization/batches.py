"""Calibration data: how one batch is fed to a model (``run_batch``), whether a prepared model needs data, and the
calibration pass over a dataloader or a ``forward_loop`` that records what the forwards reached."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.coverage import track_forward
from quark.torch.quantization.formats import is_scaled
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin
from quark.torch.quantization.resolve import LayerPlan

__all__ = [
    "to_device",
    "run_batch",
    "model_device",
    "spec_needs_data",
    "plan_needs_data",
    "needs_data",
    "check_calibration_data",
    "feed_calibration",
]

_ACTIVATION_ROLES = ("input_tensors", "output_tensors")


def to_device(obj: Any, device: torch.device | None) -> Any:
    """``obj`` with its tensors (also inside dicts, lists and tuples) on ``device``; unchanged when device is None."""
    if device is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def run_batch(model: nn.Module, batch: Any, device: torch.device | None = None) -> Any:
    """Call ``model`` on one batch: tensor -> model(x); dict -> model(**batch); (input, target...) -> the input."""
    if isinstance(batch, list | tuple):
        if not batch:
            raise ValueError("a calibration batch is an empty tuple/list")
        batch = batch[0]
    batch = to_device(batch, device)
    if isinstance(batch, dict):
        return model(**batch)
    return model(batch)


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first Parameter (where its batches go), None for a model without Parameters."""
    for p in model.parameters():
        return p.device
    return None


def spec_needs_data(spec: QuantizationSpec | None) -> bool:
    """A static activation spec with a scale (or a learnable one, initialised from data) needs calibration data."""
    return spec is not None and not spec.is_dynamic and is_scaled(spec.dtype)


def plan_needs_data(plan: LayerPlan) -> bool:
    """Whether a planned layer's activation specs need calibration data (see ``spec_needs_data``)."""
    return spec_needs_data(plan.qconfig.input_tensors) or spec_needs_data(plan.qconfig.output_tensors)


def needs_data(model: nn.Module) -> bool:
    """Whether calibration must run the model: a static activation quantizer, or a weight quantizer of a slot that
    holds no Parameter (graph mode's functional weight: the weight reaches it only through the forward)."""
    return any(
        spec_needs_data(q.spec)
        for m in model.modules()
        if isinstance(m, QuantMixin)
        for slot, q in m.quantizer_slots()
        if slot.role in _ACTIVATION_ROLES or slot.tensor is None
    )


def check_calibration_data(dataloader: Iterable[Any] | None, forward_loop: Callable[[nn.Module], Any] | None) -> None:
    """Raise a ValueError when calibration needs data and neither a non-empty dataloader nor a forward_loop is given."""
    if dataloader is None and forward_loop is None:
        raise ValueError(
            "static activation quantization needs calibration data: pass a dataloader (or a forward_loop(model) "
            "callable), or make the activation specs dynamic (is_dynamic=True) or weight-only"
        )
    if dataloader is not None and hasattr(dataloader, "__len__") and len(dataloader) == 0:  # type: ignore[arg-type]
        raise ValueError("the calibration dataloader is empty; static activation quantization needs data")


def feed_calibration(
    model: nn.Module,
    dataloader: Iterable[Any] | None,
    forward_loop: Callable[[nn.Module], Any] | None,
    max_batches: int | None,
) -> tuple[int, dict[str, Any]]:
    """Run the calibration data; returns the batch count and what the forwards reached (see ``track_forward``:
    functional uses of Parameters are looked for on the first batch only, which is enough and keeps the rest fast)."""
    record: dict[str, Any] = {"reached": set(), "functional": {}}
    if forward_loop is not None:
        with track_forward(model, functional=True) as seen_by_loop:
            forward_loop(model)
        return 1, seen_by_loop
    device = model_device(model)
    seen = 0
    if max_batches is not None and max_batches <= 0:
        return 0, record
    for batch in dataloader:  # type: ignore[union-attr]
        with track_forward(model, functional=seen == 0) as one:
            run_batch(model, batch, device)
        record["reached"] |= one["reached"]
        record["functional"].update(one["functional"])
        seen += 1
        if max_batches is not None and seen >= max_batches:
            break  # before asking the loader for a batch that would not be used
    return seen, record
