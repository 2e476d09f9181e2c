"""Quantizer-state helpers shared by QuantCallback and its schedules: readiness, pausing, DDP broadcast exclusion."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from quark.torch.compat import ddp_ignore_states
from quark.torch.quantization.nn.modules import QuantMixin, iter_quantizers
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import (
    FakeQuantizeBase,
    LSQFakeQuantize,
    TQTFakeQuantize,
)


def is_learnable(q: FakeQuantizeBase) -> bool:
    """Whether a quantizer learns its threshold or scale (TQT, LSQ)."""
    return isinstance(q, TQTFakeQuantize | LSQFakeQuantize)


def is_ready(q: FakeQuantizeBase) -> bool:
    """Whether a quantizer has what it needs to quantize (qparams, or a learned threshold)."""
    if q.is_dynamic:
        return True
    if "initialized" in q._buffers:  # through the flag memo: no host sync on CUDA while unchanged
        return q.flag("initialized")
    initialized = getattr(q, "initialized", None)  # a SharedFakeQuantize: its source's
    return initialized is None or bool(initialized)


def read_late_checks(module: nn.Module) -> None:
    """Read every quantizer's training checks still on their way (a host sync on CUDA): a ValueError naming the layer
    if one found a bad learned value (TQT / LSQ) or a batch with NaN / Inf (an observer still on). Where a fit ends or
    a checkpoint is saved: the last steps' checks have no later training forward to read them."""
    for _, q in iter_quantizers(module):
        q.read_late_checks()


def device_of(quantizers: list[FakeQuantizeBase]) -> torch.device:
    """Where the quantizers' buffers are (their collectives run there); CPU for none."""
    return quantizers[0].observer_enabled.device if quantizers else torch.device("cpu")


def layers_of(module: nn.Module, quantizers: list[FakeQuantizeBase]) -> list[str]:
    """Names of the layers that hold ``quantizers``, sorted."""
    ids = {id(q) for q in quantizers}
    return sorted(
        name
        for name, m in module.named_modules()
        if isinstance(m, QuantMixin) and any(id(q) in ids for _, q in m.quantizers())
    )


def pause_quantizers(module: nn.Module) -> contextlib.AbstractContextManager[list[FakeQuantizeBase]]:
    """Observers off; quantizers without qparams yet off (they run in float); all flags restored after."""
    return paused_quantizers(module, fake_quant=lambda q: not is_ready(q))


def keep_out_of_ddp_broadcast(module: nn.Module) -> None:
    """Exclude the quantizers' buffers from DDP's buffer broadcast (set before the strategy wraps the module).

    DDP copies rank 0's buffers to every rank before each forward: running observer statistics of the other ranks
    would be overwritten batch after batch, so their reduction when the qparams are fixed would miss those ranks'
    data. Quantization state is kept identical by ``sync_observers`` / ``sync_learnable`` instead; learnable
    thresholds stay Parameters whose gradients DDP reduces.
    """
    names = [
        f"{name}.{buffer}" if name else buffer
        for name, m in module.named_modules()
        if isinstance(m, FakeQuantizeBase)
        for buffer, _ in m.named_buffers()
    ]
    ddp_ignore_states(module, names)
