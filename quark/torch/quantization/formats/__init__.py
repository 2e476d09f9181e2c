"""Every number format of the engine, as pure tensor functions (quantize -> dequantize, plus encoded forms).

``fake_quantize`` dispatches on the Dtype; the per-family modules hold the arithmetic:
``integer`` (any width), ``minifloat`` (fp8/fp6/fp4), ``block`` (MX, MX6/MX9, BFP16), and casts here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats.block import (
    MX_SCALE_MODES,
    PreparedBlock,
    bfp_codes,
    block_absmax,
    block_kernel,
    fake_quantize_bfp16,
    fake_quantize_mx,
    fake_quantize_mx6,
    fake_quantize_mx9,
    microexponent_codes,
    mx_shared_exponent,
    observed_block_kernel,
    quantize_mx,
)
from quark.torch.quantization.formats.grouping import (
    Backend,
    BlockLayout,
    TileLayout,
    aminmax_along,
    from_blocks,
    from_tiles,
    plan_run_end,
    plan_step_end,
    plan_step_start,
    round_to_int,
    set_compile,
    to_blocks,
    to_tiles,
)
from quark.torch.quantization.formats.integer import (
    PreparedInt,
    apply_scale_type,
    dequantize_int,
    fake_quantize_int,
    fake_quantize_int_grad,
    int_forward,
    int_gradient_passes,
    quantize_int,
    scale_dtype,
)
from quark.torch.quantization.formats.minifloat import (
    PreparedGrid,
    cast_forward,
    decode,
    encode,
    fake_quantize_minifloat,
    fake_quantize_minifloat_grad,
    grid_forward,
    minifloat_gradient_passes,
    round_to_grid,
)
from quark.torch.quantization.formats.table import (
    BLOCK_FORMATS,
    CAST_FORMATS,
    FLOAT_FORMATS,
    MX_ELEMENT_DTYPES,
    TORCH_FLOAT8,
    BlockFormat,
    CastFormat,
    FloatFormat,
    IntFormat,
    bits_per_element,
    format_of,
    int_range,
)

__all__ = [
    # dispatch and backend
    "fake_quantize",
    "fake_quantize_grad",
    "gradient_passes",
    "prepare_block",
    "Backend",
    "set_compile",
    "plan_step_start",
    "plan_step_end",
    "plan_run_end",
    "aminmax_along",
    "fake_cast",
    "elementwise_quantizer",
    "is_scaled",
    # tables
    "IntFormat",
    "FloatFormat",
    "CastFormat",
    "BlockFormat",
    "FLOAT_FORMATS",
    "CAST_FORMATS",
    "BLOCK_FORMATS",
    "TORCH_FLOAT8",
    "MX_ELEMENT_DTYPES",
    "format_of",
    "int_range",
    "bits_per_element",
    # integers
    "fake_quantize_int",
    "PreparedGrid",
    "PreparedBlock",
    "PreparedInt",
    "quantize_int",
    "dequantize_int",
    "apply_scale_type",
    "scale_dtype",
    "round_to_int",
    # minifloats
    "round_to_grid",
    "fake_quantize_minifloat",
    "encode",
    "decode",
    # blocks
    "fake_quantize_mx",
    "fake_quantize_mx6",
    "fake_quantize_mx9",
    "fake_quantize_bfp16",
    "quantize_mx",
    "mx_shared_exponent",
    "MX_SCALE_MODES",
    "microexponent_codes",
    "bfp_codes",
    "block_absmax",
    "to_blocks",
    "from_blocks",
    "BlockLayout",
    "to_tiles",
    "from_tiles",
    "TileLayout",
]


class _CastSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype):  # type: ignore[override]
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def fake_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round trip through ``dtype`` (bfloat16, float16), straight-through gradient."""
    return _CastSTE.apply(x, dtype)


#: ``fn(x, scale, zero_point)``: a scaled format's quantize -> dequantize, qparams broadcastable to ``x``
ElementwiseQuantizer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def elementwise_quantizer(dtype: Dtype | str, round_method: RoundType | None = None) -> ElementwiseQuantizer:
    """The eager elementwise core of a scaled format (integers, minifloats), without autograd or dispatch: the same
    arithmetic as ``fake_quantize`` (integers ``(clamp(round(x * (1 / s)) + zp) - zp) * s`` with ``round_method``,
    fp8 torch's cast of ``x / s``, other minifloats the grid rounding) for callers that quantize many small slices
    one at a time (GPTQ's columns), where neither a compiled kernel nor the autograd wrapper pays."""
    fmt = format_of(Dtype(dtype))
    if isinstance(fmt, IntFormat):
        qmin, qmax, method = fmt.qmin, fmt.qmax, round_method or RoundType.half_even
        int_core = int_forward.__wrapped__  # the eager body of the compilable kernel (the same bits)
        return lambda x, s, z: int_core(x, s, z, qmin, qmax, method)
    if isinstance(fmt, FloatFormat):
        torch_dtype = TORCH_FLOAT8.get(Dtype(dtype))
        if torch_dtype is not None:  # what fake_quantize runs eagerly for fp8: bit-identical to the grid, faster
            return lambda x, s, z: cast_forward(x, s, fmt.max_normal, torch_dtype)
        grid_core = grid_forward.__wrapped__
        return lambda x, s, z: grid_core(x, s, fmt)
    raise ValueError(
        f"dtype {Dtype(dtype).value} has no scale: elementwise_quantizer serves integer and minifloat dtypes"
    )


def is_scaled(dtype: Dtype) -> bool:
    """True for formats that take a scale from an observer (integers and minifloats)."""
    fmt = format_of(dtype)
    return isinstance(fmt, IntFormat | FloatFormat)


