"""The modules graph mode puts in a captured graph: activation quantizers as graph nodes, a quantizer that reuses
another's grid, conv + BatchNorm with simulated folding for QAT, and the per-channel clamp CLE leaves for ReLU6."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch.quantization.config.config import QuantizationConfig
from quark.torch.quantization.nn.modules.quant_modules import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantMixin,
    QuantSlot,
)
from quark.torch.quantization.tensor_quantize import (
    FakeQuantizeBase,
    LearnableFakeQuantize,
    ScaledFakeQuantize,
    apply_format,
)

__all__ = [
    "QuantActivation",
    "QuantFunctionalWeight",
    "SharedFakeQuantize",
    "QuantConvBn1d",
    "QuantConvBn2d",
    "QuantConvBn3d",
    "QuantConvBnNd",
    "fold_conv_bn",
    "freeze_bn_stats",
]


class QuantActivation(QuantMixin, nn.Identity):
    """One activation tensor of the graph, quantized once for all its consumers (a node after its producer)."""

    _float_class = nn.Identity
    roles = ("output_tensors",)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._quantize(self._output_quantizer, input)  # type: ignore[return-value]


class QuantFunctionalWeight(QuantMixin, nn.Identity):
    """A Parameter the model feeds to a matmul (or an F.linear inside its own module): its weight quantizer as a
    graph node after the Parameter is read."""

    _float_class = nn.Identity
    roles = ("weight",)
    _weight_slot = QuantSlot("weight", "_weight_quantizer")

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        return (cls._weight_slot,)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._quantize(self._weight_quantizer, input)  # type: ignore[return-value]


class SharedFakeQuantize(FakeQuantizeBase):
    """Applies ``source``'s current quantization and observes nothing: after a max-pool, reshape or slice the values
    are still on the source's grid, and the deployed graph quantizes them again with the same qparams (what
    onnxruntime's QDQ fusion needs around such ops). ``source`` is held by reference (it lives elsewhere)."""

    def __init__(self, source: FakeQuantizeBase) -> None:
        super().__init__(source.spec, source.observer_enabled.device)
        self.set_flag("observer_enabled", 0)
        object.__setattr__(self, "_source", source)

    @property
    def source(self) -> FakeQuantizeBase:
        return self._source  # type: ignore[no-any-return]

    @property
    def initialized(self) -> Any:
        return getattr(self.source, "initialized", None)

    @property
    def is_dynamic(self) -> bool:
        return self.source.is_dynamic

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        return self  # the source observes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src = self.source
        if not self.flag("fake_quant_enabled") or not src.flag("fake_quant_enabled"):
            return x
        initialized = getattr(src, "initialized", None)
        if isinstance(initialized, torch.Tensor) and not src.flag("initialized") and not getattr(src, "_stale", False):
            return x  # the source has seen no data yet
        if isinstance(src, LearnableFakeQuantize):
            return src._learned(x)
        if isinstance(src, ScaledFakeQuantize):
            scale, zero_point = src.calculate_qparams()
            return apply_format(x, src.spec, scale, zero_point)
        if hasattr(src, "scale"):  # frozen
            return apply_format(x, src.spec, src.scale, src.zero_point)  # type: ignore[arg-type]
        return apply_format(x, src.spec, None, None)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.calculate_qparams()

    def to_frozen(self) -> nn.Module:
        frozen = self.source.to_frozen()
        return SharedFakeQuantize(frozen) if frozen is self.source else frozen

    def extra_repr(self) -> str:
        return f"shares {self.source.where}"


