"""Fused producers in a scaling group: a Linear whose output holds several tensors (q, k and v in Phi-3's
``qkv_proj`` or GPT-NeoX's ``query_key_value``; gate and up in Phi-3's ``gate_up_proj``), of which only some rows
feed the group's layers (v -> the attention's output projection, up -> down_proj).

The layout is data (``FusedRows``, in the family's scaling group); ``producer_rows`` turns it into the producer row
each input channel of the layers reads. A scale is folded as ``W_prev[r] / s_r`` and ``W_layer[:, j] * s_j`` with
``s_j = s_r`` for ``r`` the row of channel ``j``: the float function is kept. With grouped-query attention several
channels (one per query head of a kv head) read one v row: their scales are tied to one value, the largest
(``tie_scales``), as amd-quark does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quark.torch.quantization.hf import is_linear, linear_weight


@dataclass(frozen=True)
class FusedRows:
    """Which output rows of a fused producer feed a group's layers.

    The producer's output is the consecutive ``parts``, each ``"all"`` (as many rows as the layers have input
    channels) or ``"kv"`` (one row per key/value channel: with grouped-query attention the layers' channels over the
    query heads per kv head; the kv parts share what the "all" parts leave of the producer's rows); the layers read
    part ``feeds``. ``per_head``: the parts repeat per kv head (GPT-NeoX: ``[q_h | k_h | v_h]`` per head) instead of
    following each other (Phi-3: ``[q | k | v]``, ``[gate | up]``). ``head_dim``: ``"module.attribute"`` (relative
    to the decoder layer) holding the head size; None: one head of all channels (gate | up).
    """

    parts: tuple[str, ...]
    feeds: int
    head_dim: str | None = None
    per_head: bool = False

    def __post_init__(self) -> None:
        if not self.parts or any(p not in ("all", "kv") for p in self.parts):
            raise ValueError(f"FusedRows.parts={self.parts!r}: each part must be 'all' or 'kv'")
        if not 0 <= self.feeds < len(self.parts):
            raise ValueError(f"FusedRows.feeds={self.feeds} is not the index of one of its parts {self.parts}")
        if "kv" in self.parts and self.head_dim is None:
            raise ValueError(f"FusedRows{self.parts}: 'kv' parts need head_dim (the module attribute of the head size)")


def producer_rows(
    spec: FusedRows | None, modules: dict[str, nn.Module], prev_op: str, layers: list[str]
) -> torch.Tensor | None:
    """For each input channel of ``layers``, the output row of the fused ``prev_op`` that it reads ([channels]
    int64); None without ``spec`` (row i feeds channel i). ``modules``: the decoder layer's, by name. ValueError
    naming the group, its shapes and the layout when they do not agree."""
    if spec is None:
        return None
    prev = modules[prev_op]
    produced = (linear_weight(prev) if is_linear(prev) else prev.weight).shape[0]
    widths = {linear_weight(modules[n]).shape[1] for n in layers}
    channels = min(widths)
    n_all, n_kv = spec.parts.count("all"), spec.parts.count("kv")
    kv = (produced - n_all * channels) // n_kv if n_kv else channels
    head = _attribute(modules, spec.head_dim) if spec.head_dim else channels
    if (
        len(widths) > 1
        or kv <= 0
        or n_all * channels + n_kv * kv != produced
        or not isinstance(head, int)
        or head <= 0
        or kv % head
        or channels % kv
    ):
        raise ValueError(
            f"{prev_op} -> {layers}: {produced} output rows of {prev_op}, input channels {sorted(widths)} of the "
            f"layers and a head size of {head!r} ({spec.head_dim}) do not fit the fused layout {spec}"
        )
    repeat = channels // kv  # query heads per kv head
    j = torch.arange(channels)
    head_of, d = j // head, j % head
    kv_head = head_of // repeat
    reads_all = spec.parts[spec.feeds] == "all"
    if spec.per_head:  # per kv head: its "all" parts have `repeat` heads, its "kv" parts one
        size = {"all": repeat * head, "kv": head}
        within = (head_of % repeat) * head + d if reads_all else d
        return kv_head * sum(size[p] for p in spec.parts) + sum(size[p] for p in spec.parts[: spec.feeds]) + within
    size = {"all": channels, "kv": kv}
    return sum(size[p] for p in spec.parts[: spec.feeds]) + (j if reads_all else kv_head * head + d)


def _attribute(modules: dict[str, nn.Module], path: str) -> object:
    """``"module.attribute"`` of a decoder layer (its modules by name), None when there is none."""
    module, _, name = path.rpartition(".")
    return getattr(modules.get(module), name, None)


def tie_scales(scales: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``scales`` (per input channel of the layers) with the channels that read one producer row (``rows``, from
    ``producer_rows``) set to the largest of their scales, so that the row can be divided by one value; ``scales``
    itself when ``rows`` is None."""
    if rows is None:
        return scales
    rows = rows.to(scales.device)
    per_row = torch.zeros(int(rows.max()) + 1, dtype=scales.dtype, device=scales.device)
    return per_row.scatter_reduce(0, rows, scales, "amax", include_self=False)[rows]


def row_scales(scales: torch.Tensor, rows: torch.Tensor, produced: int) -> torch.Tensor:
    """What each of the producer's ``produced`` output rows is divided by: the tied scale of the channels reading it
    (``tie_scales``), 1 for the rows that feed no channel (q and k; gate)."""
    rows = rows.to(scales.device)
    ones = torch.ones(produced, dtype=scales.dtype, device=scales.device)
    return ones.scatter_reduce(0, rows, tie_scales(scales, rows), "amax", include_self=False)
