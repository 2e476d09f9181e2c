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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from quark.torch.compat import fake_quantize_learnable_backward, tensor_version
from quark.torch.quantization.buffers import ResizableBuffersMixin
from quark.torch.quantization.config.config import LSQSpec, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import QSchemeType, RoundType, TQTThresholdInitMeth
from quark.torch.quantization.formats import IntFormat, fake_quantize, format_of, is_scaled
from quark.torch.quantization.formats.grouping import cast_saturating, channel_view, round_to_int
from quark.torch.quantization.observe_quantize import (
    fused_pass_active,
    fused_plan,
    observe_fake_quantize,
    scale_may_have_saturated,
)
from quark.torch.quantization.observer.observer import threshold_3sd, threshold_kl_j

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

_EPS = torch.finfo(torch.float32).eps


class FakeQuantizeBase(ResizableBuffersMixin, nn.Module):
    """Common state: the spec and the observer / fake-quant switches (buffers, so they travel in the state_dict)."""

    observer_enabled: torch.Tensor
    fake_quant_enabled: torch.Tensor
    _where: str = "a quantizer"

    @property
    def where(self) -> str:
        """Which layer and tensor this quantizer serves (set by ModelQuantizer.prepare; used in error messages, its
        observer's included)."""
        return self._where

    @where.setter
    def where(self, value: str) -> None:
        self._where = value
        observer = self._modules.get("observer")
        if observer is not None:
            observer.where = value

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.register_buffer("observer_enabled", torch.tensor(1, dtype=torch.uint8, device=device))
        self.register_buffer("fake_quant_enabled", torch.tensor(1, dtype=torch.uint8, device=device))

    @staticmethod
    def get_fake_quantize(spec: QuantizationSpec, device: torch.device | None = None) -> FakeQuantizeBase:
        """The fake-quant module that realises ``spec``."""
        if isinstance(spec.qat_spec, TQTSpec):
            return TQTFakeQuantize(spec, device)
        if isinstance(spec.qat_spec, LSQSpec):
            return LSQFakeQuantize(spec, device)
        if is_scaled(spec.dtype):
            return ScaledFakeQuantize(spec, device)
        return NonScaledFakeQuantize(spec, device)

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        self.observer_enabled.fill_(int(enabled))
        return self

    def disable_observer(self) -> FakeQuantizeBase:
        return self.enable_observer(False)

    def enable_fake_quant(self, enabled: bool = True) -> FakeQuantizeBase:
        self.fake_quant_enabled.fill_(int(enabled))
        return self

    def disable_fake_quant(self) -> FakeQuantizeBase:
        return self.enable_fake_quant(False)

    @property
    def is_dynamic(self) -> bool:
        return bool(self.spec.is_dynamic)

    @property
    def round_method(self) -> RoundType:
        """The rounding of ``x / scale`` to codes: the spec's (half_even when unset), shared with the frozen form and
        used by the exports."""
        return self.spec.round_method or RoundType.half_even

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (scale, zero_point) in use."""
        raise NotImplementedError(f"{type(self).__name__} has no scale and zero point")

    def to_frozen(self) -> nn.Module:
        """A module that applies the current quantization with nothing left to observe or learn."""
        return self

    def extra_repr(self) -> str:
        s = self.spec
        parts = [f"dtype={s.dtype.name}", f"qscheme={s.qscheme.name if s.qscheme else None}"]
        if s.ch_axis is not None:
            parts.append(f"ch_axis={s.ch_axis}")
        if s.group_size is not None:
            parts.append(f"group_size={s.group_size}")
        if s.block_size is not None:
            parts.append(f"block_size={list(s.block_size)}")
        parts.append("dynamic" if self.is_dynamic else "static")
        return ", ".join(parts)


def apply_format(
    x: torch.Tensor, spec: QuantizationSpec, scale: torch.Tensor | None, zp: torch.Tensor | None
) -> torch.Tensor:
    """``x`` fake-quantized in the spec's format with the given qparams (the one call every quantizer makes)."""
    return fake_quantize(
        x,
        spec.dtype,
        scale,
        zp,
        qscheme=spec.qscheme,
        axis=spec.ch_axis,
        group_size=spec.group_size,
        round_method=spec.round_method,
        mx_element_dtype=spec.mx_element_dtype,
        mx_scale_mode=spec.mx_scale_mode,
        block_size=spec.block_size,
    )


