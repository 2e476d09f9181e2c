"""Cross-layer equalization and high-bias absorption (Nagel et al. 2019, "Data-Free Quantization Through
Weight Equalization and Bias Correction", sections 4.1 and 4.2), as in-place functions on float layers.

A pair (first, second) is two Conv1d/2d/3d or two Linear layers where first's output channel i feeds second's
input channel i through ReLU (or nothing). Grouped and depthwise convolutions are supported on either side.
"""

from __future__ import annotations

import torch
from torch import nn

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_S_MIN, _S_MAX = 1e-8, 1e8


def _check_pair(first: nn.Module, second: nn.Module) -> None:
    """Raise ValueError unless both layers are convs or both are Linear, with matching channel counts."""
    both_conv = isinstance(first, _CONV) and isinstance(second, _CONV)
    both_linear = isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    if not (both_conv or both_linear):
        raise ValueError(
            f"cross-layer equalization needs two convs or two Linear layers, got "
            f"{type(first).__name__} -> {type(second).__name__}"
        )
    c_out, c_in = first.weight.shape[0], _in_channels(second)
    if c_out != c_in:
        raise ValueError(f"{type(first).__name__} has {c_out} output channels, {type(second).__name__} reads {c_in}")


def _groups(layer: nn.Module) -> int:
    """Number of groups of a conv (1 for Linear)."""
    return int(getattr(layer, "groups", 1))


def _in_channels(layer: nn.Module) -> int:
    """Input channels of a conv or Linear, counting all groups."""
    return layer.weight.shape[1] * _groups(layer)


def _compute_dtype(w: torch.Tensor) -> torch.dtype:
    """At least float32, so that ranges and scales of half-precision weights are computed accurately."""
    return torch.promote_types(w.dtype, torch.float32)


def _grouped_view(layer: nn.Module) -> torch.Tensor:
    """Second's weight as [groups, out/groups, in/groups, kernel]: input channel i is [i // (in/g), :, i % (in/g)]."""
    w = layer.weight.data
    g = _groups(layer)
    return w.to(_compute_dtype(w)).reshape(g, w.shape[0] // g, w.shape[1], -1)


def _out_ranges(layer: nn.Module) -> torch.Tensor:
    """Max |W[i, ...]| per output channel i (row i, also for grouped convs)."""
    w = layer.weight.data
    return w.to(_compute_dtype(w)).reshape(w.shape[0], -1).abs().amax(1)


def _in_ranges(layer: nn.Module) -> torch.Tensor:
    """Max |W[:, i, ...]| per input channel i, taken over the output rows of i's group only."""
    return _grouped_view(layer).abs().amax(dim=(1, 3)).reshape(-1)


def _scale_out_channels(layer: nn.Module, factor: torch.Tensor) -> None:
    """Multiply output channel i of the weight (and bias) by factor[i], in place."""
    w = layer.weight.data
    shape = (-1,) + (1,) * (w.dim() - 1)
    w.copy_(w.to(factor.dtype) * factor.view(shape))
    if layer.bias is not None:
        layer.bias.data.copy_(layer.bias.data.to(factor.dtype) * factor)


def _scale_in_channels(layer: nn.Module, factor: torch.Tensor) -> None:
    """Multiply input channel i of the weight by factor[i], in place, respecting groups."""
    w = layer.weight.data
    g = _groups(layer)
    view = _grouped_view(layer) * factor.view(g, 1, -1, 1)
    w.copy_(view.reshape(w.shape))


def equalize_pair(
    first: nn.Module, second: nn.Module, low: torch.Tensor | None = None, high: torch.Tensor | None = None
) -> torch.Tensor:
    """Rescale first's output channel i by 1/s_i and second's input channel i by s_i, with s_i = sqrt(r1_i / r2_i),
    so both get range sqrt(r1_i * r2_i); the composition is unchanged through ReLU. ``low`` / ``high``: per-channel
    bounds on s (the caller's constraints, e.g. activation ranges that must not grow). Returns s ([C])."""
    _check_pair(first, second)
    with torch.no_grad():
        r1, r2 = _out_ranges(first), _in_ranges(second)
        s = (1.0 / r2) * torch.sqrt(r1 * r2)  # the paper's s_i = sqrt(r1_i * r2_i) / r2_i
        s = torch.where((r1 > 0) & (r2 > 0), s, torch.ones_like(s))
        if low is not None:
            s = torch.maximum(s, low.to(s))
        if high is not None:
            s = torch.minimum(s, high.to(s))
        s = s.clamp(_S_MIN, _S_MAX)
        _scale_out_channels(first, 1.0 / s)
        _scale_in_channels(second, s)
    return s


Bounds = tuple[torch.Tensor | None, torch.Tensor | None]


def equalize(
    pairs: list[tuple[nn.Module, nn.Module]],
    iterations: int = 1,
    threshold: float | None = None,
    bounds: list[Bounds] | None = None,
) -> tuple[int, list[torch.Tensor]]:
    """Equalize all pairs in order, up to `iterations` times (chains converge over passes); stop early once the
    largest |log s| of a pass is below `threshold`. ``bounds``: per pair, (low, high) on its cumulative scale (None:
    unbounded). Returns (passes run, cumulative scale per pair)."""
    scales = [torch.ones(f.weight.shape[0], dtype=_compute_dtype(f.weight), device=f.weight.device) for f, _ in pairs]
    limits = bounds or [(None, None)] * len(pairs)
    run = 0
    for _ in range(iterations):
        run += 1
        worst = 0.0
        for k, ((first, second), (low, high)) in enumerate(zip(pairs, limits, strict=True)):
            step = equalize_pair(
                first,
                second,
                None if low is None else low.to(scales[k]) / scales[k],
                None if high is None else high.to(scales[k]) / scales[k],
            )
            scales[k] = scales[k] * step
            worst = max(worst, float(step.log().abs().max()) if step.numel() else 0.0)
        if threshold is not None and worst < threshold:
            break
    return run, scales


def absorb_high_bias(
    first: nn.Module, second: nn.Module, gamma: torch.Tensor, beta: torch.Tensor, n_std: float = 3.0
) -> torch.Tensor:
    """Move c_i = max(0, beta_i - n_std*|gamma_i|) from first's bias into second's bias, for first -> ReLU -> second.

    Exact wherever first's pre-activation of channel i is >= c_i (~99.9% of values for BN-Gaussian outputs at
    n_std=3), and, for convs with zero padding, away from second's padded border. Returns c ([C]).
    """
    _check_pair(first, second)
    if first.bias is None:
        raise ValueError(f"absorb_high_bias needs a bias on first ({type(first).__name__}); fold BatchNorm first")
    with torch.no_grad():
        dt = _compute_dtype(first.weight)
        c = (beta.to(dt) - n_std * gamma.to(dt).abs()).clamp(min=0)
        first.bias.data.copy_(first.bias.data.to(dt) - c)
        g = _groups(second)
        delta = (_grouped_view(second) * c.view(g, 1, -1, 1)).sum(dim=(2, 3)).reshape(-1)
        if second.bias is None:
            w = second.weight
            second.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device))
        second.bias.data.copy_(second.bias.data.to(delta.dtype) + delta)
    return c
