"""The shared machinery of the algorithms: calibration batches into the model, the inputs of the first decoder layer
captured (positional and keyword arguments, per batch), one decoder layer run on its cached inputs, and hooks that
collect what a submodule receives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.equivalence import check_equivalent
from quark.torch.quantization.hf import no_kv_cache, without_cache

LayerInputs = list[tuple[tuple[Any, ...], dict[str, Any]]]


class _Stop(Exception):
    """Raised by the capture hook: the rest of the model need not run."""


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple | list):
        return type(obj)(_detach(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layer: nn.Module, batches: list[Any], run: Callable[[nn.Module, Any], Any]) -> LayerInputs:
    """(args, kwargs) that ``layer`` receives for each calibration batch; the model stops at ``layer``.

    Each batch keeps its own keyword arguments (attention masks, position ids), so batches of different sequence
    lengths work."""
    cache: LayerInputs = []

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache.append((_detach(args), _detach(without_cache(kwargs))))
        raise _Stop

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with no_kv_cache(model):
            _run_until_stopped(model, layer, batches, run)
    finally:
        handle.remove()
    return cache


def _run_until_stopped(model: nn.Module, layer: nn.Module, batches: list[Any], run: Callable[[nn.Module, Any], Any]) -> None:
    for batch in batches:
        try:
            run(model, batch)
        except _Stop:
            continue
        raise ValueError(f"the calibration forward never reached the decoder layer {type(layer).__name__}")


def hidden_of(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returns (a tensor, or the first element of a tuple as in Hugging Face)."""
    return output[0] if isinstance(output, tuple | list) else output


def with_hidden(inputs: tuple[tuple[Any, ...], dict[str, Any]], hidden: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same call with new hidden states: the first positional argument, or ``hidden_states=``."""
    args, kwargs = inputs
    if args:
        return (hidden, *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    raise ValueError("a decoder layer called without positional arguments and without hidden_states=")


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """The layer's hidden-state outputs for every cached input."""
    return [hidden_of(layer(*args, **kwargs)) for args, kwargs in inputs]


def check_layer_kept(transform: str, where: str, layer: nn.Module, inputs: LayerInputs, reference: list[Any]) -> None:
    """One pass of ``layer`` over ``inputs`` compared with ``reference`` (its outputs before ``transform``):
    EquivalenceError naming ``transform`` and ``where`` beyond float noise (``equivalence.check_equivalent``)."""
    check_equivalent(transform, where, reference, run_layer(layer, inputs))


@contextmanager
def collect_inputs(modules: dict[str, nn.Module], sink: Callable[[str, nn.Module, torch.Tensor], None]) -> Iterator[None]:
    """Call ``sink(name, module, input)`` with the first positional input of each module on every forward."""
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: sink(name, mod, args[0]) if args else None)
        for name, m in modules.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_calls(module: nn.Module) -> Iterator[LayerInputs]:
    """Record every (args, kwargs) ``module`` is called with."""
    calls: LayerInputs = []
    handle = module.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((_detach(args), _detach(kwargs))), with_kwargs=True
    )
    try:
        yield calls
    finally:
        handle.remove()


def forward_order(model: nn.Module, modules: dict[str, nn.Module], batch: Any, run: Callable[[nn.Module, Any], Any]) -> list[str]:
    """Names of ``modules`` in the order one forward pass calls them first."""
    order: list[str] = []
    with collect_inputs(modules, lambda name, m, x: order.append(name) if name not in order else None), torch.no_grad():
        run(model, batch)
    return order + [n for n in modules if n not in order]
