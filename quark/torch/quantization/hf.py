"""Hugging Face conventions the engine meets, recognised by duck typing (the engine never imports transformers):
the KV cache a causal LM builds on every forward, and transformers' ``Conv1D`` layer (GPT-2's projections, weight
stored [in, out])."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.config.config import QuantizationSpec

#: keyword arguments through which a decoder layer receives the model's KV cache
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")  # "cache": transformers 5.2x layers


@contextmanager
def no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Forwards of ``model`` build and read no KV cache: every ``config.use_cache`` of its modules is False inside,
    and put back as it was on exit (also on error).

    Calibration and the algorithms run a model many times, and re-run single decoder layers on captured inputs: a
    cache would keep growing across those calls (stale keys and values attended to, or a shape error)."""
    saved: list[tuple[Any, Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not getattr(config, "use_cache", False):
            continue
        seen.add(id(config))
        saved.append((config, config.use_cache))
        config.use_cache = False
    try:
        yield
    finally:
        for config, value in saved:
            config.use_cache = value


def without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A decoder layer's keyword arguments with any cache object dropped and ``use_cache`` off, so that re-running the
    layer on them neither reads nor extends a cache."""
    out = {k: (None if k in CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (a linear layer whose weight is stored [in, out], as in GPT-2)."""
    return (
        hf_conv1d_class(type(module)) is not None
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.ndim == 2
        and getattr(module, "nf", None) == module.weight.shape[1]
    )


def hf_conv1d_class(cls: type) -> type | None:
    """Transformers' ``Conv1D`` class when ``cls`` is it or derives from it (a quantized twin does), else None."""
    return next((c for c in cls.__mro__ if c.__name__ == "Conv1D" and c.__module__.startswith("transformers")), None)


#: transformers' subclasses of nn.Linear whose forward computes exactly ``F.linear(x, weight, bias)``
LINEAR_EQUIVALENTS = ("FalconLinear",)


def hf_linear_equivalent(cls: type) -> type | None:
    """The transformers class in ``cls``'s MRO that is a plain linear layer with a forward of its own (as
    ``LINEAR_EQUIVALENTS`` lists), else None: such a layer is quantized as ``nn.Linear``."""
    return next(
        (c for c in cls.__mro__ if c.__name__ in LINEAR_EQUIVALENTS and c.__module__.startswith("transformers")), None
    )


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear layer as [out, in], whatever its storage: ``nn.Linear``'s own, a ``Conv1D``'s transposed
    (a view: in-place changes to it change the layer)."""
    return module.weight.t() if is_hf_conv1d(module) else module.weight


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` (or a subclass, a quantized twin included) or transformers' ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_hf_conv1d(module)


def transpose_weight_spec(spec: QuantizationSpec | None) -> QuantizationSpec | None:
    """``spec`` for the transposed 2-D weight: ``ch_axis`` 0 <-> 1 and a per-block ``block_size`` swapped.

    A ``Conv1D`` stores [in, out]: its quantizer gets the transposed spec, so per-channel still means per output
    feature and per-group still groups input features, as for ``nn.Linear``; qparams keep Linear's layout (one per
    output row, then per input group). The mapping is its own inverse."""
    if spec is None or (spec.ch_axis is None and spec.block_size is None):
        return spec
    changes: dict[str, Any] = {}
    if spec.ch_axis is not None:
        changes["ch_axis"] = 1 - spec.ch_axis % 2
    if spec.block_size is not None and not isinstance(spec.block_size, int):
        changes["block_size"] = list(reversed(list(spec.block_size)))
    return dataclasses.replace(spec, **changes)
