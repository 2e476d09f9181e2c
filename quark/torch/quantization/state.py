"""Model state: the one record the engine and the callback keep on a model they prepared (``QuantState``, read
through ``quant_state``), and the state saved and restored around a measurement: the training flag of every
submodule (``preserve_modes``) and the observer / fake-quant switches of every quantizer (``paused_quantizers``).
One place for all of it, so every code path that evaluates, checks or exports in the middle of training puts back
exactly what it found (a BatchNorm frozen by ``freeze_bn_stats`` stays in eval; a quantizer switched off by the user
stays off), also on error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = ["QuantState", "quant_state", "ensure_quant_state", "preserve_modes", "paused_quantizers"]

#: the one attribute the engine adds to a model it prepares (a plain object in ``__dict__``, not in the state_dict)
_STATE_ATTR = "_quark_state"


@dataclass
class QuantState:
    """What the engine and the callback learned about a prepared model, kept with it instead of loose attributes.

    - ``functional_uses``: layer name -> Parameters a calibration forward fed to a weight op outside any quantizer
      (they stay float; ``ModelQuantizer.float_layers`` reports them).
    - ``graph_units`` / ``graph_float_layers``: graph mode, on the prepared GraphModule: the compute ops found and what
      each resolved to, and the float layers with their reasons (no fx nodes: the record is copyable).
    - ``load_hooks``: the load_state_dict pre-hooks that let a float checkpoint restore into the quantized model are
      registered (once per model).
    - ``float_start``: a float checkpoint was just loaded into the quantized model, so its quantizers start over
      (set by the load hook, taken once by the callback).
    """

    functional_uses: dict[str, list[str]] = field(default_factory=dict)
    graph_units: list[Any] | None = None
    graph_float_layers: list[Any] | None = None
    load_hooks: bool = False
    float_start: bool = False


def quant_state(model: nn.Module) -> QuantState | None:
    """``model``'s record, None if the engine never prepared it."""
    return model.__dict__.get(_STATE_ATTR)


def ensure_quant_state(model: nn.Module) -> QuantState:
    """``model``'s record, an empty one added when there is none."""
    return model.__dict__.setdefault(_STATE_ATTR, QuantState())


@contextmanager
def preserve_modes(module: nn.Module, mode: bool | None = None) -> Iterator[nn.Module]:
    """Each submodule's own ``training`` flag restored after the block, also on error; ``mode``: switch the module to
    ``train(mode)`` inside it (None: leave the modes as they are). Per submodule, not ``module.train(was_training)``,
    which would put a frozen BatchNorm (graph-mode QAT's ``freeze_bn_stats``) back in training."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        if mode is not None:
            module.train(mode)
        yield module
    finally:
        for m, training in modes:
            m.training = training


@contextmanager
def paused_quantizers(
    module: nn.Module, *, observers: bool = True, fake_quant: bool | Callable[[FakeQuantizeBase], bool] = False
) -> Iterator[list[FakeQuantizeBase]]:
    """Quantizer switches changed inside the block, both flags of every quantizer under ``module`` written back as
    they were after it (also on error; nothing is computed on the way back). Yields the quantizers.

    - ``observers``: the observers of static quantizers are off (statistics untouched), each through its own
      ``enable_observer(False)``, so a quantizer with statistics fixes its qparams from them (the quantized forwards
      in the block use those); dynamic quantizers compute their qparams on every call and keep their switch.
    - ``fake_quant``: a predicate, asked after the observers are switched: the quantizers it picks run in float (e.g.
      the ones without qparams yet). ``True``: a float run, every quantizer's both flags cleared directly (dynamic
      ones too, ``observers`` aside), so no qparams are computed from old statistics.
    """
    quantizers = [m for m in module.modules() if isinstance(m, FakeQuantizeBase)]
    saved = [(q.observer_enabled.clone(), q.fake_quant_enabled.clone(), q.flag_values()) for q in quantizers]
    try:
        _switch(quantizers, observers, fake_quant)
        yield quantizers
    finally:
        for q, (observe, quantize, values) in zip(quantizers, saved, strict=True):
            q.observer_enabled.copy_(observe)
            q.fake_quant_enabled.copy_(quantize)
            q.restore_flag_values(values, ("observer_enabled", "fake_quant_enabled"))


def _switch(
    quantizers: list[FakeQuantizeBase], observers: bool, fake_quant: bool | Callable[[FakeQuantizeBase], bool]
) -> None:
    """Apply ``paused_quantizers``' switches (see there)."""
    if fake_quant is True:
        for q in quantizers:
            q.set_flag("observer_enabled", 0)
            q.set_flag("fake_quant_enabled", 0)
        return
    if observers:
        for q in quantizers:
            if not q.is_dynamic:
                q.enable_observer(False)
    if callable(fake_quant):
        for q in quantizers:
            if fake_quant(q):
                q.set_flag("fake_quant_enabled", 0)
