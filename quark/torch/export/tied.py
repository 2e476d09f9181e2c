"""Tied weights on import: a Parameter that several modules hold (an ``lm_head`` tied to the input embeddings, two
Linear layers sharing one ``weight``), each of whose quantized holders the exports store as its own codes. Used by
both safetensors imports (``single_file.read_single_file``, ``quark_format.import_quark_dir``).

Per shared Parameter, once every layer is decoded (``TiedWeights.finish``):

- a holder stored in float (a float embedding, a layer with an unquantized weight): the Parameter holds the float
    values and each quantized holder keeps a quantizer frozen with its stored qparams, which quantizes them at each
    forward, as the exported model did;
- else, every quantized holder decoded to the same values bit for bit: the tie is kept, the Parameter holds them and
    each holder gets a pass-through quantizer (``decoded_weight_quantizer``);
- else (two different quantized versions of one tensor, e.g. int8 in one layer and int4 in the other): one
    Parameter cannot hold both, so each holder gets a Parameter of its own with its decoded values (untied), and a
    warning names the layers. Each layer computes what it computed in the exported model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from quark.torch.export.codec import decoded_weight_quantizer
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.nn.modules import QuantMixin
from quark.torch.quantization.nn.modules.quant_modules import QuantSlot, shared_tensors, slot_label
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize

__all__ = ["TiedWeights"]

logger = logging.getLogger(__name__)


@dataclass
class _Holder:
    """One quantized layer's decoded tensor for a shared Parameter, in the Parameter's layout."""

    name: str
    module: QuantMixin
    slot: QuantSlot
    values: torch.Tensor
    spec: QuantizationSpec | None  # None: stored as the model used it, unquantized
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None

    @property
    def label(self) -> str:
        return f"'{self.name}' ({slot_label(self.slot)})"


class TiedWeights:
    """The decoded weights of one import: written into their tensors with their quantizers at once, except where
    the Parameter is shared with other modules; those are settled by ``finish`` (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.shared = shared_tensors(model)
        self.held: dict[int, list[_Holder]] = {}

    def load(
        self,
        name: str,
        module: QuantMixin,
        slot: QuantSlot,
        view: torch.Tensor,
        values: torch.Tensor,
        spec: QuantizationSpec | None,
        scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
    ) -> None:
        """Write the decoded ``values`` of ``module``'s ``slot`` (layer ``name``) into ``view`` (its tensor, or the
        [out, in] view of a ``Conv1D``'s) and give the slot the quantizer ``decoded_weight_quantizer`` gives
        (``spec`` None: stored unquantized, no quantizer). A whole Parameter other modules hold is noted for
        ``finish`` instead."""
        view.copy_(values.to(view.dtype))
        param = getattr(module, slot.tensor) if slot.tensor is not None else None
        if isinstance(param, nn.Parameter) and id(param) in self.shared and view.numel() == param.numel():
            holder = _Holder(name, module, slot, param.detach().clone(), spec, scale, zero_point)
            self.held.setdefault(id(param), []).append(holder)
            return
        if spec is None:
            module.set_quantizer(slot, None)
            return
        quantizer = decoded_weight_quantizer(module, slot, spec, scale, zero_point, self.shared)
        if quantizer is not None:
            module.set_quantizer(slot, quantizer)

    def finish(self, float_keys: Iterable[str]) -> None:
        """Settle every shared Parameter noted by ``load``; ``float_keys``: the names of the float tensors the import
        loads afterwards (a float holder's, which then wins)."""
        state = self.model.state_dict(keep_vars=True)
        floated = {id(state[k]) for k in float_keys if k in state}
        for pid, holders in self.held.items():
            param = getattr(holders[0].module, holders[0].slot.tensor)  # type: ignore[arg-type]
            plain = [h for h in holders if h.spec is None]
            if pid in floated or plain:
                if plain:
                    param.data.copy_(plain[0].values)
                _keep_quantizing(holders)
            elif all(torch.equal(h.values, holders[0].values) for h in holders[1:]):
                param.data.copy_(holders[0].values)
                for h in holders:
                    _pass_through(h, set())
            else:
                _untie(holders, param)


def _keep_quantizing(holders: list[_Holder]) -> None:
    """The Parameter holds float values a float holder needs: each quantized holder keeps quantizing them, frozen
    with its stored qparams (a format without qparams keeps the quantizer the import prepared)."""
    for h in holders:
        if h.spec is None:
            h.module.set_quantizer(h.slot, None)
        elif h.scale is not None:
            h.module.set_quantizer(h.slot, FrozenScaledFakeQuantize(h.spec, h.scale, h.zero_point))


def _pass_through(h: _Holder, shared: set[int]) -> None:
    quantizer = decoded_weight_quantizer(h.module, h.slot, h.spec, h.scale, h.zero_point, shared)  # type: ignore[arg-type]
    if quantizer is not None:
        h.module.set_quantizer(h.slot, quantizer)


def _untie(holders: list[_Holder], param: nn.Parameter) -> None:
    """Give each holder a Parameter of its own with its decoded values and a pass-through quantizer."""
    for h in holders:
        setattr(h.module, h.slot.tensor, nn.Parameter(h.values, requires_grad=param.requires_grad))  # type: ignore[arg-type]
        _pass_through(h, set())
    logger.warning(
        "import: %s share one Parameter but were exported with different quantized values of it (%s); one "
        "Parameter cannot hold both, so each layer now has its own copy of its decoded weight (untied; the tie's "
        "memory saving is lost, and a model.tie_weights() call would tie them again and change the outputs). Each "
        "layer computes exactly what it computed in the exported model.",
        " and ".join(h.label for h in holders),
        ", ".join(_describe(h.spec) for h in holders),
    )


def _describe(spec: QuantizationSpec | None) -> str:
    """A spec in a few words for the message: dtype and scheme (with the group size)."""
    if spec is None:
        return "float"
    words = [spec.dtype.name]
    if spec.qscheme is not None:
        words.append(spec.qscheme.name)
    if spec.group_size:
        words.append(f"of {spec.group_size}")
    return " ".join(words)
