"""Checks that a transform meant to keep what a model computes (SmoothQuant, AWQ's scaling, cross-layer
equalization, BatchNorm folding, rotations) did keep it: the same data through the model before and after, with
quantizers off, must agree to float noise; otherwise the transform raises, naming itself and the layer, and the
model is put back as it was.

One place for the comparison rule, so that every transform is judged alike:
``relative_error = ||after - before||_2 / ||before||_2`` over every floating-point tensor of the outputs, and the
tolerance depends only on the dtype the model computes in (``tolerance``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

#: relative error allowed per compute dtype: float noise of a rescaled layer (a product of two roundings of each
#: weight and of a differently ordered sum), far below what a wrong fold gives (O(1) for a misplaced scale)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
#: float32 convolutions and matmuls on CUDA may run in TF32 (10 mantissa bits; cuDNN's default for convolutions)
_TF32_EPS = 2.0**-10


class EquivalenceError(ValueError):
    """A transform that should not change what a model computes changed it."""


def tolerance(dtype: torch.dtype, device: torch.device | str | None = None) -> float:
    """The relative error a function-preserving transform may show in ``dtype`` on ``device`` (half types, and float32
    on a GPU where TF32 is allowed: 8 machine epsilons of the precision that really computes)."""
    if dtype == torch.float32 and _tf32(device):
        return 8 * _TF32_EPS
    if dtype in _TOLERANCE:
        return _TOLERANCE[dtype]
    return 8 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _tf32(device: torch.device | str | None) -> bool:
    """Whether float32 convolutions or matmuls on ``device`` may run in TF32 (torch's settings as they are now)."""
    if device is None or torch.device(device).type != "cuda":
        return False
    return bool(torch.backends.cudnn.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (nested) output: tensors, tuples, lists, dicts and dataclass-like
    ModelOutputs (their ``to_tuple``), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if hasattr(value, "to_tuple") and callable(value.to_tuple):  # transformers' ModelOutput
        value = value.to_tuple()
    if isinstance(value, Mapping):
        return [t for k in sorted(value, key=str) for t in float_tensors(value[k])]
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [t for v in value for t in float_tensors(v)]
    return []


def relative_error(before: Any, after: Any) -> float:
    """``||after - before|| / ||before||`` over all floating-point tensors of two outputs of the same structure
    (computed in float64); ``inf`` when their structures or shapes differ or ``after`` is not finite where
    ``before`` is."""
    ref, new = float_tensors(before), float_tensors(after)
    if len(ref) != len(new) or any(a.shape != b.shape for a, b in zip(ref, new, strict=True)):
        return float("inf")
    if not ref:
        return 0.0
    ref, new = [t.detach() for t in ref], [t.detach() for t in new]
    diff = sum(float((b.double() - a.double()).square().sum()) for a, b in zip(ref, new, strict=True))
    norm = sum(float(a.double().square().sum()) for a in ref)
    if diff != diff:  # NaN where the reference had none
        return float("inf")
    return (diff / max(norm, torch.finfo(torch.float64).tiny)) ** 0.5


def check_equivalent(transform: str, where: str, before: Any, after: Any, dtype: torch.dtype | None = None) -> float:
    """Raise EquivalenceError naming ``transform`` and ``where`` (a layer or module name) when ``after`` differs from
    ``before`` beyond float noise of ``dtype`` (default: the first output tensor's); returns the relative error."""
    ref = float_tensors(before)
    dtype = dtype or (ref[0].dtype if ref else torch.float32)
    err = relative_error(before, after)
    limit = tolerance(dtype, ref[0].device if ref else None)
    if not err <= limit:
        raise EquivalenceError(
            f"{transform} changed what {where} computes (quantizers off): relative error {err:.3g} on the same data, "
            f"more than float noise of {dtype}{' (TF32 allowed)' if limit == 8 * _TF32_EPS else ''} allows ({limit:.1g}); the model was left as it was. This is a bug or "
            f"an architecture the transform does not know (e.g. a norm of another form): exclude the layer or turn "
            f"{transform} off, and report it"
        )
    return err


@contextlib.contextmanager
def restored_on_error(module: nn.Module) -> Iterator[None]:
    """Around an in-place transform of ``module``'s parameters and buffers: if the body raises, every one of them
    gets back the values it had (same tensor objects, so optimizers and ties stay valid). Keys the body added or
    removed are not tracked: transforms that change the module tree keep a copy of their own. The copies are kept in
    CPU memory, so a model on an accelerator does not hold a second copy of the layers processed so far there."""
    saved = {name: t.detach().to("cpu", copy=True) for name, t in _tensors(module)}
    try:
        yield
    except BaseException:
        current = dict(_tensors(module))
        with torch.no_grad():
            for name, value in saved.items():
                tensor = current.get(name)
                if tensor is not None and tensor.shape == value.shape:
                    tensor.copy_(value)
        raise


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=True)
    yield from ((n, b) for n, b in module.named_buffers(remove_duplicate=True) if b is not None)