class ScaledFakeQuantize(FakeQuantizeBase):
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
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8, device=device))

    def _refresh_qparams(self) -> None:
        """Recompute scale and zero point from the observer's statistics (once per need, not per batch)."""
        self._hold(*self.observer.calculate_qparams())

    def _hold(self, scale: torch.Tensor, zp: torch.Tensor) -> None:
        """Take ``scale`` / ``zp`` as this quantizer's qparams (on its device): it is initialised and up to date."""
        self.scale = scale.to(self.scale.device)
        self.zero_point = zp.to(self.zero_point.device)
        self.initialized.fill_(1)
        self._stale = False

    def _sync(self) -> None:
        if getattr(self, "_stale", False):
            self._refresh_qparams()

    def forget_qparams(self) -> None:
        """Back to no qparams (the state before any data), statistics kept: the next batch it observes gives them."""
        self.scale = torch.ones((), device=self.scale.device)
        self.zero_point = torch.zeros((), dtype=torch.int32, device=self.zero_point.device)
        self.initialized.fill_(0)
        self._stale = False

    def _observe_and_quantize(self, x: torch.Tensor) -> torch.Tensor | None:
        """Observe ``x`` and fake-quantize it in one compiled pass (``observe_quantize``) where that applies: a min-max
        observer whose statistics already have this input's shape, fake quant on, the compiled kernels active. None
        where it does not (the caller takes the step-by-step path, with the same bits)."""
        if not self.fake_quant_enabled or not x.is_floating_point() or not fused_pass_active(x):
            return None  # the cheap checks first: this runs on every forward while observing
        obs = self.observer
        plan = obs.minmax_plan()
        if plan is None or obs.min_val.shape != plan.statistics_shape(x.shape):  # first batch / new shape: eager rebind
            return None
        fused = fused_plan(plan, self.spec.dtype, self.spec.round_method)
        out, scale, zp, finite = observe_fake_quantize(x, obs.min_val, obs.max_val, fused)
        obs.fused_observed(x, finite)  # raises on NaN / Inf (the statistics stayed as they were)
        if scale_may_have_saturated(fused, scale, x.dtype):
            scale, zp = obs.calculate_qparams()  # the same qparams, computed eagerly: it warns where they saturated
        self._hold(scale, zp)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # nothing to observe or round (an MoE expert no token was routed to): qparams or not
            return x
        if self.is_dynamic or self.observer_enabled:
            out = self._observe_and_quantize(x)
            if out is not None:
                return out
            self.observer(x)
            self._stale = True  # qparams follow lazily: calibration with fake quant off never pays for them
        if not self.fake_quant_enabled:
            return x
        self._sync()
        if not self.initialized:
            raise RuntimeError(
                f"{self.where}: {type(self).__name__}({self.extra_repr()}) has no qparams yet: it has observed no data "
                "and its observer is off. Calibrate (observer on) with data that reaches this layer before quantizing; "
                "ModelQuantizer.freeze runs the layers calibration never reached in float."
            )
        return apply_format(x, self.spec, self.scale, self.zero_point)

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        if not enabled:
            self._sync()  # statistics are final: fix the qparams now
        return super().enable_observer(enabled)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
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
        self.initialized.fill_(1)
        self._stale = False
        self.observer_enabled.fill_(0)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._sync()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def to_frozen(self) -> nn.Module:
        if self.is_dynamic:
            return self
        scale, zp = self.calculate_qparams()
        return FrozenScaledFakeQuantize(self.spec, scale.detach().clone(), zp.detach().clone())


