"""The slot model of the quantized twins: where a quantizer sits (``QuantSlot``), which tensor or block of a stacked
tensor it quantizes (``TensorPart``, ``slot_tensor``) and how exports and messages name it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "DEFAULT_SLOTS",
    "QuantSlot",
    "TensorPart",
    "slot_label",
    "slot_name",
    "slot_tensor",
    "slot_tensor_name",
]


@dataclass(frozen=True)
class TensorPart:
    """The 2-D block ``tensor[index, start:stop]`` of a stacked 3-D Parameter that a slot quantizes as a weight of its
    own, [out, in] (one expert's gate, up or down projection of fused MoE experts), and how messages, reports and
    this project's single file name it (``"3.gate_proj.weight"``)."""

    index: int
    start: int
    stop: int
    name: str


@dataclass(frozen=True)
class QuantSlot:
    """One quantizer position of a twin: the tensor role it takes its spec from, the attribute that holds it, and
    (weights and biases) the name of the Parameter it quantizes, with ``part`` where it quantizes a block of that
    Parameter only (``slot_tensor``). Layers with several weights (LSTM gates, attention projections, MoE experts)
    have several slots of one role."""

    role: str
    attr: str
    tensor: str | None = None
    part: TensorPart | None = None


DEFAULT_SLOTS = (
    QuantSlot("input_tensors", "_input_quantizer"),
    QuantSlot("output_tensors", "_output_quantizer"),
    QuantSlot("weight", "_weight_quantizer", "weight"),
    QuantSlot("bias", "_bias_quantizer", "bias"),
)


def slot_name(slot: QuantSlot) -> str:
    """A slot's attribute without the leading ``_`` and the ``_quantizer`` part (``_input_quantizer`` -> ``input``,
    ``_key_input_quantizer`` -> ``key_input``, ``_input_quantizer_l1`` -> ``input_l1``): how exports store its qparams."""
    name = slot.attr.lstrip("_")
    head, sep, tail = name.rpartition("_quantizer")
    return f"{head}{tail}" if sep else name


def slot_tensor_name(slot: QuantSlot) -> str | None:
    """The name of the tensor a weight / bias slot quantizes: its Parameter's, or its part's (``"3.gate_proj.weight"``);
    None for an activation slot."""
    return slot.part.name if slot.part is not None else slot.tensor


def slot_tensor(module: nn.Module, slot: QuantSlot) -> torch.Tensor | None:
    """The tensor a weight / bias slot quantizes: the Parameter ``slot.tensor`` of ``module``, or the view of its block
    ``slot.part`` (writing into the view writes into the Parameter; gradients through it reach the Parameter). None
    for an activation slot or a tensor ``module`` does not hold."""
    tensor = getattr(module, slot.tensor, None) if slot.tensor is not None else None
    if slot.part is None or not isinstance(tensor, torch.Tensor):
        return tensor
    return tensor[slot.part.index, slot.part.start : slot.part.stop]


def slot_label(slot: QuantSlot) -> str:
    """How messages name a slot: the tensor it quantizes, its role for the standard activation slots, else its
    name (``key_input``, ``input_l1``)."""
    if slot.tensor is not None:
        return slot_tensor_name(slot)  # type: ignore[return-value]
    if any(slot.attr == s.attr for s in DEFAULT_SLOTS):
        return slot.role
    return slot_name(slot)
