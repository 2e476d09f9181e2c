"""Keep quantization state identical across ranks (torch.distributed): observers and learnable quantizers, and
models sharded by FSDP2 (``fully_shard``: DTensor parameters).

Under FSDP2 a forward sees each layer's gathered (unsharded) Parameters; outside a forward the module holds its
rank's shards. Reading weights outside a forward (export, reports) goes through ``gathered_parameters``; a learned
quantizer value initialised inside a forward is written into the shards by ``write_initial_values`` (FSDP2 frees
the gathered copy after the forward without copying it back).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.nn.modules.quant_modules import iter_quantizers
from quark.torch.quantization.tensor_quantize import (
    LearnableFakeQuantize,
    LSQFakeQuantize,
    ScaledFakeQuantize,
    TQTFakeQuantize,
)

__all__ = [
    "is_distributed",
    "sync_observers",
    "sync_learnable",
    "is_sharded",
    "has_sharded_parameters",
    "gathered_parameters",
    "write_initial_values",
    "refuse_sharded",
]


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
        if isinstance(q, LearnableFakeQuantize):
            q.take_initial_value()  # DDP: the average below is the value; nothing left to write
            if is_sharded(q.learned_parameter):
                continue  # FSDP2: one Parameter across the ranks, averaged by write_initial_values
        if isinstance(q, TQTFakeQuantize):
            dist.all_reduce(q.log_threshold.data, group=group)
            q.log_threshold.data /= world
        elif isinstance(q, LSQFakeQuantize):
            dist.all_reduce(q.scale.data, group=group)
            q.scale.data /= world


# ----------------------------------------------------------------------------------------------- FSDP2
def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a Parameter sharded by FSDP2's ``fully_shard``, outside a forward)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def has_sharded_parameters(model: nn.Module) -> bool:
    """Whether any Parameter of ``model`` is a DTensor (FSDP2 applied, outside a forward)."""
    return any(is_sharded(p) for p in model.parameters())


def refuse_sharded(model: nn.Module, what: str, instead: str) -> None:
    """ValueError naming ``what`` and one sharded Parameter when FSDP2 has sharded ``model`` (outside a forward its
    Parameters are DTensor shards), saying what to do ``instead``."""
    name = next((n for n, p in model.named_parameters() if is_sharded(p)), None)
    if name is not None:
        raise ValueError(
            f"{what}: the model's Parameters are sharded by FSDP2 (fully_shard; e.g. {name} is a DTensor shard). "
            f"{instead}"
        )


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules ``fully_shard`` was applied to (``model`` included), in module order."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: every FSDP2-sharded Parameter of ``model`` is replaced on its module by a plain Parameter holding the
    full tensor (tied Parameters stay tied), for code that reads weights outside a forward (export, reports,
    ``state_dict``); the shards are put back on the way out. A collective: every rank enters it, and each holds the
    whole model's weights meanwhile. Read only: writes to the full copies do not reach the shards. Without FSDP2,
    ``model`` as it is.
    """
    modules = _fsdp_modules(model)
    for m in modules:
        m.reshard()  # type: ignore[operator]  # every group sharded: FSDP2's state_dict hooks then leave ours alone
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    full: dict[int, nn.Parameter] = {}
    try:
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if not is_sharded(param):
                    continue
                if id(param) not in full:
                    full[id(param)] = nn.Parameter(param.full_tensor().detach(), requires_grad=param.requires_grad)
                swapped.append((module, name, param))
                setattr(module, name, full[id(param)])
        yield model
    finally:
        for module, name, param in reversed(swapped):
            setattr(module, name, param)


def _pending_learnable(model: nn.Module) -> list[LearnableFakeQuantize]:
    """The learnable quantizers whose Parameter FSDP2 shards, in module order (the same list on every rank)."""
    return [
        q for _, q in iter_quantizers(model) if isinstance(q, LearnableFakeQuantize) and is_sharded(q.learned_parameter)
    ]


@torch.no_grad()
def write_initial_values(model: nn.Module, group: Any = None) -> int:
    """FSDP2: write the TQT thresholds / LSQ scales that a forward initialised into their shards, averaged over the
    ranks that initialised them (each from its own first batch, as ``sync_learnable`` does under DDP). Call it after
    the forward and before backward: backward gathers the shards again, and the optimizer steps on them. A
    collective over every rank; a rank that did not initialise a quantizer takes the others' value (and marks it
    initialised). Every sharded module is resharded first (the root module keeps its gathered Parameters after
    forward; backward gathers them again). Returns how many quantizers were written.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    for m in _fsdp_modules(model):
        m.reshard()  # type: ignore[operator]  # the root keeps its gathered copy after forward: back to the shards
    quantizers = _pending_learnable(model)
    if not quantizers:
        return 0
    values = [q.take_initial_value() for q in quantizers]
    params = [q.learned_parameter for q in quantizers]
    device = quantizers[0].initialized.device  # where the collective runs (the quantizers' buffers)
    flat = torch.cat(
        [
            (v if v is not None else torch.zeros(p.shape)).reshape(-1).float().to(device)
            for v, p in zip(values, params, strict=True)
        ]
    )
    counts = torch.tensor([0.0 if v is None else 1.0 for v in values], device=device)
    if is_distributed(group):
        dist.all_reduce(flat, group=group)
        dist.all_reduce(counts, group=group)
    written, offset = 0, 0
    for q, p, count in zip(quantizers, params, counts.tolist(), strict=True):
        value = flat[offset : offset + p.numel()].reshape(p.shape)
        offset += p.numel()
        if count == 0:
            continue
        full = (value / count).to(p.dtype)
        p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
        q.set_flag("initialized", 1)
        written += 1
    return written
