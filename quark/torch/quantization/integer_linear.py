"""A fake-quantized Linear's product on its integer codes: ``torch._int_mm`` of the input's and the weight's int8 codes,
scaled once, in place of the float GEMM of their dequantized values.

Where both operands are fake-quantized to integers of at most 8 bits (signed weights with zero points of 0 per tensor
or per output channel; inputs per tensor, signed or unsigned, around any integral zero point), ``F.linear(fq(x),
fq(W), b)`` is ``sx * sw * ((qx - zx) @ qW^T) + b`` with integer codes ``qx``, ``qW``. The integer product is exact
(int32 accumulation), so the result is that of the deployed int8 kernel: it differs from the float GEMM's only in
the float GEMM's own rounding (a few units in the last place). On CPU, with VNNI, the int8 GEMM takes a fraction of
the float one's time (torch 2.13, 2 cores, 32 x 1024 x 4096: 0.46 against 2.8 ms), which is most of a QAT step's
forward at transformer widths. The backward is the float Linear's, on the same fake-quantized tensors ``F.linear``
would keep.

The codes are read back from the fake-quantized tensors: a value ``(q - zp) * s`` computed in float32, times
``1 / s``, lies within 2^-15 of the integer ``q - zp`` for ``|q - zp| <= 256`` and any normal scale, so rounding it
gives ``q - zp`` exactly. Input codes that span more than int8 (uint8, or int8 around a nonzero zero point) are read
as ``q - zp - shift`` with ``shift = offset - zp`` (offset 128 for unsigned, 0 for signed), which is ``q - offset``,
inside int8; the product is corrected by ``shift * sum(qW)`` per output channel, exactly, in the int32 accumulator.
The qparams are read on every call: weight zero points 0, an input zero point integral and inside its format's range,
scales in [2^-63, 2^63] (so ``sx * sw`` is a normal float32 too). One compiled pass per operand writes the codes and
a NaN carrier (``0 * the row's sum``): a NaN that ``F.linear`` would spread to an output row or column spreads to the
same one here, where an int8 code could not hold it.

The quantizers served: the observer-based and frozen ones (``ScaledFakeQuantize``, ``FrozenScaledFakeQuantize``) and
the learned ones (``TQTFakeQuantize``: power-of-two scales from the learned threshold; ``LSQFakeQuantize``), whose
learned parameters take their gradients through their own backward, as with ``F.linear``. Used by
``QuantLinear.forward`` and transformers' ``Conv1D`` twin (GPT-2) on CPU float32 tensors, where the weight has at
least ``INTEGER_GEMM_MIN_WEIGHT_NUMEL`` elements (below it the float GEMM is as fast: the measured crossover). Not
under traces or dispatch modes (``torch.compile``, ``torch.export``, TorchScript and so ONNX export, FX,
``make_fx``, ``FlopCounterMode``), autocast, functorch transforms, or a forward hook on either quantizer (or a global
one), which may replace the quantizer's output with values off its grid. ``QUARK_INTEGER_GEMM=0`` (or
``set_integer_gemm(False)``) keeps the float GEMM everywhere. By default it is on where the CPU reports an int8
dot product (AVX-512 VNNI, AVX-VNNI, AMX: ``cpu_has_int8_dot``), which the threshold was measured with; elsewhere
``QUARK_INTEGER_GEMM=1`` turns it on.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.fake_quant.fixed import FrozenScaledFakeQuantize
from quark.torch.quantization.fake_quant.learnable import LSQFakeQuantize, TQTFakeQuantize
from quark.torch.quantization.formats.grouping import compilable, fast_apply
from quark.torch.quantization.formats.integer import INT_MIN_NUMEL
from quark.torch.quantization.formats.table import IntFormat, format_of
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

__all__ = [
    "INTEGER_GEMM_MIN_WEIGHT_NUMEL",
    "cpu_has_int8_dot",
    "integer_gemm_enabled",
    "integer_linear",
    "integer_scales",
    "set_integer_gemm",
]

#: the smallest weight (elements) whose Linear takes the integer GEMM. Measured on 2 cores (torch 2.13, 32 rows;
#: ``bench/integer_linear.py``): the product alone (codes, ``_int_mm``, scaling) over ``F.linear``, in x out, 256 x 256
#: 3.29, 256 x 1024 1.00, 512 x 512 1.08, 1024 x 512 0.61, 1024 x 1024 0.49, 1024 x 4096 0.41; but inside a QAT
#: step (cold caches, the qparams check) the 1024 x 512 layers of the width-512 MLP gave 0.90-1.02 in six paired runs
#: (about even), those of width 1024 (1024 x 1024) 0.86-0.94
INTEGER_GEMM_MIN_WEIGHT_NUMEL = 1 << 20
#: int32 accumulation of products of codes in [-128, 127] is exact for fewer terms than this (2^31 / 2^14)
_MAX_IN_FEATURES = 1 << 17
#: with shifted input codes the exact sum ``sum((q - zp) * qW)`` is up to 255 * 128 per term, and the correction added
#: to the accumulator up to 128 * 128: exact in int32 for fewer terms than this (2^31 / 2^15)
_MAX_SHIFTED_IN_FEATURES = 1 << 16
#: scales this quantizer's codes are read back exactly with: normal float32, and small enough that a row's sum of
#: ``in_features`` values of at most ``128 * scale`` stays finite (the NaN carrier must not turn into inf * 0); the
#: bounds are the square roots of float32's normal range, so the product ``sx * sw`` the accumulator is scaled by is a
#: normal finite float32 too (an infinite one would turn an accumulator of 0 into NaN, a subnormal one lose bits)
_SCALE_MIN, _SCALE_MAX = 2.0**-63, 2.0**63
#: quantizers whose output is ``(q - zp) * scale`` with the scale they hold (or learn) after the call (not a baked
#: weight's pass-through: its tensor is only assumed to lie on the grid, and training could move it off)
_SERVING_TYPES = (ScaledFakeQuantize, FrozenScaledFakeQuantize, TQTFakeQuantize, LSQFakeQuantize)


#: CPU flags (Linux ``/proc/cpuinfo``) of an int8 dot-product instruction, which makes ``torch._int_mm`` fast (the
#: threshold above was measured with AVX-512 VNNI); without one the int8 GEMM may not beat the float one
_INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_has_int8_dot(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU reports an int8 dot-product instruction (VNNI, AMX); False where that cannot be read (not
    Linux)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return not _INT8_DOT_FLAGS.isdisjoint(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return False


def _enabled_from_env() -> bool:
    """``QUARK_INTEGER_GEMM``: unset, on where the CPU has an int8 dot product (``cpu_has_int8_dot``); ``1``, on;
    ``0``, off. Anything else is refused, naming the variable."""
    setting = os.environ.get("QUARK_INTEGER_GEMM", "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(
            f"QUARK_INTEGER_GEMM={setting!r}: allowed 0 (the float GEMM everywhere), 1 (the integer GEMM on any CPU) "
            "or unset (on where the CPU has VNNI or AMX)"
        )
    return cpu_has_int8_dot() if setting == "" else setting == "1"


_state = {"enabled": _enabled_from_env()}


def set_integer_gemm(enabled: bool | None) -> None:
    """Switch the integer GEMM of fake-quantized Linears on, off (the float GEMM everywhere: bit for bit ``F.linear``
    of the fake-quantized tensors) or, with None, back to the default (on where the CPU has an int8 dot product)."""
    _state["enabled"] = cpu_has_int8_dot() if enabled is None else bool(enabled)


def integer_gemm_enabled() -> bool:
    """Whether fake-quantized Linears may take the integer GEMM (``set_integer_gemm``, ``QUARK_INTEGER_GEMM``)."""
    return _state["enabled"]


@compilable(min_numel=INT_MIN_NUMEL)
def _codes_and_nan(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes of fake-quantized ``values`` [rows, cols] with ``scale`` broadcastable to them, and per row 0
    (NaN where the row holds a NaN): one pass when compiled."""
    codes = torch.round(values * torch.reciprocal(scale)).to(torch.int8)
    return codes, values.sum(-1, keepdim=True) * 0.0


