"""Quantized twins of the float layers: the float op between the input, weight, bias and output quantizers.

A twin is a subclass of its float class (``isinstance(q, nn.Linear)`` holds) built around the *same* Parameter
objects as the float module: ``from_float`` copies no weights, so an optimizer built before or after keeps training
them. Quantizer attributes follow Quark: ``_input_quantizer``, ``_weight_quantizer``, ``_bias_quantizer``,
``_output_quantizer`` (None where the role is not quantized).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from quark.torch.compat import forward_pre_hooks, module_twin
from quark.torch.quantization.config.config import QuantizationConfig, QuantizationSpec
from quark.torch.quantization.hf import transpose_weight_spec
from quark.torch.quantization.integer_linear import integer_linear
from quark.torch.quantization.nn.modules.slots import (
    DEFAULT_SLOTS,
    QuantSlot,
    TensorPart,
    slot_label,
    slot_name,
    slot_tensor,
    slot_tensor_name,
)
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

__all__ = [
    "QuantMixin",
    "QuantLinear",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantConvTranspose1d",
    "QuantConvTranspose2d",
    "QuantEmbedding",
    "QuantEmbeddingBag",
    "QUANT_MODULE_MAP",
    "QuantSlot",
    "TensorPart",
    "bakeable",
    "computed_tensor",
    "iter_quantizers",
    "refresh_computed_tensors",
    "shared_tensors",
    "register_quant_module",
    "register_prepare_hook",
    "register_structural_twin",
    "register_float_rule",
    "structural_twin",
    "float_rule_reason",
    "slot_label",
    "slot_name",
    "slot_tensor",
    "slot_tensor_name",
    "store_computed_tensors",
]

QUANTIZER_ROLES = {
    "input_tensors": "_input_quantizer",
    "output_tensors": "_output_quantizer",
    "weight": "_weight_quantizer",
    "bias": "_bias_quantizer",
}


def _make_quantizer(spec: QuantizationSpec | None, device: torch.device | None) -> FakeQuantizeBase | None:
    return None if spec is None else FakeQuantizeBase.get_fake_quantize(spec, device)


class QuantMixin(nn.Module):
    """Quantizers around a float layer's op. Subclasses set ``_float_class`` and implement ``_float_op``."""

    _float_class: type[nn.Module] = nn.Module
    #: roles this layer type can quantize (embeddings take integer indices: no input quantizer)
    roles: tuple[str, ...] = ("input_tensors", "output_tensors", "weight", "bias")
    #: every quantizer slot of this twin, those holding no quantizer included (set by ``from_float``)
    quant_slots: tuple[QuantSlot, ...] = ()
    #: children that follow this layer's configuration unless named themselves (an attention's ``out_proj``)
    owned_children: tuple[str, ...] = ()
    #: no calibration or training forward reached this layer: its quantizers saw no data, so size reports and exports
    #: count it as float (set by the engine after calibration)
    unreached: bool = False
    #: why the layer's forward has no fixed graph (ONNX export refuses it with this reason), or None: it has one
    data_dependent: str | None = None

    _input_quantizer: FakeQuantizeBase | None
    _weight_quantizer: FakeQuantizeBase | None
    _bias_quantizer: FakeQuantizeBase | None
    _output_quantizer: FakeQuantizeBase | None

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        """The quantizer slots a twin of ``module`` has: one per role in ``roles``; no bias slot without a bias."""
        return tuple(
            s
            for s in DEFAULT_SLOTS
            if s.role in cls.roles and (s.tensor is None or isinstance(getattr(module, s.tensor, None), torch.Tensor))
        )

    @classmethod
    def from_float(cls, module: nn.Module, qconfig: QuantizationConfig) -> QuantMixin:
        """The twin of ``module`` sharing its Parameters, buffers, children and hooks, with quantizers of ``qconfig``."""
        twin_class = _parametrized_twin_class(cls, module) if parametrize.is_parametrized(module) else cls
        twin = module_twin(module, twin_class)
        # a skeleton's meta Parameters (read later, e.g. by quark.torch.streaming) leave the quantizers on the default
        # device: on meta they would have no state to observe into
        device = next((p.device for p in module.parameters(recurse=False) if p.device.type != "meta"), None)
        slots = cls.slots_for(module)
        for slot in DEFAULT_SLOTS:  # the standard attributes always exist (None when not quantized)
            twin.register_module(slot.attr, None)
        for slot in slots:
            twin.register_module(slot.attr, _make_quantizer(cls.slot_spec(slot, getattr(qconfig, slot.role)), device))
        twin.quant_slots = slots
        twin.quant_config = qconfig
        for slot, q in twin.quantizer_slots():
            axis = getattr(q, "axis", None)
            if hasattr(q, "set_channels") and axis is not None:
                count = twin.channel_count(slot, axis)
                if count is not None:
                    q.set_channels(count)
        return twin

    @classmethod
    def slot_spec(cls, slot: QuantSlot, spec: QuantizationSpec | None) -> QuantizationSpec | None:
        """The spec the quantizer of ``slot`` gets from the configured one (the same, except where the layer stores
        a tensor in another layout than its float class's convention: transformers' ``Conv1D``)."""
        return spec

    def channel_count(self, slot: QuantSlot, axis: int) -> int | None:
        """How many channels the tensor of ``slot`` has along ``axis``, when the layer's shape fixes it (weights:
        always; activations: where the layer says, else None: known only from data)."""
        if slot.tensor is not None:
            return slot_tensor(self, slot).shape[axis]  # type: ignore[union-attr]
        return self._activation_channels.get((slot.role, axis))

    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        """(role, axis) -> channel count of activations fixed by the layer's shape."""
        return {}

    def to_float(self) -> nn.Module:
        """The float module again (same Parameters, same parametrizations), quantizers dropped."""
        float_class = getattr(self, "_parametrized_class", None) or self._float_class
        attrs = {s.attr for s in DEFAULT_SLOTS} | {s.attr for s in self.quant_slots}
        return module_twin(self, float_class, drop=[*attrs, "quant_config", "quant_slots"])

    def quantizer_slots(self) -> Iterator[tuple[QuantSlot, FakeQuantizeBase]]:
        """(slot, quantizer) for every slot that holds a quantizer."""
        for slot in self.quant_slots:
            q = getattr(self, slot.attr, None)
            if q is not None:
                yield slot, q

    def quantizers(self) -> Iterator[tuple[str, FakeQuantizeBase]]:
        """(role, quantizer) for every role that is quantized."""
        for slot, q in self.quantizer_slots():
            yield slot.role, q

    def param_quantizers(self) -> Iterator[tuple[str, FakeQuantizeBase]]:
        """(Parameter name, quantizer) for every quantized weight and bias (a Parameter quantized in parts, as fused
        MoE experts are, once per part: ``slot_tensor`` gives the tensor each quantizer takes)."""
        for slot, q in self.quantizer_slots():
            if slot.tensor is not None:
                yield slot.tensor, q

    def set_quantizer(self, slot: QuantSlot, quantizer: nn.Module | None) -> None:
        """Put ``quantizer`` (or None: not quantized) in ``slot``."""
        self.register_module(slot.attr, quantizer)

    @classmethod
    def linear_parts_for(cls, module: nn.Module) -> tuple[tuple[str, QuantSlot, QuantSlot | None], ...]:
        """The Linear-equivalent parts of a twin of ``module`` that exports write as layers of their own
        (``(name under the layer, weight slot, input slot)``: one expert's projection of fused MoE experts); empty for
        a layer stored as itself."""
        return ()

    def linear_parts(self) -> tuple[tuple[str, QuantSlot, QuantSlot | None], ...]:
        """``linear_parts_for`` this twin."""
        return type(self).linear_parts_for(self)

    def finish_calibration(self) -> str | None:
        """After calibration: give the quantizers that saw no data the qparams this layer's other data implies, where
        the layer defines them (an MoE expert no token reached takes its sibling experts' input scales). Returns a
        sentence naming what was given, for the warning, or None (the default: nothing to give)."""
        return None

    @staticmethod
    def _quantize(quantizer: FakeQuantizeBase | None, x: torch.Tensor | None) -> torch.Tensor | None:
        return x if quantizer is None or x is None else quantizer(x)

    def quantized_weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias as the op sees them (fake-quantized where configured)."""
        weight = self._quantize(self._weight_quantizer, self.weight)
        bias = self._quantize(self._bias_quantizer, getattr(self, "bias", None))
        return weight, bias  # type: ignore[return-value]


def _parametrized_twin_class(cls: type[QuantMixin], module: nn.Module) -> type[QuantMixin]:
    """``cls`` on top of the class ``torch.nn.utils.parametrize`` made for ``module`` (weight_norm of Wav2Vec2's and
    HuBERT's positional conv): its parametrized tensors stay properties, computed from their originals at every
    access, so the weight quantizer sees the weight the parametrization computes on every forward. torch makes that
    class per module, so this one is too."""
    parametrized = type(module)
    name = f"Quant{parametrized.__name__}"
    return type(name, (cls, parametrized), {"_parametrized_class": parametrized, "__qualname__": name})


#: torch's old-style reparametrizations: a forward pre-hook writes the tensor, computed from others, before each call
_TENSOR_HOOKS = (WeightNorm, SpectralNorm)


def computed_tensor(module: nn.Module, name: str) -> bool:
    """Whether ``module.<name>`` is computed from other Parameters at each forward (a parametrization, the old-style
    ``torch.nn.utils.weight_norm`` hook) rather than stored: writing into it changes nothing."""
    if parametrize.is_parametrized(module, name):
        return True
    return any(isinstance(h, _TENSOR_HOOKS) and h.name == name for h in forward_pre_hooks(module).values())


def shared_tensors(model: nn.Module) -> set[int]:
    """Ids of the Parameters that more than one module of ``model`` holds (an ``lm_head`` tied to the input
    embeddings): writing quantized values into one changes what the other computes with."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    return {key for key, modules in holders.items() if len(modules) > 1}


def bakeable(module: nn.Module, slot: QuantSlot, shared: set[int]) -> bool:
    """Whether ``slot``'s tensor may hold its quantized values with a pass-through quantizer in the slot
    (``freeze(bake_weights=True)``, and the imports for the weights they decode): a stored tensor (not computed at
    each forward) that no other module holds (``shared``: ids from ``shared_tensors``; such a tensor keeps float
    values for the other module, so its quantizer must quantize them at each forward)."""
    if slot.tensor is None or computed_tensor(module, slot.tensor):
        return False
    return id(getattr(module, slot.tensor)) not in shared


def refresh_computed_tensors(model: nn.Module) -> None:
    """Recompute the tensors the old-style hooks write before each forward (after a training step they hold the
    values of the last forward), so a read outside a forward sees the current ones; without autograd history, which
    the next forward rebuilds, so the model can be deep-copied (torch refuses to copy a non-leaf tensor)."""
    with torch.no_grad():
        for module in model.modules():
            for hook in list(forward_pre_hooks(module).values()):
                if isinstance(hook, _TENSOR_HOOKS):
                    hook(module, ())


def store_computed_tensors(model: nn.Module) -> None:
    """Replace every computed tensor (see ``computed_tensor``) by a Parameter holding its current value, its
    parametrization or hook removed: for export copies, whose graph stores the weight the model runs with rather than
    recomputing it from its originals (a float recomputation elsewhere could move a code across a rounding tie)."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):  # not remove_parametrizations: it edits the class the copy shares
            values = {name: getattr(module, name).detach().clone() for name in module.parametrizations}
            module.__class__ = parametrize.type_before_parametrizations(module)
            delattr(module, "parametrizations")
            for name, value in values.items():
                module.register_parameter(name, nn.Parameter(value))
        hooks = forward_pre_hooks(module)
        for key, hook in list(hooks.items()):
            if isinstance(hook, _TENSOR_HOOKS):
                hook.remove(module)
                del hooks[key]


class QuantLinear(QuantMixin, nn.Linear):
    _float_class = nn.Linear
    #: the output quantizer is applied by another module, not after this layer's product (a key or value projection
    #: of a post-RoPE KV cache: its attention quantizes the keys or values after RoPE, ``quantization.attention``)
    output_applied_elsewhere: bool = False

    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        return {("input_tensors", -1): self.in_features, ("output_tensors", -1): self.out_features}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._quantize(self._input_quantizer, input)
        weight, bias = self.quantized_weight_and_bias()
        out = integer_linear(x, weight, bias, self._input_quantizer, self._weight_quantizer)  # F.linear's result
        return out if self.output_applied_elsewhere else self._quantize(self._output_quantizer, out)


class QuantHFConv1DMixin(QuantMixin):
    """transformers' ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``): ``x @ W + b`` with W stored [in, out].

    The weight quantizer works on that stored layout with the transposed spec (``transpose_weight_spec``), so a
    config means what it means for ``nn.Linear``: per-channel is per output feature, per-group groups input
    features, and qparams have Linear's layout. The concrete twin subclasses the user's ``Conv1D`` class, made on
    first sight (the engine does not import transformers): ``twin_of_foreign_class``."""

    @classmethod
    def slot_spec(cls, slot: QuantSlot, spec: QuantizationSpec | None) -> QuantizationSpec | None:
        return transpose_weight_spec(spec) if slot.tensor == "weight" else spec

    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        return {("input_tensors", -1): self.weight.shape[0], ("output_tensors", -1): self.weight.shape[1]}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._quantize(self._input_quantizer, input)
        weight, bias = self.quantized_weight_and_bias()
        out = integer_linear(x, weight.t(), bias, self._input_quantizer, self._weight_quantizer, channel_axis=1)
        return self._quantize(self._output_quantizer, out)


def twin_of_foreign_class(float_class: type[nn.Module], base: type[QuantMixin]) -> type[QuantMixin]:
    """The quantized twin of a layer class the engine cannot import (transformers' ``Conv1D``, ``FalconLinear``):
    ``base``'s behaviour on a subclass of ``float_class``, made once, registered in QUANT_MODULE_MAP and kept as
    ``Quant<Name>`` of this module so pickled models find it."""
    twin = QUANT_MODULE_MAP.get(float_class)
    if twin is None:
        name = f"Quant{float_class.__name__}"
        twin = type(
            name, (base, float_class), {"_float_class": float_class, "__module__": __name__, "__qualname__": name}
        )
        globals()[name] = twin
        register_quant_module(float_class, twin, explicit_only=base in EXPLICIT_ONLY_BASES)
    return twin


class _QuantConvNd(QuantMixin):
    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        return {("input_tensors", 1): self.in_channels, ("output_tensors", 1): self.out_channels}  # type: ignore[attr-defined]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x = self._quantize(self._input_quantizer, input)
        weight, bias = self.quantized_weight_and_bias()
        return self._quantize(self._output_quantizer, self._conv_forward(x, weight, bias))  # type: ignore[attr-defined]


class QuantConv1d(_QuantConvNd, nn.Conv1d):
    _float_class = nn.Conv1d


class QuantConv2d(_QuantConvNd, nn.Conv2d):
    _float_class = nn.Conv2d


class QuantConv3d(_QuantConvNd, nn.Conv3d):
    _float_class = nn.Conv3d


class _QuantConvTransposeNd(QuantMixin):
    _spatial_dims = 1
    _functional = staticmethod(F.conv_transpose1d)

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        output_padding = self._output_padding(  # type: ignore[attr-defined]
            input, output_size, self.stride, self.padding, self.kernel_size, self._spatial_dims, self.dilation
        )
        x = self._quantize(self._input_quantizer, input)
        weight, bias = self.quantized_weight_and_bias()
        out = self._functional(x, weight, bias, self.stride, self.padding, output_padding, self.groups, self.dilation)
        return self._quantize(self._output_quantizer, out)


class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    _float_class = nn.ConvTranspose1d


class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    _float_class = nn.ConvTranspose2d
    _spatial_dims = 2
    _functional = staticmethod(F.conv_transpose2d)


class QuantEmbedding(QuantMixin, nn.Embedding):
    _float_class = nn.Embedding
    roles = ("output_tensors", "weight")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, _ = self.quantized_weight_and_bias()
        out = F.embedding(
            input, weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )
        return self._quantize(self._output_quantizer, out)


class QuantEmbeddingBag(QuantMixin, nn.EmbeddingBag):
    _float_class = nn.EmbeddingBag
    roles = ("output_tensors", "weight")

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight, _ = self.quantized_weight_and_bias()
        out = F.embedding_bag(
            input,
            weight,
            offsets,
            self.max_norm,
            self.norm_type,
            self.scale_grad_by_freq,
            self.mode,
            self.sparse,
            per_sample_weights,
            self.include_last_offset,
            self.padding_idx,
        )
        return self._quantize(self._output_quantizer, out)


def register_quant_module(float_class: type[nn.Module], twin: type[QuantMixin], explicit_only: bool = False) -> None:
    """Make ``twin`` the quantized form of ``float_class`` (``explicit_only``: only when configured by type or name)."""
    QUANT_MODULE_MAP[float_class] = twin
    if explicit_only:
        EXPLICIT_ONLY.add(float_class)


#: a structural test: True for a module a twin base handles, a sentence saying why not for a module of the kind it
#: handles in a layout it does not, False for an unrelated module
StructuralFit = Callable[[nn.Module], "bool | str"]
#: a float rule: (layer name, module, its parent or None) -> why the module stays float, or None when it does not apply
FloatRule = Callable[[str, nn.Module, "nn.Module | None"], "str | None"]


def register_structural_twin(fits: StructuralFit, base: type[QuantMixin], explicit_only: bool = False) -> None:
    """Quantize modules by structure rather than class: a module whose class (or base) has no twin and for which
    ``fits(module)`` is True gets a twin of its own class with ``base``'s behaviour (``twin_of_foreign_class``); the
    resolver consults these when no class matches (or when the class matched defines its own forward). A sentence
    from ``fits`` is the reason coverage reports. ``explicit_only``: those classes are quantized only when configured
    by type or name, as embeddings are (MoE routers)."""
    if (fits, base) not in STRUCTURAL_TWINS:
        STRUCTURAL_TWINS.append((fits, base))
    if explicit_only:
        EXPLICIT_ONLY_BASES.add(base)


def structural_twin(module: nn.Module) -> tuple[type[QuantMixin] | None, str | None]:
    """(twin base whose structure ``module`` has, None) or (None, why a registered structure refused it) or (None, None)."""
    reason = None
    for fits, base in STRUCTURAL_TWINS:
        verdict = fits(module)
        if verdict is True:
            return base, None
        if isinstance(verdict, str) and reason is None:
            reason = verdict
    return None, reason


def register_float_rule(rule: FloatRule) -> None:
    """A rule naming why a module without a twin stays float (an MoE router); coverage asks the rules before its
    generic reasons."""
    if rule not in FLOAT_RULES:
        FLOAT_RULES.append(rule)


def float_rule_reason(name: str, module: nn.Module, parent: nn.Module | None) -> str | None:
    """The first registered float rule's reason for ``module``, or None."""
    for rule in FLOAT_RULES:
        reason = rule(name, module, parent)
        if reason is not None:
            return reason
    return None


def register_prepare_hook(hook: Callable[[nn.Module], Any]) -> None:
    """Run ``hook(model)`` after every prepare (twins that need more than a swap, e.g. a container's fused fast path
    that would bypass them)."""
    if hook not in PREPARE_HOOKS:
        PREPARE_HOOKS.append(hook)


def iter_quantizers(model: nn.Module) -> Iterator[tuple[str, FakeQuantizeBase]]:
    """(role, quantizer) of every quantized layer of ``model``, in module order."""
    for module in model.modules():
        if isinstance(module, QuantMixin):
            yield from module.quantizers()


#: float class -> quantized twin; embeddings are quantized only when configured by type or name
QUANT_MODULE_MAP: dict[type[nn.Module], type[QuantMixin]] = {
    nn.Linear: QuantLinear,
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
    nn.Conv3d: QuantConv3d,
    nn.ConvTranspose1d: QuantConvTranspose1d,
    nn.ConvTranspose2d: QuantConvTranspose2d,
    nn.Embedding: QuantEmbedding,
    nn.EmbeddingBag: QuantEmbeddingBag,
}
EXPLICIT_ONLY: set[type[nn.Module]] = {nn.Embedding, nn.EmbeddingBag}
#: structural twin bases whose float classes join EXPLICIT_ONLY when their twin is made
EXPLICIT_ONLY_BASES: set[type[QuantMixin]] = set()
PREPARE_HOOKS: list[Callable[[nn.Module], Any]] = []
STRUCTURAL_TWINS: list[tuple[StructuralFit, type[QuantMixin]]] = []
FLOAT_RULES: list[FloatRule] = []
