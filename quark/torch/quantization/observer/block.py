"""Observers of the block formats: MX (mx, mx6, mx9) block maxima and BFP16 block steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from quark.torch.quantization import late_flag
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import bfp_codes, block_absmax, mx_shared_exponent, to_blocks
from quark.torch.quantization.observer.base import EPS, ObserverBase

if TYPE_CHECKING:
    from quark.torch.quantization.config.spec import QuantizationSpec

__all__ = ["PerBlockMXObserver", "PerBlockBFPObserver"]


class PerBlockMXObserver(ObserverBase):
    """Block maxima of the MX formats (mx, mx6, mx9); qparams are the blocks' shared exponents.

    The block formats derive their scales from each block's data, so this observer only records them.
    """

    qschemes = frozenset({QSchemeType.per_group})

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device)
        self.block_size = qspec.group_size
        self.axis = qspec.ch_axis
        self.is_dynamic = bool(qspec.is_dynamic)
        self.register_buffer("amax", torch.zeros((), device=device))

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype in (Dtype.mx, Dtype.mx6, Dtype.mx9) and qscheme in (None, QSchemeType.per_group)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            self._fold_amax(x_orig)
        return x_orig

    def _fold_amax(self, x: torch.Tensor) -> torch.Tensor:
        """Fold the block maxima of ``x`` into the running ones; the batch's own maxima."""
        return self.fold_block_amax(block_absmax(x.detach(), self.block_size, self.axis))

    def fold_block_amax(self, batch: torch.Tensor) -> torch.Tensor:
        """Fold a batch's block maxima (``block_absmax`` of it, here or from the quantizer's kernel, which reads the
        batch anyway) into the running ones, a batch with NaN or Inf refused: at once, or on CUDA late with the running
        maxima kept (``refuse_non_finite``). Returns ``batch``."""
        (amax,) = self.refuse_non_finite((0.0,), batch)
        if not self.is_dynamic and self.amax.shape == amax.shape:
            amax = torch.maximum(self.amax, amax)
        self.amax = amax
        return batch

    def reset_state(self) -> None:
        self.amax = torch.zeros((), device=self.amax.device)

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._all_reduce(self.amax, dist.ReduceOp.MAX, group)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Shared scales ``2^e`` per block (E8M0 exponents of OCP MX for dtype=mx) and zero points of 0."""
        element = self.qspec.mx_element_dtype if self.dtype == Dtype.mx else Dtype.int8
        exp = mx_shared_exponent(self.amax.unsqueeze(-1), element, self.qspec.mx_scale_mode).squeeze(-1)
        scale = torch.exp2(exp.float())
        return scale, torch.zeros_like(scale, dtype=torch.int32)


class PerBlockBFPObserver(PerBlockMXObserver):
    """Block steps of BFP16: ``2^(floor(log2 amax) - 6)``, doubled where a code would overflow int8, exactly as
    the format computes them (static: the largest step seen per block)."""

    step_exp: torch.Tensor

    def __init__(self, qspec: QuantizationSpec, device: torch.device | None = None, eps: float = EPS) -> None:
        super().__init__(qspec, device, eps)
        self.register_buffer("step_exp", torch.full((), -127, dtype=torch.int32, device=device))

    @classmethod
    def serves(cls, dtype: Dtype, qscheme: QSchemeType | None) -> bool:
        return dtype == Dtype.bfp16 and qscheme in (None, QSchemeType.per_group)

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel():
            batch = self._fold_amax(x_orig)
            xb, _ = to_blocks(x_orig.detach().float(), self.axis, self.block_size)
            step_exp = bfp_codes(xb)[1].squeeze(-1)
            if late_flag.defers(step_exp.device):  # a batch refused late leaves the running steps as they were too
                step_exp = torch.where(torch.isfinite(batch).all(), step_exp, -127)
            if not self.is_dynamic and self.step_exp.shape == step_exp.shape:
                step_exp = torch.maximum(self.step_exp, step_exp)
            self.step_exp = step_exp
        return x_orig

    def reset_state(self) -> None:
        super().reset_state()
        self.step_exp = torch.full((), -127, dtype=torch.int32, device=self.step_exp.device)

    def sync(self, group: Any = None) -> None:
        import torch.distributed as dist

        super().sync(group)
        self._all_reduce(self.step_exp, dist.ReduceOp.MAX, group)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.exp2(self.step_exp.float())
        return scale, torch.zeros_like(scale, dtype=torch.int32)