def fake_quantize(
    x: torch.Tensor,
    dtype: Dtype,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    *,
    qscheme: QSchemeType | None = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    round_method: RoundType | None = RoundType.half_even,
    mx_element_dtype: Dtype | None = None,
    mx_scale_mode: str | None = None,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to ``dtype`` and back. Scaled formats need ``scale`` (and ``zero_point`` for integers);
    ``block_size`` = [rows, cols] is the tile of ``qscheme=per_block`` (scale [ceil(R / rows), ceil(C / cols)]);
    ``mx_scale_mode`` is the E8M0 scale rule of dtype=mx (floor, ceil or even; None: floor)."""
    fmt = format_of(dtype)
    if isinstance(fmt, IntFormat):
        if scale is None or zero_point is None:
            raise ValueError(f"dtype={dtype.name} needs a scale and a zero_point")
        return fake_quantize_int(
            x,
            scale,
            zero_point,
            fmt.qmin,
            fmt.qmax,
            round_method=round_method or RoundType.half_even,
            qscheme=qscheme or QSchemeType.per_tensor,
            axis=axis,
            group_size=group_size,
            block_size=block_size,
        )
    if isinstance(fmt, FloatFormat):
        return fake_quantize_minifloat(
            x,
            fmt,
            scale,
            qscheme=qscheme or QSchemeType.per_tensor,
            axis=axis,
            group_size=group_size,
            torch_dtype=TORCH_FLOAT8.get(dtype),
            block_size=block_size,
        )
    if isinstance(fmt, CastFormat):
        return fake_cast(x, fmt.torch_dtype)
    block = group_size or fmt.default_block
    axis = -1 if axis is None else axis
    if fmt.kind == "mx":
        if mx_element_dtype is None:
            raise ValueError(f"dtype=mx needs mx_element_dtype, one of {[d.name for d in MX_ELEMENT_DTYPES]}")
        return fake_quantize_mx(x, mx_element_dtype, block, axis, mx_scale_mode or "floor")
    if dtype == Dtype.mx6:
        return fake_quantize_mx6(x, block, axis)
    if dtype == Dtype.mx9:
        return fake_quantize_mx9(x, block, axis)
    return fake_quantize_bfp16(x, block, axis)


def prepare_block(
    dtype: Dtype,
    group_size: int | None = None,
    axis: int | None = None,
    mx_element_dtype: Dtype | None = None,
    mx_scale_mode: str | None = None,
) -> PreparedBlock | None:
    """``fake_quantize`` of a block format (mx, mx6, mx9, bfp16; same arguments and defaults) resolved once, for a
    caller that keeps it (``PreparedBlock``: the same bits, and its steady path); None for any other format."""
    fmt = format_of(dtype)
    if isinstance(fmt, IntFormat | FloatFormat | CastFormat):
        return None
    if fmt.kind == "mx" and mx_element_dtype is None:
        raise ValueError(f"dtype=mx needs mx_element_dtype, one of {[d.name for d in MX_ELEMENT_DTYPES]}")
    block = group_size or fmt.default_block
    return PreparedBlock(
        *block_kernel(dtype, block, -1 if axis is None else axis, mx_element_dtype, mx_scale_mode or "floor"),
        observed_kernel=observed_block_kernel(dtype),
    )


def gradient_passes(
    values: torch.Tensor,
    dtype: Dtype,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    round_method: RoundType | None = RoundType.half_even,
) -> torch.Tensor:
    """Whether ``fake_quantize_grad`` passes the gradient unchanged at every one of ``values`` (a 0-dim bool tensor),
    each value elementwise to its ``scale`` / ``zero_point`` (an observer's statistics and their qparams), in that
    function's own arithmetic: a range's two ends passing means every value between them does. False for formats
    without a scale."""
    fmt = format_of(dtype)
    if isinstance(fmt, IntFormat):
        return int_gradient_passes(values, scale, zero_point, fmt.qmin, fmt.qmax, round_method or RoundType.half_even)
    if isinstance(fmt, FloatFormat):
        return minifloat_gradient_passes(values, scale, fmt.max_normal)
    return torch.zeros((), dtype=torch.bool, device=values.device)


def fake_quantize_grad(
    grad: torch.Tensor,
    x: torch.Tensor,
    dtype: Dtype,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    *,
    qscheme: QSchemeType | None = QSchemeType.per_tensor,
    axis: int | None = None,
    group_size: int | None = None,
    round_method: RoundType | None = RoundType.half_even,
    block_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """The gradient ``fake_quantize`` (same arguments) gives ``x`` for ``grad``, for a scaled format (integers and
    minifloats): the straight-through estimator, 0 where the format clips. For callers that compute the forward in a
    pass of their own (an observer's statistics, the qparams and the rounding in one compiled kernel)."""
    fmt = format_of(dtype)
    qscheme = qscheme or QSchemeType.per_tensor
    if isinstance(fmt, IntFormat):
        return fake_quantize_int_grad(
            grad,
            x,
            scale,
            zero_point,
            fmt.qmin,
            fmt.qmax,
            round_method=round_method or RoundType.half_even,
            qscheme=qscheme,
            axis=axis,
            group_size=group_size,
            block_size=block_size,
        )
    if isinstance(fmt, FloatFormat):
        return fake_quantize_minifloat_grad(
            grad, x, fmt, scale, qscheme=qscheme, axis=axis, group_size=group_size, block_size=block_size
        )
    raise ValueError(f"dtype {Dtype(dtype).value} has no scale: fake_quantize_grad serves integer and minifloat dtypes")
