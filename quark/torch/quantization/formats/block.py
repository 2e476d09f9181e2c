"""Block formats: OCP MX v1.0 (E8M0 shared scale), MX6/MX9 (shared microexponents) and BFP16.

Every function blocks ``x`` along ``axis`` (a ragged last block is zero-padded, then cropped), works on
[..., n_blocks, block] in float32 and returns x's shape and dtype. Gradients are straight-through (identity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from quark.torch.quantization import late_flag
from quark.torch.quantization.config.type import Dtype
from quark.torch.quantization.formats.bits import frexp32, ldexp32, pow2
from quark.torch.quantization.formats.grouping import (
    SteadyKernels,
    cast_saturating,
    compilable,
    compiled_kernels_active,
    fast_apply,
    from_blocks,
    look_for_steady,
    static_int,
    steady_key,
    to_blocks,
)
from quark.torch.quantization.formats.minifloat import round_to_grid
from quark.torch.quantization.formats.table import (
    FLOAT_FORMATS,
    MXINT8_IMPLICIT_EXP,
    MXINT8_QMAX,
    TORCH_FLOAT8,
    element_emax,
)

E8M0_BIAS = 127
#: how an MX block's E8M0 scale is derived from its max|x| (``QuantizationSpec.scale_calculation_mode``)
MX_SCALE_MODES = ("floor", "ceil", "even")


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for a > 0, exactly (frexp, no float log); int32."""
    return frexp32(a)[1] - 1


def mx_mantissa_bits(element: Dtype) -> int:
    """Mantissa bits of an MX element for the "even" scale rule (amd-quark's table: int8 counts as 8)."""
    return 8 if element == Dtype.int8 else FLOAT_FORMATS[element].mbits


def mx_shared_exponent(xb: torch.Tensor, element: Dtype, mode: str = "floor") -> torch.Tensor:
    """MX shared exponent per block from ``a = max|V|``, minus ``emax_elem``, clamped to [-127, 127]; three rules.

    - ``floor``: ``floor(log2 a)``, OCP MX v1.0's rule (the block max may saturate the element's largest value);
    - ``ceil``: ``ceil(log2 a)`` (never saturates; coarser);
    - ``even``: ``floor(log2 a')`` with ``a`` first rounded to the element's mantissa width, so a block whose max
      would round past the element's top binade takes the next exponent (amd-quark's default).

    xb [..., n_blocks, block] -> [..., n_blocks, 1] (int32). An all-zero block gets a finite exponent (its elements are 0 anyway).
    """
    return mx_exponent_of(xb.abs().amax(dim=-1, keepdim=True), element, mode)


def mx_exponent_of(amax: torch.Tensor, element: Dtype, mode: str = "floor") -> torch.Tensor:
    """``mx_shared_exponent`` from the blocks' ``amax = max|V|`` ([..., n_blocks, 1], float32)."""
    mantissa, exponent = frexp32(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1) (0 for 0)
    exp = exponent - 1  # floor(log2 amax); frexp(0) gives -1 - emax: clamped like any tiny block
    if mode == "ceil":
        exp = exp + (mantissa > 0.5).to(exp.dtype)
    elif mode == "even":  # 2 * mantissa in [1, 2) rounds up to 2 at the element's precision
        exp = exp + (mantissa >= 1.0 - 2.0 ** -(mx_mantissa_bits(element) + 2)).to(exp.dtype)
    elif mode != "floor":
        raise ValueError(f"MX scale_calculation_mode={mode!r}; allowed: {list(MX_SCALE_MODES)}")
    return (exp - element_emax(element)).clamp(-E8M0_BIAS, E8M0_BIAS)


def _mx_elements(v: torch.Tensor, element: Dtype) -> torch.Tensor:
    """Round scaled block values to the element grid (RNE, saturating)."""
    if element == Dtype.int8:
        step = 2.0**MXINT8_IMPLICIT_EXP
        return torch.round(v / step).clamp_(-MXINT8_QMAX, MXINT8_QMAX).mul_(step)
    if element in TORCH_FLOAT8 and not torch.compiler.is_compiling():  # compiled, the grid rounding vectorizes
        fmt = FLOAT_FORMATS[element]
        return v.clamp(-fmt.max_normal, fmt.max_normal).to(TORCH_FLOAT8[element]).float()
    return round_to_grid(v, FLOAT_FORMATS[element])