@compilable(min_numel=INT_MIN_NUMEL)
def _shifted_codes_and_nan(
    values: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_codes_and_nan`` of an input whose codes ``q - zp`` span more than int8 (unsigned, or around a nonzero zero
    point): ``q - zp - shift``, which lies in [-128, 127] (``shift``: a 0-dim float32 tensor, so one kernel serves
    every zero point)."""
    codes = (torch.round(values * torch.reciprocal(scale)) - shift).to(torch.int8)
    return codes, values.sum(-1, keepdim=True) * 0.0


def _spec_offset(quantizer: Any, channel_axis: int | None) -> int | None:
    """What ``quantizer``'s codes are moved by to sit in int8, where its spec gives integers an 8-bit GEMM can take in
    a layout the product can be scaled afterwards; None where it does not. Integers of at most 8 bits signed: 0.
    An input's unsigned integers of at most 8 bits: 128 (their codes ``q - zp`` are read back shifted, and the product
    corrected, ``_IntegerLinear``). Per tensor, or for a weight (signed only) per output channel (``channel_axis`` of
    the stored 2-D weight: 0 for ``nn.Linear``'s [out, in], 1 for transformers' ``Conv1D`` [in, out]). Kept per spec
    object."""
    spec = quantizer.spec
    cached = quantizer.__dict__.get("_integer_gemm_spec")
    if cached is not None and cached[0] is spec and cached[1] == channel_axis:
        return cached[2]
    fmt = format_of(spec.dtype)
    layout = spec.qscheme == QSchemeType.per_tensor or (
        channel_axis is not None
        and spec.qscheme == QSchemeType.per_channel
        and spec.ch_axis in (channel_axis, channel_axis - 2)
    )
    offset = None
    if isinstance(fmt, IntFormat) and layout:
        if fmt.qmin >= -128 and fmt.qmax <= 127:
            offset = 0
        elif channel_axis is None and fmt.qmin >= 0 and fmt.qmax <= 255:
            offset = 128
    quantizer.__dict__["_integer_gemm_spec"] = (spec, channel_axis, offset)
    return offset


def _held_qparams(quantizer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The scale and zero point (None: 0) ``quantizer``'s last output was computed with: TQT's power of two from its
    learned threshold (``TQTFunction``'s arithmetic), LSQ's learned scale, the others' buffers."""
    kind = type(quantizer)
    if kind is TQTFakeQuantize:
        log_threshold = quantizer._parameters["log_threshold"].detach()
        return torch.exp2(torch.ceil(log_threshold) - float(quantizer.bits - 1)), None
    if kind is LSQFakeQuantize:
        return quantizer._parameters["scale"], quantizer._buffers["zero_point"]
    return quantizer._buffers.get("scale"), quantizer._buffers.get("zero_point")


