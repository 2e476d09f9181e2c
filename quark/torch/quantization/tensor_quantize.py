"""Fake quantization modules: an observer, a number format and straight-through autograd.

- ``ScaledFakeQuantize``: integers and minifloats. Static (qparams held as buffers, saved in the state_dict and
  updated while the observer is on) or dynamic (qparams from every call's data).
- ``NonScaledFakeQuantize``: casts (bfloat16, float16) and block formats (MX, MX6/MX9, BFP16), whose scales come
  from each block's data.
- ``FrozenScaledFakeQuantize``: fixed qparams, no observer (what ``to_frozen()`` returns).
- ``BakedFakeQuantize``: the quantizer of a weight that holds its quantized values already (``freeze(...,
  bake_weights=True)``, a weight the imports decoded): passes it through, keeps the spec and qparams for exports
  and size reports.
- ``TQTFakeQuantize`` / ``LSQFakeQuantize``: learnable thresholds / scales for quantization-aware training.

Observer and fake quantization switch on and off independently (``enable_observer`` / ``enable_fake_quant``, as in
torch.ao.quantization). ``FakeQuantizeBase.get_fake_quantize(spec)`` picks the class for a QuantizationSpec.

The classes live in ``fake_quant`` by concern (``base``: ``FakeQuantizeBase`` and ``apply_format``; ``fixed``: the
frozen and baked forms; ``learnable``: TQT and LSQ, with their autograd Functions in ``learnable_grad``); this module
defines the observing ones (scaled, non-scaled) and is the path to all of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.quantization import late_flag
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase, apply_format, prepare_fixed, prepares_fixed
from quark.torch.quantization.fake_quant.fixed import BakedFakeQuantize, FrozenScaledFakeQuantize
from quark.torch.quantization.fake_quant.learnable import LearnableFakeQuantize, LSQFakeQuantize, TQTFakeQuantize
from quark.torch.quantization.formats import PreparedBlock, PreparedGrid, PreparedInt, prepare_block
from quark.torch.quantization.observe_quantize import (
    fused_pass_active,
    fused_plan,
    observe_fake_quantize,
    scale_may_have_saturated,
    steady_fused,
)
from quark.torch.quantization.observer.block import PerBlockMXObserver
from quark.torch.quantization.observer.minmax import UniformScalingObserver

__all__ = [
    "FakeQuantizeBase",
    "ScaledFakeQuantize",
    "NonScaledFakeQuantize",
    "FrozenScaledFakeQuantize",
    "BakedFakeQuantize",
    "TQTFakeQuantize",
    "LSQFakeQuantize",
    "LearnableFakeQuantize",
    "apply_format",
]


class ScaledFakeQuantize(FakeQuantizeBase, kind="scaled"):
    """Integers and minifloats with a scale (and zero point) from the spec's observer."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    initialized: torch.Tensor

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        self.observer = spec.observer_cls(spec, device)  # type: ignore[misc]
        self.register_buffer("scale", torch.ones((), device=device), persistent=not self.is_dynamic)
        self.register_buffer(
            "zero_point", torch.zeros((), dtype=torch.int32, device=device), persistent=not self.is_dynamic
        )
        self.register_flag("initialized", 0, device)

    def _refresh_qparams(self) -> None:
        """Recompute scale and zero point from the observer's statistics (once per need, not per batch)."""
        self._hold(*self.observer.calculate_qparams())

    def _hold(self, scale: torch.Tensor, zp: torch.Tensor) -> None:
        """Take ``scale`` / ``zp`` as this quantizer's qparams (on its device): it is initialised and up to date.
        Runs on every forward while observing, so it writes the buffer dict directly (what ``Module.__setattr__``
        does for a registered buffer, less its checks: some 10 us a call)."""
        buffers = self._buffers
        held = buffers["scale"]
        buffers["scale"] = scale if scale.device == held.device else scale.to(held.device)  # type: ignore[union-attr]
        held = buffers["zero_point"]
        buffers["zero_point"] = zp if zp.device == held.device else zp.to(held.device)  # type: ignore[union-attr]
        self.set_flag("initialized", 1)
        self.__dict__["_stale"] = False

    def _sync(self) -> None:
        if getattr(self, "_stale", False):
            self._refresh_qparams()

    def _hold_observed(self) -> None:
        """The qparams of the statistics this forward has just folded, without first asking the observer whether it
        has any (``has_statistics``: a host read on CUDA; a batch that was not finite is reported late by the
        observer's check). Min-max observers only: others compute their qparams their own way."""
        obs = self.observer
        if type(obs).calculate_qparams is UniformScalingObserver.calculate_qparams:
            self._hold(*obs.calculate_qparams(obs.min_val, obs.max_val))
        else:
            self._refresh_qparams()

    def forget_qparams(self) -> None:
        """Back to no qparams (the state before any data), statistics kept: the next batch it observes gives them."""
        self.scale = torch.ones((), device=self.scale.device)
        self.zero_point = torch.zeros((), dtype=torch.int32, device=self.zero_point.device)
        self.set_flag("initialized", 0)
        self._stale = False

    def _observe_and_quantize(self, x: torch.Tensor) -> torch.Tensor | None:
        """Observe ``x`` and fake-quantize it in one compiled pass (``observe_quantize``) where that applies: a min-max
        observer whose statistics already have this input's shape, fake quant on, the compiled kernels active. None
        where it does not (the caller takes the step-by-step path, with the same bits)."""
        if not self.flag("fake_quant_enabled") or not x.is_floating_point() or not fused_pass_active(x):
            return None  # the cheap checks first: this runs on every forward while observing
        obs = self.observer
        fused = self._fused_plan(obs)
        if fused is None or obs.min_val.shape != fused.observer.statistics_shape(x.shape):
            return None  # not a planned observer; or the first batch / a new shape: the eager path rebinds
        if (obs.min_val.is_inference() or obs.max_val.is_inference()) and not torch.is_inference_mode_enabled():
            return None  # statistics made under inference_mode cannot be updated in place outside it: rebound once
        kernels, calls = self.__dict__.get("_fused_steady"), self.__dict__.get("_fused_calls")
        if kernels is None or calls is None:
            kernels, calls = self.__dict__["_fused_steady"], self.__dict__["_fused_calls"] = {}, {}
        steady = steady_fused(kernels, calls, x, obs.min_val, obs.max_val, fused)  # direct kernels, once served so
        out, scale, zp, finite = observe_fake_quantize(x, obs.min_val, obs.max_val, fused, steady)
        obs.fused_observed(x, finite)  # raises on NaN / Inf (statistics and qparams stay), read late on CUDA
        if scale_may_have_saturated(fused, scale, x.dtype):
            scale, zp = obs.calculate_qparams()  # the same qparams, computed eagerly: it warns where they saturated
        self._hold(scale, zp)
        return out

    def _fused_plan(self, obs: Any) -> Any:
        """The fused pass's plan for ``obs`` (None: its observer has none), built once per observer object: the
        plan reads only settings fixed when the observer is made."""
        cached = self.__dict__.get("_fused_plan_of")
        if cached is None or cached[0] is not obs:
            plan = obs.minmax_plan()
            fused = None if plan is None else fused_plan(plan, self.spec.dtype, self.spec.round_method)
            cached = self.__dict__["_fused_plan_of"] = (obs, fused)
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # nothing to observe or round (an MoE expert no token was routed to): qparams or not
            return x
        flag = self.flag  # the switches, read from the device only when written since (a host sync on CUDA)
        observed = False
        if self.spec.is_dynamic or flag("observer_enabled"):
            out = self._observe_and_quantize(x)
            if out is not None:
                return out
            self.observer(x)
            self._stale = observed = True  # qparams follow lazily: calibration with fake quant off never pays for them
        if not flag("fake_quant_enabled"):
            return x
        if observed and late_flag.defers(x.device):
            self._hold_observed()
        else:
            self._sync()
        if not flag("initialized"):
            raise RuntimeError(
                f"{self.where}: {type(self).__name__}({self.extra_repr()}) has no qparams yet: it has observed no data "
                "and its observer is off. Calibrate (observer on) with data that reaches this layer before quantizing; "
                "ModelQuantizer.freeze runs the layers calibration never reached in float."
            )
        prepared = self._prepared(x)
        if prepared is not None:
            return prepared(x)
        return apply_format(x, self.spec, self.scale, self.zero_point)

    def _prepared(self, x: torch.Tensor) -> PreparedInt | PreparedGrid | None:
        """``apply_format`` for integers and minifloats per tensor or per channel with the qparams shaped once
        (``PreparedInt``, ``PreparedGrid``: the same bits, and their steady paths), kept while the qparams are the same tensors, unmodified in place, and inputs keep their rank: the
        steady state of QAT with observers off makes no bookkeeping per call. None for other formats and layouts.

        Kept only where the prepared qparams are views of the buffers (a float32 scale, an int32 or float zero point):
        a write through ``.data`` bumps no version counter, but a view sees it. The views are of detached aliases
        (``swap_tensors``, which ``load_state_dict`` uses under ``torch.__future__``'s swap flag, refuses a tensor
        that others view), and the storages' addresses are part of the key (``.data = t`` or a swap keeps the
        tensor object and its version but not its storage; the views keep the old storage alive, so a new one has
        another address)."""
        spec_serves = self.__dict__.get("_prepares_for")  # (spec, prepares_fixed(spec)): other formats skip the rest
        if spec_serves is None or spec_serves[0] is not self.spec:
            spec_serves = self.__dict__["_prepares_for"] = (self.spec, prepares_fixed(self.spec, keep=True))
        if not spec_serves[1]:
            return None
        scale, zp = self._buffers["scale"], self._buffers["zero_point"]
        if (
            torch.compiler.is_compiling()  # traced: no memo (its checks would break the graph)
            or scale.is_inference()  # type: ignore[union-attr]  # (no version counter)
            or zp.is_inference()  # type: ignore[union-attr]
            or scale.dtype != torch.float32  # type: ignore[union-attr]  # prepared as a copy: not kept
            or not (zp.dtype == torch.int32 or zp.is_floating_point())  # type: ignore[union-attr]
        ):
            if (
                not torch.compiler.is_compiling()
                and (scale.is_inference() or zp.is_inference())  # type: ignore[union-attr]
                and not torch.is_inference_mode_enabled()
            ):
                # qparams made under inference_mode (a calibration there), used where autograd may save them for
                # the backward (the compiled kernels' straight-through gradient): an inference tensor cannot be saved
                scale, zp = scale.clone(), zp.clone()  # type: ignore[union-attr]
            return prepare_fixed(x.ndim, self.spec, scale, zp)  # type: ignore[arg-type]
        key = (scale._version, zp._version, scale.data_ptr(), zp.data_ptr(), x.ndim)  # type: ignore[union-attr]
        cached = self.__dict__.get("_prepared_int")
        if cached is not None and cached[0] is self.spec and cached[1] is scale and cached[2] is zp:
            if cached[3] == key:
                return cached[4]
        prepared = prepare_fixed(x.ndim, self.spec, scale.detach(), zp.detach(), keep=True)  # type: ignore[union-attr]
        self.__dict__["_prepared_int"] = (self.spec, scale, zp, key, prepared)
        return prepared

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        if not enabled:
            self.read_late_checks()  # before the qparams are fixed, a late error must not be lost
            self._sync()  # statistics are final: fix the qparams now
        return super().enable_observer(enabled)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.read_late_checks()
        self._sync()
        return self.scale, self.zero_point

    def set_qparams(self, scale: torch.Tensor, zero_point: torch.Tensor) -> None:
        """Fix scale and zero point computed elsewhere (GPTQ's); the observer is switched off so they stay. A scale
        that is not finite and positive everywhere is refused (ValueError naming the layer)."""
        s = scale.detach().float()
        if not bool((torch.isfinite(s) & (s > 0)).all()):
            raise ValueError(
                f"{self.where}: set_qparams got a scale that is not finite and positive everywhere "
                f"(min {float(s.min())}, max {float(s.max())})"
            )
        self.scale = scale.detach().to(self.scale.device, torch.float32).clone()
        self.zero_point = zero_point.detach().to(self.zero_point.device).clone()
        self.set_flag("initialized", 1)
        self._stale = False
        self.set_flag("observer_enabled", 0)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._sync()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def to_frozen(self) -> nn.Module:
        if self.is_dynamic:
            return self
        scale, zp = self.calculate_qparams()
        return FrozenScaledFakeQuantize(self.spec, scale.detach().clone(), zp.detach().clone())


