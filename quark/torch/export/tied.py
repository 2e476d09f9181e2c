"""Tied weights in the safetensors exports: a Parameter that several modules hold (an ``lm_head`` tied to the input
embeddings, two Linear layers sharing one ``weight``), each of whose quantized holders the exports store as its own
codes (a float holder's values are stored once, ``codec.first_of_its_storage``). Used by both imports
(``single_file.read_single_file``, ``quark_format.import_quark_dir``) and by amd-quark's directory, whose config.json
says ``tie_word_embeddings: false`` when the input embeddings and the lm_head are stored as different quantized
versions of their one weight (``embeddings_stored_apart``): a Hugging Face loader then builds them untied.

Per shared Parameter, once every layer is decoded (``TiedWeights.finish``):

- a holder stored in float (a float embedding, a layer with an unquantized weight): the Parameter holds the float
    values and each quantized holder keeps a quantizer frozen with its stored qparams, which quantizes them at each
    forward, as the exported model did;
- else, every quantized holder decoded to the same values bit for bit: the tie is kept, the Parameter holds them and
    each holder gets a pass-through quantizer (``decoded_weight_quantizer``);
- else (two different quantized versions of one tensor, e.g. int8 in one layer and int4 in the other): one
    Parameter cannot hold both, so the holders whose values differ from the first one's get a Parameter of their own
    (``untie_differing_weights``, which also sets a Hugging Face ``config.tie_word_embeddings`` to False), each with
    its decoded values and a pass-through quantizer, and a warning names the layers. Each layer computes what it
    computed in the exported model.
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
from quark.torch.quantization.online_rotation import untie_differing_weights
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize

__all__ = ["TiedWeights", "embeddings_stored_apart"]

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
        self.float_held = _float_held(model, self.shared)  # loaded as before: no copy of the decoded values kept
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
        if id(param) in self.shared and id(param) not in self.float_held and view.numel() == param.numel():
            holder = _Holder(name, module, slot, param.detach().clone(), spec, scale, zero_point)
            self.held.setdefault(id(param), []).append(holder)
            return
        if spec is None:
            if getattr(module, slot.attr, None) is not None:
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
                _untie(self.model, holders)


def _float_held(model: nn.Module, shared: set[int]) -> set[int]:
    """Ids of the ``shared`` Parameters that a module holds without quantizing them (a float embedding, a layer whose
    slot has no quantizer): they keep the float values the file stores for that module."""
    out = set()
    for module in model.modules():
        slots = module.quant_slots if isinstance(module, QuantMixin) else ()
        quantized = {s.tensor for s in slots if s.tensor is not None and getattr(module, s.attr, None) is not None}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in shared and name not in quantized:
                out.add(id(param))
    return out


def _keep_quantizing(holders: list[_Holder]) -> None:
    """The Parameter holds float values a float holder needs: each quantized holder keeps quantizing them, frozen
    with its stored qparams (a format without qparams keeps the quantizer the import prepared)."""
    for h in holders:
        if h.spec is None:
            if getattr(h.module, h.slot.attr, None) is not None:
                h.module.set_quantizer(h.slot, None)
        elif h.scale is not None:
            h.module.set_quantizer(h.slot, FrozenScaledFakeQuantize(h.spec, h.scale, h.zero_point))


def _pass_through(h: _Holder, shared: set[int]) -> None:
    quantizer = decoded_weight_quantizer(h.module, h.slot, h.spec, h.scale, h.zero_point, shared)  # type: ignore[arg-type]
    if quantizer is not None:
        h.module.set_quantizer(h.slot, quantizer)


def _untie(model: nn.Module, holders: list[_Holder]) -> None:
    """Untie the holders whose decoded values differ (``untie_differing_weights``; those equal to another's keep
    sharing), each then holding its values with a pass-through quantizer."""
    values = {
        f"{name}.{h.slot.tensor}" if name else str(h.slot.tensor): h.values
        for name, module in model.named_modules(remove_duplicate=False)
        for h in holders
        if module is h.module
    }
    untied = untie_differing_weights(model, values)
    for h in holders:
        getattr(h.module, h.slot.tensor).data.copy_(h.values)  # type: ignore[arg-type]
        _pass_through(h, set())
    logger.warning(
        "import: %s share one Parameter but were exported with different quantized values of it (%s); one Parameter "
        "cannot hold both, so %s now %s its own copy (untied; a Hugging Face config's tie_word_embeddings is set to "
        "False). Each layer computes exactly what it computed in the exported model.",
        " and ".join(h.label for h in holders),
        ", ".join(_describe(h.spec) for h in holders),
        ", ".join(repr(k) for k in untied),
        "has" if len(untied) == 1 else "have",
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


def embeddings_stored_apart(model: nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether ``model`` (a Hugging Face model) ties its input embeddings and its output projection, both quantized,
    and ``tensors`` (the export's, by key) store the two as different quantized versions of that weight (codes, scales or zero
    points differ): one Parameter cannot hold both, so the checkpoint must not say they are tied."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return False
    embed, head = get_in(), get_out()
    if embed is None or head is None or getattr(embed, "weight", None) is not getattr(head, "weight", False):
        return False
    if not all(getattr(m, "_weight_quantizer", None) is not None for m in (embed, head)):
        return False  # a float holder: its values are what the Parameter holds, the other quantizes them
    names = {id(m): n for n, m in model.named_modules()}
    first, second = (f"{names.get(id(m), '')}.weight" for m in (embed, head))
    if first not in tensors or second not in tensors:  # one stored (a float holder): loaded into the one Parameter
        return False
    for suffix in ("", "_scale", "_zero_point"):
        a, b = tensors.get(first + suffix), tensors.get(second + suffix)
        if (a is None) != (b is None) or (
            a is not None and (a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b))  # type: ignore[union-attr]
        ):
            return True
    return False
