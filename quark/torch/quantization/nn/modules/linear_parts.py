"""The Linear-equivalent parts of a quantized twin (``QuantMixin.linear_parts``: expert ``e``'s gate, up and down
projections of fused MoE experts) as Linears the algorithms read, write and hook like any other.

A ``LinearPart`` is not a child of its twin (the model's tree, state_dict and preparation never see it): its
``weight`` is the view of the stacked Parameter's block its slot quantizes (``slot_tensor``: writing into it writes
into the Parameter), its ``_weight_quantizer`` the twin's quantizer of that slot, and its forward pre-hooks run when
the twin's forward feeds the part its input (``feed_part``, called by the twin with exactly the rows the part
multiplies: for an expert, the tokens routed to it). So GPTQ collects a Hessian per expert and projection, and
AWQ / SmoothQuant fold scales into an expert's projections, through the same hooks as for Linear layers.
``named_modules_with_parts`` lists a module's submodules and, after each twin, its parts under
``"<twin>.<part>"`` (``"mlp.experts.3.up_proj"``, the names amd-quark's unfused experts have)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from quark.torch.quantization.nn.modules.slots import QuantSlot, slot_tensor

__all__ = ["LinearPart", "feed_part", "linear_part_modules", "named_modules_with_parts"]

#: twin -> part name -> handle id -> (part, hook, with_kwargs): kept beside the twins (no state on the modules)
_HOOKS: weakref.WeakKeyDictionary[nn.Module, dict[str, OrderedDict[int, tuple[LinearPart, Callable[..., Any], bool]]]]
_HOOKS = weakref.WeakKeyDictionary()


class LinearPart(nn.Linear):
    """One Linear-equivalent part ``name`` of the twin ``owner``, seen [out, in] without bias (module docstring).

    ``stage``: parts of one twin at one stage read inputs that no other part of that stage computes (an expert's
    gate and up projections, every expert's: stage 0; its down projection, which reads what its gate and up
    compute: stage 1), so GPTQ quantizes each stage's parts from one pass. ``input_key``: parts with the same key
    receive the very same input tensor (an expert's gate and up)."""

    bias = None

    def __init__(
        self, owner: nn.Module, name: str, weight_slot: QuantSlot, input_slot: QuantSlot | None, stage: int = 0
    ) -> None:
        nn.Module.__init__(self)
        object.__setattr__(self, "owner", owner)  # not a child: the twin holds the tensors and the quantizers
        self.part_name = name
        self.weight_slot = weight_slot
        self.input_slot = input_slot
        self.stage = stage

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The block of the twin's Parameter this part multiplies by, [out, in] (a view)."""
        return slot_tensor(self.owner, self.weight_slot)  # type: ignore[return-value]

    @property
    def in_features(self) -> int:  # type: ignore[override]
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:  # type: ignore[override]
        return self.weight.shape[0]

    @property
    def _weight_quantizer(self) -> nn.Module | None:
        """The twin's quantizer of this part's weight (None: not quantized)."""
        return getattr(self.owner, self.weight_slot.attr, None)

    @property
    def input_key(self) -> tuple[int, str]:
        """Equal for the parts of one twin that read one input tensor (the same input slot)."""
        return id(self.owner), self.input_slot.attr if self.input_slot is not None else self.part_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times this part's weight as the twin's forward sees it (fake-quantized when its quantizer is on)."""
        quantizer = self._weight_quantizer
        weight = self.weight if quantizer is None else quantizer(self.weight)
        return F.linear(x, weight)

    def register_forward_pre_hook(  # type: ignore[override]
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> RemovableHandle:
        """``hook(part, (x,))`` (with ``with_kwargs``: ``hook(part, (x,), {})``) each time the twin's forward feeds
        this part its input ``x``; ``prepend`` / ``always_call`` as for any module."""
        bucket = _HOOKS.setdefault(self.owner, {}).setdefault(self.part_name, OrderedDict())
        handle = RemovableHandle(bucket)  # it removes the entry from this very dict
        earlier = list(bucket.items()) if prepend else []
        if prepend:
            bucket.clear()
        bucket[handle.id] = (self, hook, with_kwargs)
        bucket.update(earlier)
        return handle

    def extra_repr(self) -> str:
        return f"{self.part_name} of {type(self.owner).__name__}, in_features={self.in_features}, out_features={self.out_features}"


def feed_part(owner: nn.Module, name: str, x: torch.Tensor) -> None:
    """Run the forward pre-hooks registered on ``owner``'s part ``name`` with its input ``x`` (the twin's forward
    calls this for every part it multiplies, before quantizing ``x``)."""
    buckets = _HOOKS.get(owner)
    bucket = buckets.get(name) if buckets else None
    if not bucket:
        return
    for part, hook, with_kwargs in list(bucket.values()):
        if with_kwargs:
            hook(part, (x,), {})
        else:
            hook(part, (x,))


def linear_part_modules(module: nn.Module) -> dict[str, LinearPart]:
    """Part name -> ``LinearPart`` for each Linear-equivalent part of a twin (``linear_parts()``; the twin's
    ``linear_part_stage(name)`` gives the stage, 0 without one); empty for any other module."""
    parts = getattr(module, "linear_parts", None)
    if not callable(parts):
        return {}
    stage_of = getattr(module, "linear_part_stage", None)
    return {
        name: LinearPart(module, name, weight, source, stage_of(name) if callable(stage_of) else 0)
        for name, weight, source in parts()
    }


def named_modules_with_parts(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``module.named_modules()``, each twin followed by its parts (``"<twin name>.<part name>"``)."""
    for name, m in module.named_modules():
        yield name, m
        for part, linear in linear_part_modules(m).items():
            yield f"{name}.{part}" if name else part, linear