class FrozenScaledFakeQuantize(FakeQuantizeBase):
    """Fixed qparams, no observer: the inference form of a calibrated static quantizer."""

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __init__(
        self, spec: QuantizationSpec, scale: torch.Tensor | None = None, zero_point: torch.Tensor | None = None
    ) -> None:
        super().__init__(spec, None if scale is None else scale.device)
        self.observer_enabled.fill_(0)
        self.register_buffer("scale", torch.ones(()) if scale is None else scale)
        self.register_buffer("zero_point", torch.zeros((), dtype=torch.int32) if zero_point is None else zero_point)

    def enable_observer(self, enabled: bool = True) -> FakeQuantizeBase:
        return self  # nothing to observe: frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # nothing to round (an MoE expert no token was routed to)
            return x
        if not self.fake_quant_enabled:
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
        self.observer_enabled.fill_(0)
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
        baked.fake_quant_enabled.copy_(frozen.fake_quant_enabled)
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


class NonScaledFakeQuantize(FakeQuantizeBase):
    """Casts and block formats: the format derives everything from the data; the observer records block maxima."""

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        self.observer = spec.observer_cls(spec, device)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.observer_enabled:
            self.observer(x)
        if not self.fake_quant_enabled:
            return x
        return apply_format(x, self.spec, None, None)


# ----------------------------------------------------------------------------------------------- TQT
class _TQTFunction(torch.autograd.Function):
    """TQT forward ``clamp(round(x / s), n, p) * s`` with ``s = 2^ceil(log2 t) / 2^(b-1)``; the paper's gradients:
    x: 1 inside [n, p], else 0; log2 t: ``s ln2 (round(x/s) - x/s)`` inside, ``s ln2 n`` / ``s ln2 p`` when clipped,
    summed over the tensor (per tensor) or over everything but ``axis`` (one threshold per channel).

    Only ``x`` and ``s`` are saved. Per tensor with half-even rounding the backward is torch's fused learnable
    fake-quant backward (its scale gradient is ``round(x/s) - x/s`` inside and n / p when clipped, exactly the paper's
    term before the factor ``s ln2``; ``x / s`` and ``x * (1/s)`` agree because ``s`` is a power of two); the other
    cases recompute the same terms here.
    """

    @staticmethod
    def forward(ctx, x, log2_t, qmin, qmax, frac_bits, round_method=RoundType.half_even, axis=None):  # type: ignore[override]
        s = torch.exp2(torch.ceil(log2_t) - frac_bits)
        sv = s if axis is None else channel_view(s, x.ndim, axis)
        ctx.save_for_backward(x, s)
        ctx.meta = (qmin, qmax, round_method, axis)
        return round_to_int(x / sv, round_method).clamp_(qmin, qmax).mul_(sv)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, s = ctx.saved_tensors
        qmin, qmax, round_method, axis = ctx.meta
        if axis is None and round_method == RoundType.half_even:
            zero = torch.zeros_like(s)
            grad_x, grad_s, _ = fake_quantize_learnable_backward(
                grad.contiguous(), x.contiguous(), s, zero, qmin, qmax, 1.0
            )
        else:
            v = x / (s if axis is None else channel_view(s, x.ndim, axis))
            r = round_to_int(v, round_method)
            inside = (r >= qmin) & (r <= qmax)
            grad_x = grad * inside
            local = torch.where(
                inside, r - v, torch.where(r < qmin, torch.full_like(v, qmin), torch.full_like(v, qmax))
            )
            g = grad * local
            grad_s = g.sum() if axis is None else g.sum(dim=[d for d in range(x.ndim) if d != axis % x.ndim])
        grad_t = grad_s.reshape_as(s) * s * math.log(2.0)
        return grad_x, grad_t, None, None, None, None, None