def quantize_mx(
    x: torch.Tensor, element: Dtype, block_size: int = 32, axis: int = -1, mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX encoding: (element values on the element grid, in blocked layout [..., n_blocks, block]; E8M0 bytes [..., n_blocks]).

    Dequantization is ``elements * 2^(e8m0 - 127)``; ``fake_quantize_mx`` returns exactly that in x's layout.
    """
    xb, _ = to_blocks(x.detach().float(), axis, block_size)
    exp = mx_shared_exponent(xb, element, mode)
    elements = _mx_elements(xb * _e8m0_value(-exp), element)
    return elements, (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def _e8m0_value(exp: torch.Tensor) -> torch.Tensor:
    """``2^exp`` (float32) of a per-block exponent in [-127, 127]: every such power of two is a float32 (2^-127 a
    subnormal), so one multiply by it is exactly ``ldexp``, and the full-size tensor needs no integer pass."""
    return ldexp32(torch.ones_like(exp, dtype=torch.float32), exp)


#: auto mode compiles the block formats from this size: their eager forms take several passes per block (MXFP8 on
#: 2 idle cores, torch 2.13: 4096 elements 46 us eager against 16 us compiled, 32768: 156 against 22)
BLOCK_MIN_NUMEL = 1 << 12
#: how much more the block kernels' elements count toward auto mode's warm-up and run plan than the others'
#: (``compiled_kernels_active``): MX QAT steps count a third of what int8 and fp8 steps count for the same layers
#: (the MLP of ``bench/compile_payback.py`` at width 1024: 2.2 against 6.6 and 7.7 million elements a step), while
#: compiling saves more of their step (MX 6.5 of 14.4 ms, int8 2.8 of 12.7): with this gain a fit's count meets
#: ``Backend.payback_numel`` near where compiling pays back in every format (docs/performance.md, sixteenth round)
BLOCK_GAIN = 5
#: ``block_absmax`` (an eager abs and a reduction) is no slower eagerly below this (65536 elements: 13.7 against 16.2 us)
ABSMAX_MIN_NUMEL = 1 << 18


def _mx_with_maxima(
    x: torch.Tensor, element: Dtype, block_size: int, axis: int, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantized MX ``x`` and its block maxima ([..., n_blocks], float32: ``block_absmax``), the maxima computed
    once for the shared exponents and returned (the body of both MX kernels)."""
    xb, layout = to_blocks(x.float(), axis, static_int(block_size))
    amax = xb.abs().amax(dim=-1, keepdim=True)
    exp = mx_exponent_of(amax, element, mode)
    out = _mx_elements(xb * _e8m0_value(-exp), element) * _e8m0_value(exp)
    return from_blocks(out, layout, x.shape), amax.squeeze(-1)


@compilable(min_numel=BLOCK_MIN_NUMEL, gain=BLOCK_GAIN)
def _fake_mx(x: torch.Tensor, element: Dtype, block_size: int, axis: int, mode: str = "floor") -> torch.Tensor:
    return _mx_with_maxima(x, element, block_size, axis, mode)[0]


@compilable(min_numel=BLOCK_MIN_NUMEL, gain=BLOCK_GAIN)
def _fake_mx_observed(
    x: torch.Tensor, element: Dtype, block_size: int, axis: int, mode: str = "floor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_fake_mx`` of ``x`` and its block maxima (``block_absmax``, what the MX observer records) from the one read
    of ``x`` the format makes anyway: while the observers are on (QAT's warm-up) a separate pass for the maxima cost
    0.15-0.18x an FP32 step of the width-512 and 1024 MLPs (docs/performance.md, eighth round)."""
    return _mx_with_maxima(x, element, block_size, axis, mode)


def _microexponent_pairs(xb: torch.Tensor, mantissa_bits: int, sub_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``microexponent_codes`` in sub-block layout: codes [..., n_blocks, block / sub, sub] and their step exponent
    [..., n_blocks, block / sub, 1] (one per sub-block, broadcast instead of expanded)."""
    a = xb.abs()
    amax = a.amax(dim=-1, keepdim=True)
    # E is an 8-bit shared exponent, [-127, 127]: exact for every block whose max is a normal float32 (only blocks
    # of float32 subnormals clamp). The step reaches 2^-134, so scaling by it needs ldexp (2^134 is no float32).
    block_exp = _floor_log2(amax).clamp_(-E8M0_BIAS, E8M0_BIAS).unsqueeze(-1)  # [..., n_blocks, 1, 1]
    subs = xb.reshape(*xb.shape[:-1], -1, sub_block)  # [..., n_blocks, block / sub, sub]
    sub_max = a.reshape(subs.shape).amax(dim=-1, keepdim=True)
    shift = (sub_max < ldexp32(torch.ones_like(sub_max), block_exp)).to(torch.int32)  # all of the pair below 2^E
    step_exp = block_exp - shift - (mantissa_bits - 1)
    limit = 2**mantissa_bits - 1
    return torch.round(ldexp32(subs, -step_exp)).clamp_(-limit, limit), step_exp


def microexponent_codes(xb: torch.Tensor, mantissa_bits: int, sub_block: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """MX6/MX9 on blocked x [..., n_blocks, block]: (sign-magnitude integer codes, per-element exponent of the step).

    Block exponent ``E = floor(log2 max|x|)``; a pair whose elements are all below ``2^E`` shifts down by its 1-bit
    micro-exponent; an element is ``code * 2^(E - shift - (mantissa_bits - 1))`` with ``|code| <= 2^mantissa_bits - 1``.
    """
    codes, step_exp = _microexponent_pairs(xb, mantissa_bits, sub_block)
    return codes.reshape(xb.shape), step_exp.expand(codes.shape).reshape(xb.shape)


def _pow2_wide(k: torch.Tensor) -> torch.Tensor:
    """``2.0^k`` (float32, exact) for int32 ``k`` in [-149, 127]: below -126 (subnormal powers) as two factors."""
    k1 = k.clamp(min=-126)
    if torch.compiler.is_compiling():  # no data-dependent branch in a traced graph
        return pow2(k1) * pow2((k - k1).clamp(min=-126))
    out = pow2(k1)
    if late_flag.defers(k.device) or bool((k < -126).any()):  # (on CUDA no read: the factor is 1, the same bits)
        out = out * pow2((k - k1).clamp(min=-126))
    return out


def _pow2_factors(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``2^k`` for int32 k in [-126, 254] as two float32 factors (``2^134``, the inverse of MX6's smallest step, is no
    float32): ``x * f1 * f2`` is exact, the same bits as ``ldexp(x, k)`` wherever the result is a normal float."""
    first = k.clamp(max=127)
    return pow2(first), pow2(k - first)


def _scale_up(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``x * 2^k`` by ``_pow2_factors``."""
    f1, f2 = _pow2_factors(k)
    return x * f1 * f2


@compilable(min_numel=BLOCK_MIN_NUMEL, gain=BLOCK_GAIN)
def _fake_microexponent(x: torch.Tensor, mantissa_bits: int, block_size: int, axis: int) -> torch.Tensor:
    """``microexponent_codes`` dequantized, bit-identical to ``ldexp(codes, step_exp)``. Traced by ``torch.compile``
    every full-size pass is float arithmetic in one vectorized loop (``_microexponent_traced``); eagerly, pair maxima
    and steps are computed once per pair (``_microexponent_eager``)."""
    if torch.compiler.is_compiling():
        return _microexponent_traced(x, static_int(mantissa_bits), static_int(block_size), axis)
    return _microexponent_eager(x, mantissa_bits, block_size, axis)


def _microexponent_eager(x: torch.Tensor, mantissa_bits: int, block_size: int, axis: int) -> torch.Tensor:
    """Pair maxima by ``maximum`` of the two halves, and the step's powers of two made from exponent bits on the
    per-pair tensors (``torch.ldexp`` computes ``pow`` per element: 2.3x slower on a 4096x4096 tensor)."""
    xb, layout = to_blocks(x.float(), axis, block_size)
    pairs = xb.reshape(*xb.shape[:-1], block_size // 2, 2)  # [..., n_blocks, block / 2, 2] (also for 0 blocks)
    a = pairs.abs()
    sub_max = torch.maximum(a[..., 0], a[..., 1]).unsqueeze(-1)  # [..., n_blocks, block / 2, 1]
    block_exp = _floor_log2(sub_max.amax(dim=-2, keepdim=True)).clamp_(-E8M0_BIAS, E8M0_BIAS)
    step_exp = block_exp - (sub_max < _pow2_wide(block_exp)).to(torch.int32) - (mantissa_bits - 1)  # [-134, 124]
    inverse = (-step_exp).clamp(max=127)  # x / 2^step as one or two exact power-of-two multiplies (2^134 is no float32)
    scaled = pairs * pow2(inverse)
    if late_flag.defers(step_exp.device) or bool((-step_exp > 127).any()):  # (as _pow2_wide)
        scaled = scaled * pow2(-step_exp - inverse)
    limit = 2**mantissa_bits - 1
    out = scaled.round_().clamp_(-limit, limit).mul_(_pow2_wide(step_exp))
    return from_blocks(out.reshape(xb.shape), layout, x.shape)


def _microexponent_traced(x: torch.Tensor, mantissa_bits: int, block_size: int, axis: int) -> torch.Tensor:
    """The same bits in the form inductor vectorizes: exponents and powers of two per block (integer work on 1/16 of
    the data), per element only float ops; the pair partner is read by a flip of the pair axis (a constant index, as
    ``static_int`` makes the block size), since a reduction over pairs of 2 compiles to a loop 2 wide."""
    xb, layout = to_blocks(x.float(), axis, block_size)
    a = xb.abs()
    pair_max = torch.maximum(a, a.unflatten(-1, (block_size // 2, 2)).flip(-1).flatten(-2))
    block_exp = _floor_log2(a.amax(dim=-1, keepdim=True)).clamp(-E8M0_BIAS, E8M0_BIAS)  # [..., n_blocks, 1]
    shift = pair_max < _pow2_wide(block_exp)  # both of the pair below 2^E: the step halves
    k = (mantissa_bits - 1) - block_exp  # -(step exponent) of an unshifted pair, up to 133
    (f1, f2), (f1_shifted, f2_shifted) = _pow2_factors(k), _pow2_factors(k + 1)  # per block; selected per element
    scaled = xb * torch.where(shift, f1_shifted, f1) * torch.where(shift, f2_shifted, f2)
    limit = 2**mantissa_bits - 1
    out = scaled.round().clamp(-limit, limit) * torch.where(shift, _pow2_wide(-k - 1), _pow2_wide(-k))
    return from_blocks(out, layout, x.shape)


def bfp_codes(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BFP16 on blocked x: (int8 codes in [-128, 127], shared step exponent [..., n_blocks, 1]).

    Step ``2^(floor(log2 max|x|) - 6)``, raised by one where a code would overflow int8 after rounding.
    """
    step_exp = _bfp_step_exp(xb)
    return torch.round(ldexp32(xb, -step_exp)).clamp_(-128, 127), step_exp


def _bfp_step_exp(xb: torch.Tensor) -> torch.Tensor:
    """BFP16's step exponent per block, [..., n_blocks, 1] (int32). ``E = floor(log2 max|x|)`` (8 bits: [-127, 127];
    all-zero blocks: any E, their codes are 0); step ``2^(E - 6)`` puts the block max in [64, 128) steps, where only
    the largest positive value can round up to 128 (-128 fits): then the step doubles."""
    top, bottom = xb.amax(dim=-1, keepdim=True), xb.amin(dim=-1, keepdim=True)
    step_exp = _floor_log2(torch.maximum(top, -bottom)).clamp(-E8M0_BIAS, E8M0_BIAS) - 6  # max|x| from the two
    # only the largest value can round up past 127 steps; the smallest below -128 only when it is -inf
    overflow = (_scale_up(top, -step_exp).round() > 127) | (_scale_up(bottom, -step_exp).round() < -128)
    return step_exp + overflow.to(torch.int32)


@compilable(min_numel=BLOCK_MIN_NUMEL, gain=BLOCK_GAIN)
def _fake_bfp(x: torch.Tensor, block_size: int, axis: int) -> torch.Tensor:
    """Codes times steps with float ops per element (the step's exponent per block), one vectorized loop compiled."""
    xb, layout = to_blocks(x.float(), axis, static_int(block_size))
    step_exp = _bfp_step_exp(xb)
    out = _scale_up(xb, -step_exp).round().clamp(-128, 127) * _pow2_wide(step_exp)
    return from_blocks(out, layout, x.shape)


@compilable(min_numel=ABSMAX_MIN_NUMEL)
def block_absmax(x: torch.Tensor, block_size: int, axis: int) -> torch.Tensor:
    """The largest magnitude of each block of ``block_size`` along ``axis`` ([..., n_blocks], float32; ragged last
    blocks zero-padded): what the block formats' observers record, in one read of ``x`` when compiled (eagerly, a
    float32 ``abs`` pass and a reduction)."""
    xb, _ = to_blocks(x.float(), axis, static_int(block_size))
    return xb.abs().amax(dim=-1)


def _check_even(block_size: int) -> None:
    if block_size % 2:
        raise ValueError(f"mx6/mx9 need an even group_size (pairs share a micro-exponent), got {block_size}")


class _BlockSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, args):  # type: ignore[override]
        # float32 into the kernel: compiled on a bfloat16 / float16 tensor, blocks of 8-16 elements are shorter than
        # a 32-lane half-precision vector and the loop runs scalar (MX6 on 4096x4096 bf16: 155 against 16 ms)
        return cast_saturating(fn(x.float(), *args), x.dtype)  # a step rounded up can pass an fp16 input's range

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


_block_ste = fast_apply(_BlockSTE)


def block_kernel(
    dtype: Dtype, block_size: int, axis: int, element: Dtype | None, mode: str
) -> tuple[Any, tuple[Any, ...]]:
    """The compiled kernel and its arguments after the input that fake-quantize a block format (``dtype``: mx with
    its ``element`` and scale ``mode``, mx6, mx9 or bfp16), checked: what ``fake_quantize`` and ``PreparedBlock``
    call through ``_BlockSTE``."""
    if dtype == Dtype.mx:
        return _fake_mx, (Dtype(element), block_size, axis, mode)  # type: ignore[arg-type]
    if dtype in (Dtype.mx6, Dtype.mx9):
        _check_even(block_size)
        return _fake_microexponent, (4 if dtype == Dtype.mx6 else 7, block_size, axis)
    if dtype == Dtype.bfp16:
        return _fake_bfp, (block_size, axis)
    raise ValueError(f"dtype={dtype.name} is not a block format (mx, mx6, mx9, bfp16)")


def observed_block_kernel(dtype: Dtype) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The kernel that fake-quantizes block format ``dtype`` and also returns its block maxima, taking
    ``block_kernel``'s arguments: MX's (``_fake_mx_observed``); None for the others (their observers record more)."""
    return _fake_mx_observed if dtype == Dtype.mx else None


class _SteadyBlockSTE(torch.autograd.Function):
    """``_BlockSTE`` with its direct kernel called straight (``PreparedBlock``'s steady path): the same kernel and bits,
    without the format dispatch, decisions and signature lookup between the quantizer and the generated code."""

    @staticmethod
    def forward(ctx, x, prepared, steady):  # type: ignore[override]
        return cast_saturating(steady.forward((x.float(), *prepared.args)), x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None


_steady_block_ste = fast_apply(_SteadyBlockSTE)


class _ObservedBlockSTE(torch.autograd.Function):
    """``_BlockSTE`` through a kernel that also returns the block maxima (``_fake_mx_observed``; not differentiable),
    called straight where ``steady`` holds its direct kernel."""

    @staticmethod
    def forward(ctx, x, kernel, args, steady):  # type: ignore[override]
        xf = x.float()  # (float32 into the kernel, as ``_BlockSTE``)
        out, amax = steady.forward((xf, *args)) if steady is not None else kernel(xf, *args)
        ctx.mark_non_differentiable(amax)
        return cast_saturating(out, x.dtype), amax

    @staticmethod
    def backward(ctx, grad, _amax_grad):  # type: ignore[override]
        return grad, None, None, None


_observed_block_ste = fast_apply(_ObservedBlockSTE)


@dataclass(eq=False)
class PreparedBlock:
    """A block format's kernel and arguments resolved once (``block_kernel``), kept by a quantizer that calls it every
    step: once the kernel is served directly for an input signature it is called straight (the steady path, as
    ``PreparedInt``). The same bits as ``fake_quantize``."""

    kernel: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    steady: dict[tuple[Any, ...], SteadyKernels] = field(default_factory=dict, repr=False)
    calls: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)
    #: the kernel that also returns the block maxima (``observe``; MX only, None for the others), and its steady path
    observed_kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    observed_steady: dict[tuple[Any, ...], SteadyKernels] = field(default_factory=dict, repr=False)
    observed_calls: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        key = steady_key(x)
        steady = self.steady.get(key) if key is not None else None
        if steady is not None:
            return _steady_block_ste(x, self, steady)
        out = _block_ste(x, self.kernel, self.args)
        if key is not None and compiled_kernels_active(x, BLOCK_MIN_NUMEL, count=False):
            look_for_steady(self.steady, self.calls, key, self.kernel, (x.float(), *self.args))
        return out

    def observe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fake-quantized ``x``, its block maxima as ``block_absmax`` gives them) from one pass: a caller that records
        the maxima (the MX observer) and quantizes the same tensor. Only where ``observed_kernel`` is set (MX)."""
        kernel = self.observed_kernel
        if kernel is None:
            raise ValueError("PreparedBlock.observe: this block format has no kernel that returns its block maxima")
        key = steady_key(x)
        steady = self.observed_steady.get(key) if key is not None else None
        out, amax = _observed_block_ste(x, kernel, self.args, steady)
        if steady is None and key is not None and compiled_kernels_active(x, BLOCK_MIN_NUMEL, count=False):
            look_for_steady(self.observed_steady, self.observed_calls, key, kernel, (x.float(), *self.args))
        return out, amax


def fake_quantize_mx(
    x: torch.Tensor, element: Dtype | str, block_size: int = 32, axis: int = -1, mode: str = "floor"
) -> torch.Tensor:
    """OCP MX: blocks of ``block_size`` along ``axis`` share ``2^(floor(log2 amax) - emax_elem)`` (``mode``: the
    scale rule of ``mx_shared_exponent``); elements RNE."""
    return _block_ste(x, *block_kernel(Dtype.mx, block_size, axis, Dtype(element), mode))


def fake_quantize_mx6(x: torch.Tensor, block_size: int = 16, axis: int = -1) -> torch.Tensor:
    """MX6: 8-bit shared exponent per 16, 1-bit micro-exponent per pair, sign + 4-bit mantissas."""
    return _block_ste(x, *block_kernel(Dtype.mx6, block_size, axis, None, "floor"))


def fake_quantize_mx9(x: torch.Tensor, block_size: int = 16, axis: int = -1) -> torch.Tensor:
    """MX9: as MX6 with sign + 7-bit mantissas."""
    return _block_ste(x, *block_kernel(Dtype.mx9, block_size, axis, None, "floor"))


def fake_quantize_bfp16(x: torch.Tensor, block_size: int = 8, axis: int = -1) -> torch.Tensor:
    """BFP16: blocks of ``block_size`` share an 8-bit exponent; 8-bit two's complement elements."""
    return _block_ste(x, *block_kernel(Dtype.bfp16, block_size, axis, None, "floor"))
