"""The shared machinery of the algorithms: calibration batches into the model, the inputs of every decoder layer
captured (positional and keyword arguments, per batch and per layer: layers of one model may get different attention
masks and rotary embeddings), the stack streamed one decoder layer at a time on those inputs, and hooks that collect
what a submodule receives."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.equivalence import check_equivalent
from quark.torch.quantization.hf import no_kv_cache, without_cache

LayerInputs = list[tuple[tuple[Any, ...], dict[str, Any]]]
RunFn = Callable[[nn.Module, Any], Any]
logger = logging.getLogger(__name__)


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
def capture_layer_inputs(
    model: nn.Module, layer: nn.Module, batches: list[Any], run: Callable[[nn.Module, Any], Any]
) -> LayerInputs:
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


def _run_until_stopped(
    model: nn.Module, layer: nn.Module, batches: list[Any], run: Callable[[nn.Module, Any], Any]
) -> None:
    for batch in batches:
        try:
            run(model, batch)
        except _Stop:
            continue
        raise ValueError(f"the calibration forward never reached the decoder layer {type(layer).__name__}")


def hidden_of(output: Any) -> torch.Tensor:
    """The hidden states a decoder layer returns (a tensor, or the first element of a tuple as in Hugging Face)."""
    return output[0] if isinstance(output, tuple | list) else output


def with_hidden(
    inputs: tuple[tuple[Any, ...], dict[str, Any]], hidden: torch.Tensor | None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same call with new hidden states: the first positional argument, or ``hidden_states=`` (None: the call
    without its hidden states, kept until they are known)."""
    args, kwargs = inputs
    if args:
        return (hidden, *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    raise ValueError("a decoder layer called without positional arguments and without hidden_states=")


def hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The hidden states of a decoder layer's call (where ``with_hidden`` puts them)."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise ValueError("a decoder layer called without positional arguments and without hidden_states=")


# ----------------------------------------------------------------------------------------------- every layer's own inputs
class _NoPassThrough(Exception):
    """The model cannot run with its decoder layers as recording pass-throughs (the reason is the message)."""


class _Detacher:
    """``_detach`` with one result per input object over a capture run: a tensor the model passes to several layers (a
    mask, the rotary embeddings) is held once, as one object, not as a view per layer."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Any, Any]] = {}  # id -> (the object, kept so its id is not reused; its result)

    def __call__(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor | tuple | list | dict):
            return obj
        hit = self._memo.get(id(obj))
        if hit is not None:
            return hit[1]
        if isinstance(obj, torch.Tensor):
            out: Any = obj.detach()
        elif isinstance(obj, dict):
            out = {k: self(v) for k, v in obj.items()}
        else:
            out = type(obj)(self(o) for o in obj)
        self._memo[id(obj)] = (obj, out)
        return out


def _as_output(template: Any, hidden: torch.Tensor) -> Any:
    """``hidden`` in the structure of a decoder layer's real output ``template``: a tensor, or a tuple/list whose
    first element is the hidden states (older transformers; the rest, e.g. T5's position bias, kept)."""
    if isinstance(template, torch.Tensor):
        return hidden
    if isinstance(template, tuple | list) and template:
        return type(template)((hidden, *template[1:]))
    raise ValueError(
        f"decoder layer 0 returns {type(template).__name__}, not a tensor or a tuple/list starting with the hidden states"
    )


class _Recorder:
    """The forward of every decoder layer during one capture run: records each call's (args, kwargs), returns the
    call's hidden states (a copy: the model may edit them in place) in the structure the real layer returns (layer 0
    runs for real on each batch to show it) and stops the model at the last layer.

    A layer called out of order or twice raises ValueError (the caller falls back). Layers after 0 are recorded
    without their hidden states: those come from the previous layer when the stack is streamed."""

    def __init__(self, count: int) -> None:
        self.calls: list[LayerInputs] = [[] for _ in range(count)]
        self.order: list[int] = []  # the layers called so far in the current batch
        self._detach = _Detacher()
        self._template: Any = None  # layer 0's real output on the current batch

    def start_batch(self) -> None:
        self.order, self._template = [], None

    def forward(self, index: int, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.order.append(index)
        if index != len(self.order) - 1:
            raise ValueError(f"the forward called decoder layers in the order {self.order}, not each once from 0")
        call = (args, without_cache(kwargs))
        self.calls[index].append(self._detach(call if index == 0 else with_hidden(call, None)))
        if index == len(self.calls) - 1:
            raise _Stop
        if index == 0:
            self._template = real(*call[0], **call[1])
        return _as_output(self._template, hidden_in(args, kwargs).clone())


@contextmanager
def _recording(layers: Sequence[nn.Module], recorder: _Recorder) -> Iterator[None]:
    """Every layer's ``forward`` replaced by ``recorder``'s (an instance attribute, so hooks still run), put back on
    exit (also on error)."""
    if len({id(m) for m in layers}) != len(layers):
        raise _NoPassThrough("a module appears more than once in the decoder stack")
    saved = [layer.__dict__.get("forward") for layer in layers]
    try:
        for i, layer in enumerate(layers):
            layer.__dict__["forward"] = partial(recorder.forward, i, layer.forward)
        yield
    finally:
        for layer, forward in zip(layers, saved, strict=True):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.__dict__["forward"] = forward


def _record_each_layer(
    model: nn.Module, layers: Sequence[nn.Module], batches: list[Any], run: RunFn
) -> list[LayerInputs]:
    """The calls of every layer per batch, from one forward per batch with the layers as recording pass-throughs;
    _NoPassThrough naming why when that is not possible (the model's own errors before the stack propagate)."""
    recorder = _Recorder(len(layers))
    with no_kv_cache(model), _recording(layers, recorder):
        for batch in batches:
            recorder.start_batch()
            try:
                run(model, batch)
            except _Stop:
                continue
            except Exception as e:
                if not recorder.order:
                    raise
                raise _NoPassThrough(f"{type(e).__name__}: {e}") from e
            if not recorder.order:
                raise ValueError(f"the calibration forward never reached the decoder layer {type(layers[0]).__name__}")
            raise _NoPassThrough(f"the forward called decoder layers {recorder.order} of 0..{len(layers) - 1} only")
    return recorder.calls


@torch.no_grad()
def capture_each_layer_inputs(
    model: nn.Module, layers: Sequence[nn.Module], batches: list[Any], run: RunFn
) -> list[LayerInputs]:
    """Per decoder layer of ``layers``, the (args, kwargs) the model calls it with for each calibration batch: each
    layer its own keyword arguments (Gemma2/3's sliding or full attention mask, Gemma3's local or global rotary
    embeddings), from one forward per batch that stops at the last layer. Layer 0's calls are complete; the others'
    hidden states are None (``layer_by_layer`` puts the previous layer's outputs there). What the model passes to
    several layers is held once (the same objects, detached, never copied).

    A model that cannot run with its layers as pass-throughs (it raises, or calls them otherwise than once each in
    order) gets layer 0's arguments for every layer, with a warning saying why."""
    try:
        return _record_each_layer(model, layers, batches, run)
    except _NoPassThrough as e:
        logger.warning(
            "could not capture each decoder layer's own inputs of %s (%s): every layer gets the keyword arguments of "
            "layer 0 (attention masks, rotary embeddings), right only if all layers take the same",
            type(model).__name__,
            e,
        )
    first = capture_layer_inputs(model, layers[0], batches, run)
    return [first] + [[with_hidden(c, None) for c in first] for _ in layers[1:]]


def layer_by_layer(
    model: nn.Module, layers: Sequence[nn.Module], batches: list[Any], run: RunFn
) -> Iterator[tuple[int, LayerInputs]]:
    """Each decoder layer's index and its inputs per calibration batch, one layer at a time: layer i + 1 gets its own
    captured arguments (``capture_each_layer_inputs``) with the hidden states layer i returns, computed when the
    caller asks for the next layer (after it processed layer i). Only the current layer's hidden states are held."""
    first, *rest = capture_each_layer_inputs(model, layers, batches, run)
    inputs, first = first, []
    for i, layer in enumerate(layers):
        yield i, inputs
        if i < len(rest):
            inputs = [with_hidden(c, h) for c, h in zip(rest[i], run_layer(layer, inputs), strict=True)]
            rest[i] = []


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs) -> list[torch.Tensor]:
    """The layer's hidden-state outputs for every cached input."""
    return [hidden_of(layer(*args, **kwargs)) for args, kwargs in inputs]


def check_layer_kept(transform: str, where: str, layer: nn.Module, inputs: LayerInputs, reference: list[Any]) -> None:
    """One pass of ``layer`` over ``inputs`` compared with ``reference`` (its outputs before ``transform``):
    EquivalenceError naming ``transform`` and ``where`` beyond float noise (``equivalence.check_equivalent``)."""
    check_equivalent(transform, where, reference, run_layer(layer, inputs))


@contextmanager
def collect_inputs(
    modules: dict[str, nn.Module], sink: Callable[[str, nn.Module, torch.Tensor], None]
) -> Iterator[None]:
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


def forward_order(
    model: nn.Module, modules: dict[str, nn.Module], batch: Any, run: Callable[[nn.Module, Any], Any]
) -> list[str]:
    """Names of ``modules`` in the order one forward pass calls them first."""
    order: list[str] = []
    with collect_inputs(modules, lambda name, m, x: order.append(name) if name not in order else None), torch.no_grad():
        run(model, batch)
    return order + [n for n in modules if n not in order]