class LearnableFakeQuantize(FakeQuantizeBase):
    """Learnable quantizers (TQT, LSQ): initialised from the first batch seen with the observer on, then learned.

    The learned Parameter (``_learned_name``) has one element per tensor, or one per channel along ``axis``. A
    per-channel Parameter takes its shape from ``set_channels`` (the layer knows it: weights, a conv's activations)
    or else from the first batch; a checkpoint's shape wins on load.

    Non-finite values are refused, not skipped: a first batch holding NaN or Inf, and a learned value whose scale is
    not a finite positive number (NaN or inf after a bad optimizer step, a threshold whose power of two overflows or
    underflows, an LSQ scale driven to 0 or below), raise a ValueError naming the layer and role (``where``) in the
    next forward. Skipping the bad update is not possible from here (the optimizer has already written it, and its
    moments carry the NaN on), and quantizing with it would turn every output into NaN or inf silently; the error
    points at the step to fix (learning rate, gradient clipping, the data) or the checkpoint to resume from. The
    check runs on every training forward, and in eval mode only when the Parameter has changed since the last one
    (its version counter), so evaluation pays it once.
    """

    initialized: torch.Tensor
    _learned_name: str = ""
    _fill: float = 0.0  # the placeholder value of the learned Parameter before initialisation
    _checked: tuple[int, int] | None = None  # (version, data_ptr) of the learned Parameter last found valid
    _what: str = ""  # the learned quantity in error messages

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        self.axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
        self.channels: int | None = None  # per channel: the count, once known before the first batch
        self.register_parameter(self._learned_name, nn.Parameter(torch.full((1,), self._fill, device=device)))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8, device=device))

    @property
    def _learned_param(self) -> nn.Parameter:
        return getattr(self, self._learned_name)

    @property
    def channels_known(self) -> bool:
        """Whether the learned Parameter already has its final shape (per tensor, or per channel sized by
        ``set_channels``, or initialised)."""
        return self.axis is None or self.channels is not None or bool(self.initialized)

    def set_channels(self, count: int) -> None:
        """Give a per-channel Parameter its final shape before training, so that a wrapper that lays out gradient
        buffers once (DDP) sees the Parameter as it will stay."""
        if self.axis is None or bool(self.initialized):
            return
        self._resize(count)
        self.channels = count

    def _resize(self, count: int) -> None:
        """Reshape the learned Parameter (and per-channel buffers) to ``count`` elements, in place of the Parameter
        object's data so that optimizers built later see it."""
        param = self._learned_param
        with torch.no_grad():
            param.data = torch.full((count,), self._fill, device=param.device)

    def _set_learned(self, value: torch.Tensor) -> None:
        """Store the initial value of the learned Parameter (one element, or one per channel)."""
        param = self._learned_param
        if self.axis is not None and self.channels is None:  # shape from the data
            self._resize(value.numel())
        elif value.numel() != param.numel():
            raise ValueError(
                f"{self.where}: the {type(self).__name__} {self._learned_name} has {param.numel()} channels but the "
                f"tensor has {value.numel()} along axis {self.axis}"
            )
        with torch.no_grad():
            param.copy_(value.reshape(param.shape).to(param.device))
        self.initialized.fill_(1)

    def _per_channel_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as one row per channel along ``axis`` (float32, detached)."""
        xd = x.detach().float()
        return xd.movedim(self.axis, 0).reshape(xd.shape[self.axis], -1)  # type: ignore[arg-type]

    def _initialize(self, x: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _learned(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.numel():  # an empty input (an MoE expert no token was routed to): nothing to learn from or round
            return x
        if not self.initialized:
            if not self.observer_enabled and not self.fake_quant_enabled:
                return x  # nothing to apply, nothing to initialise from (evaluation before the first training batch)
            if not self.observer_enabled:
                raise RuntimeError(
                    f"{self.where}: {type(self).__name__} is not initialised yet: run a batch with the observer on first"
                )
            if not bool(torch.isfinite(x.detach()).all()):
                raise ValueError(
                    f"{self.where}: {type(self).__name__} would initialise its {self._what} from a tensor containing "
                    "NaN or Inf. Check the inputs and activations of this layer (e.g. torch.isfinite(x).all())."
                )
            self._initialize(x)
        if not self.fake_quant_enabled:
            return x
        self.check_learned()
        return self._learned(x)

    def _invalid(self) -> torch.Tensor:  # pragma: no cover - abstract
        """Mask of the learned elements whose scale is not a finite positive number."""
        raise NotImplementedError

    def check_learned(self) -> None:
        """ValueError (naming the layer and role) unless every learned element gives a finite positive scale.
        In eval mode, nothing to do while the Parameter is unchanged since the last check (its version counter and
        storage); in training mode it always runs (writes through ``.data``, as a cross-rank average does, leave the
        version counter as it was)."""
        param = self._learned_param
        state = (tensor_version(param), param.data_ptr())
        if state == self._checked and not self.training:
            return
        bad = self._invalid()
        if bool(bad.any()):
            values = param.detach().reshape(-1)[bad.reshape(-1)][:4].tolist()
            raise ValueError(
                f"{self.where}: the learned {type(self).__name__} {self._what} ({self._learned_name}) is "
                f"{', '.join(f'{v:.6g}' for v in values)} in {int(bad.sum())} of {bad.numel()} element(s), which gives "
                "no finite positive scale: a training step made it so (a NaN/inf loss or gradient, too high a learning "
                "rate). Lower the learning rate or clip gradients, and resume from a checkpoint saved before it."
            )
        self._checked = state

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        key = prefix + self._learned_name
        if key in state_dict and state_dict[key].shape != self._learned_param.shape:
            self._resize(state_dict[key].numel())
            self.channels = None if self.axis is None else state_dict[key].numel()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TQTFakeQuantize(LearnableFakeQuantize):
    """Trained Quantization Thresholds: ``log2 t`` is an ``nn.Parameter``; power-of-two scale ``2^ceil(log2 t) /
    2^(b-1)``, one per tensor (Jain et al. 2019, amd-quark's TQT) or one per channel (``qscheme=per_channel``: this
    engine's extension, each channel's threshold learned with the paper's gradient summed over that channel).

    The threshold is initialised from the first batch seen with the observer on, by the spec's
    ``threshold_init_meth`` (``_3SD`` by default, or ``_LL_J``), per tensor or per channel.
    """

    _learned_name = "log_threshold"
    _fill = 0.0
    _what = "log2 threshold"

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        fmt = format_of(spec.dtype)
        if not isinstance(fmt, IntFormat) or not fmt.signed:
            raise ValueError(f"TQT needs a signed integer dtype, got {spec.dtype.name}")
        self.bits = fmt.bits
        self.qmin, self.qmax = fmt.qmin, fmt.qmax
        self.init_method = spec.qat_spec.threshold_init_meth or TQTThresholdInitMeth._3SD  # type: ignore[union-attr]

    def _threshold(self, x: torch.Tensor) -> float:
        t = threshold_3sd(x) if self.init_method == TQTThresholdInitMeth._3SD else threshold_kl_j(x, self.bits)
        return math.log2(max(float(t), _EPS))

    def init_threshold(self, x: torch.Tensor) -> None:
        """Set ``log2 t`` from ``x`` by the configured method (each channel from its own values, per channel)."""
        rows = [x] if self.axis is None else list(self._per_channel_rows(x))
        self._set_learned(torch.tensor([self._threshold(r) for r in rows]))

    def _initialize(self, x: torch.Tensor) -> None:
        self.init_threshold(x)

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        out = _TQTFunction.apply(
            x.float(), self.log_threshold, self.qmin, self.qmax, float(self.bits - 1), self.round_method, self.axis
        )
        return cast_saturating(out, x.dtype)  # an fp16 input at 65504 may round to a grid point past it

    @property
    def scale(self) -> torch.Tensor:
        s = torch.exp2(torch.ceil(self.log_threshold.detach()) - (self.bits - 1))
        return s.reshape(()) if self.axis is None else s

    def _invalid(self) -> torch.Tensor:
        s = self.scale  # NaN, inf (t >= 2^128) or 0
        return ~torch.isfinite(s) | (s <= 0)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_learned()  # what export and to_frozen bake in
        scale = self.scale
        return scale, torch.zeros_like(scale, dtype=torch.int32)

    def to_frozen(self) -> nn.Module:
        scale, zp = self.calculate_qparams()
        return FrozenScaledFakeQuantize(self.spec, scale.clone(), zp)


# ----------------------------------------------------------------------------------------------- LSQ
class _LSQFunction(torch.autograd.Function):
    """LSQ with the gradients of torch's ``_fake_quantize_learnable_per_{tensor,channel}_affine``."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, qmin, qmax, grad_factor, axis, round_method=RoundType.half_even):  # type: ignore[override]
        s = scale if axis is None else channel_view(scale, x.ndim, axis)
        z = zero_point if axis is None else channel_view(zero_point, x.ndim, axis)
        inv = torch.reciprocal(s)
        xq = round_to_int(x * inv, round_method) + z
        xfq = (xq.clamp(qmin, qmax) - z) * s
        ctx.save_for_backward(x, xq, xfq, inv, z)
        ctx.meta = (qmin, qmax, grad_factor, axis)
        return xfq

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, xq, xfq, inv, z = ctx.saved_tensors
        qmin, qmax, grad_factor, axis = ctx.meta
        below, above = xq < qmin, xq > qmax
        grad_x = grad * ~(below | above)
        local = torch.where(below, qmin - z, torch.where(above, qmax - z, (xfq - x) * inv))
        g = grad * local * grad_factor
        if axis is None:
            grad_s = g.sum().reshape(1)
        else:
            dims = [d for d in range(x.ndim) if d != axis % x.ndim]
            grad_s = g.sum(dim=dims)
        return grad_x, grad_s, None, None, None, None, None, None


class LSQFakeQuantize(LearnableFakeQuantize):
    """Learned Step Size Quantization: the scale is an ``nn.Parameter`` (per tensor or per channel), initialised to
    ``2 * mean|x| / sqrt(qmax)`` on the first batch; gradients scaled by ``1 / sqrt(numel_per_scale * qmax)``."""

    zero_point: torch.Tensor
    _learned_name = "scale"
    _fill = 1.0
    _what = "step size"

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        fmt = format_of(spec.dtype)
        if not isinstance(fmt, IntFormat):
            raise ValueError(f"LSQ needs an integer dtype, got {spec.dtype.name}")
        self.qmin, self.qmax = fmt.qmin, fmt.qmax
        self.register_buffer("zero_point", torch.zeros(1, dtype=torch.int32, device=device))

    def _resize(self, count: int) -> None:
        super()._resize(count)
        self.zero_point = torch.zeros(count, dtype=torch.int32, device=self.zero_point.device)

    def init_scale(self, x: torch.Tensor) -> None:
        mean = (
            x.detach().float().abs().mean().reshape(1)
            if self.axis is None
            else self._per_channel_rows(x).abs().mean(dim=1)
        )
        self._set_learned((2 * mean / math.sqrt(self.qmax)).clamp(min=_EPS))

    def _initialize(self, x: torch.Tensor) -> None:
        self.init_scale(x)

    def _invalid(self) -> torch.Tensor:
        s = self.scale.detach()
        return ~torch.isfinite(s) | (s <= 0) | ~torch.isfinite(torch.reciprocal(s))  # 1/s: the forward's multiplier

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        grad_factor = 1.0 / math.sqrt(x.numel() / self.scale.numel() * self.qmax)
        out = _LSQFunction.apply(
            x.float(), self.scale, self.zero_point, self.qmin, self.qmax, grad_factor, self.axis, self.round_method
        )
        return cast_saturating(out, x.dtype)  # an fp16 input at 65504 may round to a grid point past it

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_learned()  # what export and to_frozen bake in
        if self.axis is None:
            return self.scale.detach().reshape(()), self.zero_point.reshape(())
        return self.scale.detach(), self.zero_point

    def to_frozen(self) -> nn.Module:
        scale, zp = self.calculate_qparams()
        return FrozenScaledFakeQuantize(self.spec, scale.clone(), zp.clone())