# ----------------------------------------------------------------------------------------------- conv + BatchNorm
class QuantConvBnNd(QuantMixin):
    """Conv followed by its BatchNorm as one unit (Jacob et al. 2018, Krishnamoorthi 2018, section 3.2); two regimes.

    - training with live statistics: the weight folded with the *running* std is fake-quantized, the conv output is
      scaled back and normalised by the batch statistics (which also update the running ones), so the network
      learns the weights it will deploy while BatchNorm keeps working;
    - eval, or after ``freeze_bn_stats``: conv with the folded weight and bias, both fake-quantized, which is exactly
      the frozen form ``fold_conv_bn`` produces.

    The BatchNorm module stays where it was in the graph module (state_dict keys unchanged); this unit holds a
    reference to it."""

    _plain: type[QuantMixin]
    quant_slots: tuple[QuantSlot, ...]
    _slots = (QuantSlot("weight", "_weight_quantizer", "weight"), QuantSlot("bias", "_bias_quantizer"))

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        return cls._slots

    @classmethod
    def from_conv_bn(
        cls, conv: nn.Module, bn: nn.modules.batchnorm._BatchNorm, qconfig: QuantizationConfig
    ) -> QuantConvBnNd:
        twin = cls.from_float(conv, qconfig)
        object.__setattr__(twin, "_bn", bn)
        twin.bn_frozen = False
        return twin  # type: ignore[return-value]

    @property
    def bn(self) -> nn.modules.batchnorm._BatchNorm:
        return self._bn  # type: ignore[no-any-return]

    @property
    def _activation_channels(self) -> dict[tuple[str, int], int]:
        return {("bias", 0): self.out_channels}  # type: ignore[attr-defined]

    def _bn_scale(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gamma / sqrt(running_var + eps), gamma and beta."""
        bn = self.bn
        var = bn.running_var
        gamma = bn.weight if bn.weight is not None else torch.ones_like(var)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(var)
        return gamma * torch.rsqrt(var + bn.eps), gamma, beta  # type: ignore[operator]

    def _channel_shape(self, ndim: int, axis: int) -> list[int]:
        shape = [1] * ndim
        shape[axis] = -1
        return shape

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and bias of the conv with the BatchNorm's running statistics folded in (float)."""
        scale, _, beta = self._bn_scale()
        weight: torch.Tensor = self.weight  # type: ignore[assignment]
        bias = self.bias if self.bias is not None else torch.zeros_like(scale)  # type: ignore[attr-defined]
        w = weight * scale.reshape(self._channel_shape(weight.ndim, 0))
        b = beta + (bias - self.bn.running_mean) * scale  # type: ignore[operator]
        return w, b

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not (bn.training and not self.bn_frozen):
            w, b = self.folded()
            return self._conv_forward(
                input, self._quantize(self._weight_quantizer, w), self._quantize(self._bias_quantizer, b)
            )  # type: ignore[attr-defined]
        scale, gamma, beta = self._bn_scale()
        weight: torch.Tensor = self.weight  # type: ignore[assignment]
        w = self._quantize(self._weight_quantizer, weight * scale.reshape(self._channel_shape(weight.ndim, 0)))
        y = self._conv_forward(input, w, None)  # type: ignore[attr-defined]
        shape = self._channel_shape(y.ndim, 1)
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        y = y / safe.reshape(shape)
        if self.bias is not None:  # type: ignore[attr-defined]
            y = y + self.bias.reshape(shape)  # type: ignore[attr-defined]
        return _batch_norm_train(bn, y, gamma, beta)


def _batch_norm_train(
    bn: nn.modules.batchnorm._BatchNorm, y: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """BatchNorm in training mode with nn.BatchNorm's running-statistics update (momentum, or the cumulative average
    when momentum is None)."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        if bn.momentum is None:
            factor = 1.0 / float(bn.num_batches_tracked)
    return F.batch_norm(y, bn.running_mean, bn.running_var, gamma, beta, True, factor, bn.eps)


class QuantConvBn1d(QuantConvBnNd, nn.Conv1d):
    _float_class = nn.Conv1d
    _plain = QuantConv1d


class QuantConvBn2d(QuantConvBnNd, nn.Conv2d):
    _float_class = nn.Conv2d
    _plain = QuantConv2d


class QuantConvBn3d(QuantConvBnNd, nn.Conv3d):
    _float_class = nn.Conv3d
    _plain = QuantConv3d


CONV_BN = {nn.Conv1d: QuantConvBn1d, nn.Conv2d: QuantConvBn2d, nn.Conv3d: QuantConvBn3d}


def fold_conv_bn(unit: QuantConvBnNd) -> QuantMixin:
    """The plain quantized conv with the BatchNorm folded into new weight and bias Parameters (the unit's
    Parameters, shared with the float model, stay as they were), keeping the unit's quantizers and their state."""
    with torch.no_grad():
        w, b = unit.folded()
    conv = unit.to_float()
    conv.weight = nn.Parameter(w.detach().clone(), requires_grad=unit.weight.requires_grad)  # type: ignore[union-attr]
    conv.bias = nn.Parameter(b.detach().clone(), requires_grad=unit.weight.requires_grad)  # type: ignore[union-attr]
    conv.__dict__.pop("_bn", None)
    conv.__dict__.pop("bn_frozen", None)
    plain = unit._plain.from_float(conv, unit.quant_config)  # type: ignore[attr-defined]
    for slot in plain.quant_slots:
        if slot.role in ("weight", "bias"):
            plain.set_quantizer(slot, getattr(unit, slot.attr, None))
    gamma, beta = unit._bn_scale()[1:]
    std = torch.sqrt(unit.bn.running_var + unit.bn.eps)  # type: ignore[operator]
    # the folded output of channel c is ~ N(beta_c, (gamma_c)^2): kept for CLE's high-bias absorption
    plain.folded_bn = (gamma.detach().abs().clone(), beta.detach().clone(), std.detach())
    return plain


def freeze_bn_stats(model: nn.Module, frozen: bool = True) -> int:
    """Stop (or resume) updating the BatchNorm statistics of every conv + BatchNorm unit: from then on training
    uses the running statistics, i.e. the folded weights that will be deployed. Returns how many units changed."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantConvBnNd):
            module.bn_frozen = frozen
            count += 1
    return count
