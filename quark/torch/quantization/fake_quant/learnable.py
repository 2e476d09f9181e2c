"""Learnable quantizers for quantization-aware training: the shared Parameter handling, TQT thresholds, LSQ scales."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from quark.torch.compat import tensor_version
from quark.torch.quantization import late_flag
from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType, TQTThresholdInitMeth
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase
from quark.torch.quantization.fake_quant.fixed import FrozenScaledFakeQuantize
from quark.torch.quantization.fake_quant.learnable_grad import LSQFunction, TQTFunction
from quark.torch.quantization.formats import IntFormat, format_of
from quark.torch.quantization.formats.grouping import cast_saturating
from quark.torch.quantization.late_flag import LateFlag
from quark.torch.quantization.observer.observer import threshold_3sd, threshold_kl_j

__all__ = ["LearnableFakeQuantize", "TQTFakeQuantize", "LSQFakeQuantize"]

_EPS = torch.finfo(torch.float32).eps
#: the midpoint between float32's largest finite value and 2^128: a quotient at or past it rounds to inf in float32
_F32_RECIPROCAL_OVERFLOW = 2.0**128 - 2.0**103


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
    (its version counter), so evaluation pays it once. In training on CUDA its result is read without a host sync
    (``LateFlag``): the error comes a step or a few later; eval, exports and ``calculate_qparams`` check at once.
    The forward reads its switches without a host sync too (``FakeQuantizeBase.flag``).
    """

    initialized: torch.Tensor
    _learned_name: str = ""
    _fill: float = 0.0  # the placeholder value of the learned Parameter before initialisation
    _checked: tuple[int, int] | None = None  # (version, data_ptr) of the learned Parameter last found valid
    _what: str = ""  # the learned quantity in error messages
    initial_value: torch.Tensor | None = None  # what the last initialisation wrote, until ``take_initial_value``
    #: the late check's pending device copies and the direct kernels of the steady path belong to this object and
    #: process: copies and pickles leave them behind
    _MEMOS = (*FakeQuantizeBase._MEMOS, "_late_check", "_steady")

    def __init__(self, spec: QuantizationSpec, device: torch.device | None = None) -> None:
        super().__init__(spec, device)
        self.axis = spec.ch_axis if spec.qscheme == QSchemeType.per_channel else None
        self.channels: int | None = None  # per channel: the count, once known before the first batch
        self.register_parameter(self._learned_name, nn.Parameter(torch.full((1,), self._fill, device=device)))
        self.register_flag("initialized", 0, device)

    @property
    def _learned_param(self) -> nn.Parameter:
        return getattr(self, self._learned_name)

    @property
    def learned_parameter(self) -> nn.Parameter:
        """The learned Parameter (TQT ``log_threshold``, LSQ ``scale``), as the module holds it now: under FSDP2
        outside a forward, the rank's shard (a DTensor)."""
        return self._learned_param

    def take_initial_value(self) -> torch.Tensor | None:
        """The value the last initialisation wrote (then forgotten), or None. Under FSDP2 a forward writes into the
        gathered copy of the Parameter, which is freed after it: ``quark.torch.quantization.sharded`` writes this
        value into the shards."""
        value, self.initial_value = self.initial_value, None
        return value

    @property
    def channels_known(self) -> bool:
        """Whether the learned Parameter already has its final shape (per tensor, or per channel sized by
        ``set_channels``, or initialised)."""
        return self.axis is None or self.channels is not None or self.flag("initialized")

    def set_channels(self, count: int) -> None:
        """Give a per-channel Parameter its final shape before training, so that a wrapper that lays out gradient
        buffers once (DDP) sees the Parameter as it will stay."""
        if self.axis is None or self.flag("initialized"):
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
        self.initial_value = param.detach().clone()
        self.set_flag("initialized", 1)

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
        flag = self.flag  # the switches, read from the device only when written since (a host sync on CUDA)
        if not flag("initialized"):
            if not flag("observer_enabled") and not flag("fake_quant_enabled"):
                return x  # nothing to apply, nothing to initialise from (evaluation before the first training batch)
            self._initialize_checked(x)
        if not flag("fake_quant_enabled"):
            return x
        if self.training:
            self._check_late()
        else:
            self.check_learned()
        return self._learned(x)

    @torch.compiler.disable  # once, from the first batch: its checks read the batch (inside torch.compile, a graph
    # break in the first step's graph only; the graph recompiles without it once the flag is set)
    def _initialize_checked(self, x: torch.Tensor) -> None:
        """Initialise the learned value from ``x`` (the observer must be on, ``x`` finite)."""
        if not self.flag("observer_enabled"):
            raise RuntimeError(
                f"{self.where}: {type(self).__name__} is not initialised yet: run a batch with the observer on first"
            )
        if not bool(torch.isfinite(x.detach()).all()):
            raise ValueError(
                f"{self.where}: {type(self).__name__} would initialise its {self._what} from a tensor containing "
                "NaN or Inf. Check the inputs and activations of this layer (e.g. torch.isfinite(x).all())."
            )
        self._initialize(x)

    def _check_late(self) -> None:
        """The training forward's check of the learned values: on CUDA read late, without a host sync (``LateFlag``);
        inside a ``torch.compile``d forward folded into the graph and read after it; on the CPU at once, as
        ``check_learned``."""
        late = self.__dict__.get("_late_check")
        param = self._learned_param
        if (
            param.numel() == 1
            and type(param) is nn.Parameter  # (not a DTensor shard)
            and not late_flag.defers(param.device)  # the CPU, eagerly: read at once either way
            and (late is None or late.idle())
        ):  # one value on the host: checked in Python (the tensor check is ~8 ops a forward, 3-6% of a QAT step)
            if self._invalid_value(param.item()):
                self._raise_invalid(late=False)
            return
        if late is None:
            late = self.__dict__["_late_check"] = LateFlag()
        if late.raised(self._invalid().any()):
            self._raise_invalid(late=True)

    def _invalid(self) -> torch.Tensor:  # pragma: no cover - abstract
        """Mask of the learned elements whose scale is not a finite positive number."""
        raise NotImplementedError

    def _invalid_value(self, value: float) -> bool:  # pragma: no cover - abstract
        """``_invalid`` of one learned value (a float32 read into a Python float), computed on the host."""
        raise NotImplementedError

    def check_learned(self) -> None:
        """ValueError (naming the layer and role) unless every learned element gives a finite positive scale.
        In eval mode, nothing to do while the Parameter is unchanged since the last check (its version counter and
        storage); in training mode it always runs (writes through ``.data``, as a cross-rank average does, leave the
        version counter as it was)."""
        param = self._learned_param
        self.read_late_checks()
        state = (tensor_version(param), param.data_ptr())
        if state == self._checked and not self.training:
            return
        if bool(self._invalid().any()):
            self._raise_invalid(late=False)
        self._checked = state

    def read_late_checks(self) -> None:
        """Wait for the training forwards' checks still on their way (``LateFlag``, CUDA) and raise their ValueError
        if one found a bad value: where an exact answer is needed now (eval, exports, the end of a fit, a checkpoint),
        so that a bad value made by one of the last steps is not left unread."""
        super().read_late_checks()
        late = self.__dict__.get("_late_check")
        if late is not None and late.wait():
            self._raise_invalid(late=True)

    def _raise_invalid(self, late: bool) -> None:
        """The ValueError of learned values that give no finite positive scale, with the bad values where they are
        still there (``late``: found by an earlier training forward's check, read without a host sync)."""
        param = self._learned_param
        bad = self._invalid()
        what = f"the learned {type(self).__name__} {self._what} ({self._learned_name})"
        if bool(bad.any()):
            values = param.detach().reshape(-1)[bad.reshape(-1)][:4].tolist()
            found = (
                f"{what} is {', '.join(f'{v:.6g}' for v in values)} in {int(bad.sum())} of {bad.numel()} "
                "element(s), which gives no finite positive scale"
            )
        else:  # (only a late check: it is valid again now)
            found = (
                f"{what} gave no finite positive scale at an earlier training step (read late on CUDA, without a host "
                "sync); it has changed since"
            )
        raise ValueError(
            f"{self.where}: {found}: a training step made it so (a NaN/inf loss or gradient, too high a learning "
            "rate). Lower the learning rate or clip gradients, and resume from a checkpoint saved before it."
        )

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        key = prefix + self._learned_name
        if key in state_dict and state_dict[key].shape != self._learned_param.shape:
            self._resize(state_dict[key].numel())
            self.channels = None if self.axis is None else state_dict[key].numel()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TQTFakeQuantize(LearnableFakeQuantize, kind="tqt"):
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
        # the steady path's direct kernels per input signature and compiled calls counted (not state, not copied);
        # none inside a caller's torch.compile, which traces the kernels' eager bodies
        steady = None if torch.compiler.is_compiling() else self.__dict__.get("_steady")
        if steady is None and not torch.compiler.is_compiling():
            steady = self.__dict__["_steady"] = ({}, {})
        out = TQTFunction.apply(
            x.float(),
            self.log_threshold,
            self.qmin,
            self.qmax,
            float(self.bits - 1),
            self.round_method,
            self.axis,
            steady,
        )
        return cast_saturating(out, x.dtype)  # an fp16 input at 65504 may round to a grid point past it

    @property
    def scale(self) -> torch.Tensor:
        s = torch.exp2(torch.ceil(self.log_threshold.detach()) - (self.bits - 1))
        return s.reshape(()) if self.axis is None else s

    def _invalid(self) -> torch.Tensor:
        s = self.scale  # NaN, inf (t >= 2^128) or 0
        return ~torch.isfinite(s) | (s <= 0)

    def _invalid_value(self, value: float) -> bool:
        # float32's 2^e is finite and positive for the integers e in [-149, 127] (2^-149: its smallest subnormal)
        return not (math.isfinite(value) and -149 <= math.ceil(value) - (self.bits - 1) <= 127)

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_learned()  # what export and to_frozen bake in
        scale = self.scale
        return scale, torch.zeros_like(scale, dtype=torch.int32)

    def to_frozen(self) -> nn.Module:
        scale, zp = self.calculate_qparams()
        return FrozenScaledFakeQuantize(self.spec, scale.clone(), zp)


class LSQFakeQuantize(LearnableFakeQuantize, kind="lsq"):
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

    def _invalid_value(self, value: float) -> bool:
        # float32's 1 / s (correctly rounded) overflows where the exact quotient reaches the midpoint between its
        # largest finite value and 2^128
        return not (math.isfinite(value) and value > 0 and 1.0 / value < _F32_RECIPROCAL_OVERFLOW)

    def _learned(self, x: torch.Tensor) -> torch.Tensor:
        grad_factor = 1.0 / math.sqrt(x.numel() / self.scale.numel() * self.qmax)
        out = LSQFunction.apply(
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