def _scale_in_range(scale: torch.Tensor) -> bool:
    """Scales in [``_SCALE_MIN``, ``_SCALE_MAX``] (NaN fails): a host read of a one-element tensor, ``aminmax``
    otherwise (a few us on CPU; it runs on every call)."""
    if scale.numel() == 1:
        lo = hi = scale.item()
    else:
        lo, hi = (v.item() for v in torch.aminmax(scale))
    return _SCALE_MIN <= lo and hi <= _SCALE_MAX


def _usable_scale(scale: torch.Tensor | None, counts: tuple[int, ...]) -> bool:
    return (
        scale is not None
        and type(scale) in (torch.Tensor, torch.nn.Parameter)
        and scale.dtype == torch.float32
        and scale.device.type == "cpu"
        and scale.numel() in counts
        and _scale_in_range(scale)
    )


def _weight_scale(quantizer: Any, channels: int) -> torch.Tensor | None:
    """The weight quantizer's scale shaped [channels, 1] (per channel) or [] where its codes can be read back exactly:
    zero points all 0, a float32 scale in the exact range per tensor or per ``channels``; else None. Read on every
    call, not memoized: a write through ``.data`` changes the values without a version bump, and tensors made under
    ``inference_mode`` have no version at all (the reads cost a few us on CPU)."""
    scale, zp = _held_qparams(quantizer)
    if zp is not None and (zp.numel() not in (1, channels) or zp.count_nonzero().item() != 0):
        return None
    if not _usable_scale(scale, (1, channels)):
        return None
    return (scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)).detach()  # type: ignore[union-attr]


def _input_scale_and_shift(quantizer: Any, offset: int) -> tuple[torch.Tensor, int] | None:
    """The input quantizer's per-tensor scale and the shift its codes ``q - zp`` are read back with (``offset - zp``,
    so that they sit in int8), where they can be read back exactly: a float32 scale in the exact range, an integral
    zero point inside the format's range (so ``|q - zp| <= 255``); else None. Read on every call."""
    scale, zp = _held_qparams(quantizer)
    if not _usable_scale(scale, (1,)):
        return None
    point = 0
    if zp is not None:
        if zp.numel() != 1:
            return None
        value = zp.item()
        fmt = format_of(quantizer.spec.dtype)
        if not (math.isfinite(value) and value == round(value) and fmt.qmin <= value <= fmt.qmax):
            return None  # (a float zero point: NaN or inf first, which round() refuses)
        point = int(value)
    return scale.reshape(()).detach(), offset - point  # type: ignore[union-attr]


def _quantizer_serves(quantizer: Any, channel_axis: int | None) -> int | None:
    """The code offset (``_spec_offset``) of a quantizer of ``_SERVING_TYPES`` with a spec that serves and fake
    quantization on; None otherwise."""
    if (
        type(quantizer) not in _SERVING_TYPES
        or quantizer._forward_hooks  # a hook may replace the output (rotation training's add_scale_gradient)
        or not quantizer.flag("fake_quant_enabled")
    ):
        return None
    return _spec_offset(quantizer, channel_axis)


