"""Straight-through masks (1 where the gradient passes, 0 where the format clips), in the form that is fastest where
they are computed.

Eagerly on CPU, aten's comparisons that write ``bool`` run several times slower than the same comparison written
into a float tensor (``torch.eq(a, b, out=float32)``), and ``grad * bool_mask`` pays a slow type promotion on top
(measured on 2 cores, 32768 elements: eq to bool 16.8 us, to float32 3.3 us; ``grad * mask`` 15.4 against 2.7 us;
at 262144 elements ``grad * bool_mask`` takes 604 us, ``grad * float_mask`` 16 us). So on CPU a mask is a float
tensor in the gradient's dtype. Elsewhere (CUDA: bool is as fast, and a quarter of the memory of a float32 mask) and
inside ``torch.compile`` (the comparison fuses into the kernel's loop) it stays bool. Either way ``grad * mask``
gives the same values, torch's -0.0 where a negative gradient is masked included.
"""

from __future__ import annotations

import torch

__all__ = ["at_most", "equal", "within"]


def _as_float(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """An empty float tensor of ``like``'s shape to write a CPU mask into; None where the mask stays bool."""
    if not _float_form(like):
        return None
    return torch.empty(like.shape, dtype=dtype if dtype.is_floating_point else torch.float32, device=like.device)


def _float_form(like: torch.Tensor) -> bool:
    """Whether a mask over ``like`` is written as a float tensor (eager, on CPU)."""
    return like.device.type == "cpu" and not torch.compiler.is_compiling()


def equal(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mask of ``a == b`` (same shape): float in ``dtype`` on CPU, else bool."""
    out = _as_float(a, dtype)
    return a == b if out is None else torch.eq(a, b, out=out)


def within(q: torch.Tensor, low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    """Mask of ``low <= q <= high`` (NaN: 0): ``q`` lies inside iff clamping leaves it as it is."""
    if not _float_form(q):
        return (q >= low) & (q <= high)
    return equal(q, q.clamp(low, high), dtype)


def at_most(a: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """Mask of ``a <= limit`` (NaN: 0)."""
    out = _as_float(a, dtype)
    return a <= limit if out is None else torch.le(a, limit, out=out)
