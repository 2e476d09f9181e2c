"""Keep quantization state identical across ranks (torch.distributed): observers and learnable quantizers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.quantization.nn.modules.quant_modules import iter_quantizers
from quark.torch.quantization.tensor_quantize import LSQFakeQuantize, ScaledFakeQuantize, TQTFakeQuantize

__all__ = ["is_distributed", "sync_observers", "sync_learnable"]


def is_distributed(group: Any = None) -> bool:
    """True when torch.distributed runs with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def sync_observers(model: nn.Module, group: Any = None) -> None:
    """Reduce every observer's statistics across ranks (min/max by min/max, histograms summed) and refresh the
    static qparams from them, so every rank holds the same qparams. Call it whenever qparams are fixed."""
    sync_quantizers([q for _, q in iter_quantizers(model)], group)


def flags_across_ranks(flags: list[bool], mode: str, device: torch.device, group: Any = None) -> list[bool]:
    """``flags`` (one per quantizer, the same quantizers on every rank) true on every rank (``mode="all"``) or on some
    rank (``"any"``): one collective call on ``device`` (where the quantizers' buffers are, as the observers' own
    reductions). Without several ranks, ``flags`` as they are."""
    if not flags or not is_distributed(group):
        return flags
    import torch.distributed as dist

    t = torch.tensor(flags, dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if mode == "all" else dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def sync_quantizers(quantizers: list[Any], group: Any = None) -> None:
    """``sync_observers`` for these quantizers only (the same list, in the same order, on every rank)."""
    if not is_distributed(group):
        return
    for q in quantizers:
        observer = getattr(q, "observer", None)
        if observer is None:
            continue
        observer.sync(group)
        if isinstance(q, ScaledFakeQuantize) and not q.is_dynamic and getattr(observer, "has_statistics", True):
            q._refresh_qparams()


@torch.no_grad()
def sync_learnable(model: nn.Module, group: Any = None) -> None:
    """Average TQT thresholds / LSQ scales across ranks: each rank initialised them from its own first batch."""
    if not is_distributed(group):
        return
    import torch.distributed as dist

    world = dist.get_world_size(group)
    for _, q in iter_quantizers(model):
        if isinstance(q, TQTFakeQuantize):
            dist.all_reduce(q.log_threshold.data, group=group)
            q.log_threshold.data /= world
        elif isinstance(q, LSQFakeQuantize):
            dist.all_reduce(q.scale.data, group=group)
            q.scale.data /= world