def _plain_cpu_float(t: torch.Tensor | None) -> bool:
    return t is None or (
        type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
    )


def integer_scales(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_quantizer: Any,
    weight_quantizer: Any,
    channel_axis: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The input's and the weight's scales, and the shift the input's codes are read with (0 where they are signed
    around a zero point of 0), where ``F.linear(x, weight, bias)`` of these quantizers' outputs may take the integer
    GEMM now (see the module's docstring); None where it takes the float one. ``weight`` is [out, in] as
    ``F.linear`` takes it; ``channel_axis`` is the output channels' axis in the layout its quantizer saw."""
    if (
        not _state["enabled"]
        or input_quantizer is None
        or weight_quantizer is None
        or torch.compiler.is_compiling()  # traces first: their sizes and values are not to be read
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
        or is_in_torch_dispatch_mode()  # make_fx, FlopCounterMode, ...: values not to be read, ops to be seen
        or torch.nn.modules.module._global_forward_hooks  # may replace a quantizer's output
        or not (_plain_cpu_float(x) and _plain_cpu_float(weight) and _plain_cpu_float(bias))
        or weight.dim() != 2
        or weight.numel() < INTEGER_GEMM_MIN_WEIGHT_NUMEL
        or weight.shape[1] >= _MAX_IN_FEATURES
        or not x.numel()
        or torch.is_autocast_enabled("cpu")
        or forward_ad._current_level >= 0
        or torch._C._are_functorch_transforms_active()
    ):
        return None
    offset = _quantizer_serves(input_quantizer, None)
    if offset is None or _quantizer_serves(weight_quantizer, channel_axis) != 0:
        return None
    held = _input_scale_and_shift(input_quantizer, offset)
    sw = _weight_scale(weight_quantizer, weight.shape[0])
    if held is None or sw is None or (held[1] and weight.shape[1] >= _MAX_SHIFTED_IN_FEATURES):
        return None
    return held[0], sw, held[1]


class _IntegerLinear(torch.autograd.Function):
    """``F.linear`` of fake-quantized ``x`` and ``weight`` with the forward's product on their int8 codes; the
    backward is the float Linear's (the same tensors kept, the same products). ``shift``: the input's codes are read
    as ``q - zp - shift`` (int8), and ``shift * sum(qW)`` per output channel added back in the int32 accumulator."""

    @staticmethod
    def forward(ctx, x, weight, bias, sx, sw, shift):  # type: ignore[override]
        rows = x.reshape(-1, x.shape[-1])
        qw, w_nan = _codes_and_nan(weight, sw)
        if shift:
            qx, x_nan = _shifted_codes_and_nan(rows, sx, sx.new_tensor(float(shift)))
            # sum((q - zp) * qW) = sum((q - zp - shift) * qW) + shift * sum(qW): the weight's row sums come from the
            # same GEMM, as the product of an appended row of ones (an int8 sum over the weight took as long as the
            # GEMM); exact in int32 within the bound
            acc = torch._int_mm(torch.cat((qx, qx.new_ones(1, qx.shape[1]))), qw.t())
            acc = torch.add(acc[:-1], acc[-1], alpha=shift)
        else:
            qx, x_nan = _codes_and_nan(rows, sx)
            acc = torch._int_mm(qx, qw.t())
        shape = (*x.shape[:-1], weight.shape[0])
        acc = acc.to(torch.float32).reshape(shape)
        # 0, or NaN in a row / column a NaN operand reaches
        carry = x_nan.reshape(*x.shape[:-1], 1) + w_nan.reshape(weight.shape[0])
        if bias is not None:
            carry = carry + bias
        # built in its final shape: a view of a tensor made here could not be modified in place (ReLU(inplace=True))
        out = torch.addcmul(carry, acc, sx * sw.reshape(-1))
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = rows.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


_integer_linear = fast_apply(_IntegerLinear)


def integer_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_quantizer: Any,
    weight_quantizer: Any,
    channel_axis: int = 0,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of ``input_quantizer``'s and ``weight_quantizer``'s outputs (called right after
    them: their held scales are the ones they used), on the integer codes where that applies (``integer_scales``)."""
    scales = integer_scales(x, weight, bias, input_quantizer, weight_quantizer, channel_axis)
    if scales is None:
        return F.linear(x, weight, bias)
    return _integer_linear(x, weight, bias, *scales)
