"""Quantizers with nothing left to observe or learn: frozen qparams, and the pass-through of a baked weight."""

from __future__ import annotations

import dataclasses

import torch

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase, apply_format

__all__ = ["FrozenScaledFakeQuantize", "BakedFakeQuantize"]


class FrozenScaledFakeQuantize(FakeQuantizeBase):
    """Fixed qparams, no observer: the inference form of a calibrated static quantizer."""

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self, spec: QuantizationSpec, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None
    ) -> None:
        super().__init__(spec, None if scale is None else scale.device)
        self.set_flag("observer_enabled", 0)
        self.register_buffer("scale", torch.ones(()) if scale is None else scale)
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32) if zero_point is None else zero_point)

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        return self  # nothing to observe: frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # nothing to round (an MoE expert no token was routed to)
            return x
        if not self.flag("fake_quant_enabled"):
            return x
        return apply_format(x, self.spec, self.scale, self.zero_point)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero_point


class BakedFakeQuantize(FakeQuantizeBase):
    """The weight quantizer of a tensor that holds its quantized values already (``ModelQuantizer.freeze(model,
    bake_weights=True)``, a weight the imports set to its decoded codes): the forward returns the tensor as it is. It keeps the spec and, for a static scaled
    format, the frozen scale and zero point, so the exports store the codes and qparams the unbaked quantizer gives
    and size reports count the format's bits; codes are recovered with nearest rounding (the values lie on the
    grid, whatever rounding put them there)."""

    def __init__(
        self,
        spec: QuantizationSpec,
        scale: torch.Tensor | None = None,
        zero_point: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(spec, device if scale is None else scale.device)
        self.set_flag("observer_enabled", 0)
        if scale is not None:
            self.register_buffer("scale", scale)
            self.register_buffer(
                "zero_point",
                torch.zeros((), dtype=torch.int32, device=scale.device) if zero_point is None else zero_point,
            )

    @classmethod
    def of(cls, frozen: FakeQuantizeBase) -> BakedFakeQuantize:
        """The baked form of a frozen quantizer: its spec, its qparams where they are fixed, its fake-quant switch."""
        if isinstance(frozen, cls):
            return frozen
        scale, zp = frozen.calculate_qparams() if isinstance(frozen, FrozenScaledFakeQuantize) else (None, None)
        baked = cls(frozen.spec, scale, zp, frozen.fake_quant_enabled.device)
        baked.copy_flag("fake_quant_enabled", frozen)
        return baked

    @property
    def round_method(self) -> RoundType:
        return RoundType.half_even  # the tensor is on the grid: nearest rounding gives its codes back

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        return self  # nothing to observe: baked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "scale" not in self._buffers:
            return super().calculate_qparams()  # a block format or cast: no qparams (as before baking)
        return self.scale, self.zero_point

    def holds(self, x: torch.Tensor) -> bool:
        """Whether ``x`` lies on this quantizer's grid: its qparams with nearest rounding give ``x`` back bit for bit,
        so passing it through computes what quantizing it would (False for formats without qparams, whose grid
        moves with the data)."""
        if "scale" not in self._buffers:
            return False
        nearest = dataclasses.replace(self.spec, round_method=RoundType.half_even)
        x = x.detach()
        return torch.equal(apply_format(x, nearest, self.scale, self.zero_point), x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, baked"
