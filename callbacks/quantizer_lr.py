"""A learning rate of their own for learned quantizer parameters (TQT log2 thresholds, LSQ scales) in the user's
optimizers.

A threshold only changes the power-of-two scale when ``ceil(log2 t)`` crosses an integer, so at a weight learning
rate (Adam at 5e-4: at most ~0.2 in log2 t over two epochs) TQT thresholds barely leave their initial value. With a
rate of their own, the learned quantizer parameters leave the groups they were in and form one group per optimizer, at ``quantizer_lr`` scaled by the schedule of the group they came
from (current lr / initial lr, read before every batch), without weight decay (decay would pull log2 t to 0, an
LSQ scale to 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class _Split:
    optimizer: torch.optim.Optimizer
    group: int  # index of the quantizer group in optimizer.param_groups
    source: int  # index of the group the parameters came from (whose schedule it follows)
    source_lr0: float | None = None  # that group's lr at the first batch, when no scheduler recorded an ``initial_lr``


#: per-group lists of torch's schedulers (``zip(..., strict=True)`` with the optimizer's groups)
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "max_lrs", "min_lrs")


def _extend_scheduler(scheduler: Any, groups_before: int, source: int) -> None:
    """Give a scheduler built before the split an entry for the new group (a copy of the source group's), so that
    it keeps stepping; chained / sequential schedulers pass it on to theirs."""
    for inner in getattr(scheduler, "_schedulers", None) or ():
        _extend_scheduler(inner, groups_before, source)
    for name in _PER_GROUP:
        values = getattr(scheduler, name, None)
        if isinstance(values, list) and len(values) == groups_before:
            values.append(values[source])


def split_quantizer_groups(
    optimizers: Sequence[torch.optim.Optimizer],
    params: Iterable[nn.Parameter],
    lr: float,
    schedulers: Sequence[Any] = (),
) -> list[_Split]:
    """Move ``params`` out of their groups into one new group per optimizer holding any of them, at ``lr``, with
    ``weight_decay=0`` and the other options (betas, eps, momentum...) of the first group they came from. Groups
    stay in place (possibly empty), and the optimizer's ``schedulers`` get an entry for the new group (whose lr
    ``follow_schedule`` sets before each batch)."""
    wanted = {id(p) for p in params}
    splits: list[_Split] = []
    for opt in optimizers:
        moved: list[nn.Parameter] = []
        source: int | None = None
        for i, group in enumerate(opt.param_groups):
            taken = [p for p in group["params"] if id(p) in wanted]
            if taken:
                source = i if source is None else source
                group["params"] = [p for p in group["params"] if id(p) not in wanted]
                moved += taken
        if source is None:
            continue
        src = opt.param_groups[source]
        options = {k: v for k, v in src.items() if k not in ("params", "lr", "initial_lr", "weight_decay")}
        if "weight_decay" in src:
            options["weight_decay"] = 0.0
        groups_before = len(opt.param_groups)
        opt.add_param_group({**options, "params": moved, "lr": lr})
        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is opt:
                _extend_scheduler(scheduler, groups_before, source)
        splits.append(_Split(opt, len(opt.param_groups) - 1, source))
    return splits


def follow_schedule(splits: Sequence[_Split], lr: float) -> None:
    """Set each quantizer group's lr to ``lr`` times its source group's schedule factor: current lr over the
    scheduler's ``initial_lr``, or over the lr at the first call (other callbacks may rescale rates when training
    starts). Groups are looked up by index: loading an optimizer state (resume) replaces the group dicts."""
    for s in splits:
        src = s.optimizer.param_groups[s.source]
        if s.source_lr0 is None:
            s.source_lr0 = float(src["lr"])
        lr0 = float(src.get("initial_lr", s.source_lr0))
        factor = float(src["lr"]) / lr0 if lr0 > 0 else 1.0
        s.optimizer.param_groups[s.group]["lr"] = lr * factor