class NonScaledFakeQuantize(FakeQuantizeBase, kind="non_scaled"):
    """Casts and block formats: the format derives everything from the data; the observer records block maxima."""

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        self.observer = spec.observer_cls(spec, device)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flag("observer_enabled"):
            out = self._observe_and_quantize(x)
            if out is not None:
                return out
            self.observer(x)
        if not self.flag("fake_quant_enabled"):
            return x
        prepared = self._prepared_block()
        if prepared is not None:
            return prepared(x)
        return apply_format(x, self.spec, None, None)

    def _observe_and_quantize(self, x: torch.Tensor) -> torch.Tensor | None:
        """MX with its observer and fake quant on: the block maxima the observer records come from the fake-quant
        kernel's own read of ``x`` (``PreparedBlock.observe``; the same maxima and bits as observing, then
        quantizing). None where that does not apply (the caller observes, then quantizes), and inside a caller's
        ``torch.compile`` (the two passes are traced into its graph, which fuses them)."""
        obs = self.observer
        if (
            type(obs) is not PerBlockMXObserver
            or torch.compiler.is_compiling()
            or not x.numel()
            or not self.flag("fake_quant_enabled")
        ):
            return None
        prepared = self._prepared_block()
        if prepared is None or prepared.observed_kernel is None or prepared.args[1:3] != (obs.block_size, obs.axis):
            return None  # (a layout the observer writes another way: the two-pass path gives its maxima as it does)
        out, amax = prepared.observe(x)
        obs.fold_block_amax(amax)
        return out

    def _prepared_block(self) -> PreparedBlock | None:
        """``apply_format`` of a block format resolved once per spec (``PreparedBlock``: the same bits, and its steady
        path once its kernel is served directly); None for casts. Built again for another spec object."""
        cached = self.__dict__.get("_block_prepared")
        if cached is None or cached[0] is not self.spec:
            s = self.spec
            block = prepare_block(s.dtype, s.group_size, s.ch_axis, s.mx_element_dtype, s.mx_scale_mode)
            cached = self.__dict__["_block_prepared"] = (self.spec, block)
        return cached[1]
