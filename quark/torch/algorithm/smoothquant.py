"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights with a per-channel scale
``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)``; ``X / s`` is folded into the previous op and ``W * s`` into the
linears, so the float model computes the same function and the activations are easier to quantize.

That it does is checked per decoder layer (``quark.torch.quantization.equivalence``): the layer's output on its
calibration inputs after the folds must equal the one before to float noise, else EquivalenceError names the layer."""

from __future__ import annotations

import torch
from torch import nn

from quark.torch.algorithm.capture import LayerInputs, check_layer_kept, collect_inputs, run_layer
from quark.torch.algorithm.fused_rows import producer_rows, row_scales, tie_scales
from quark.torch.algorithm.structure import norm_offset, scaling_groups
from quark.torch.quantization.config.config import SmoothQuantConfig
from quark.torch.quantization.hf import is_linear, linear_weight
from quark.torch.quantization.nn.modules.linear_parts import named_modules_with_parts


@torch.no_grad()
def fold_scales(
    prev: nn.Module, layers: list[nn.Module], scales: torch.Tensor, where: str, rows: torch.Tensor | None = None
) -> None:
    """Divide ``prev``'s output channels by ``scales`` and multiply the linears' input channels by them (weights
    seen as [out, in] whatever their storage). A norm computing ``normalised(x) * (offset + w)`` (offset 1: Gemma)
    gets ``w = (offset + w) / s - offset``; a norm of any other form is refused by name.

    ``rows`` (``fused_rows.producer_rows``): the output row of a fused ``prev`` each input channel reads; only those
    rows are divided, each by the scale of its channels tied to one (``fused_rows.tie_scales``: with grouped-query
    attention several channels read one row), and the channels are multiplied by the tied scales."""
    channel_scales = tie_scales(scales, rows)
    if rows is not None:  # what each output row of prev is divided by (1: the rows that feed no channel)
        scales = row_scales(scales, rows, _output_rows(prev, where))
    if is_linear(prev):
        linear_weight(prev).div_(scales.reshape(-1, 1).to(prev.weight.dtype))
    elif isinstance(getattr(prev, "weight", None), torch.Tensor) and prev.weight.ndim == 1:  # LayerNorm, RMSNorm
        offset = norm_offset(prev)
        if offset is None:
            raise ValueError(
                f"{where}: cannot fold a scale into {type(prev).__name__}: its output is neither normalised(x) * w "
                "nor normalised(x) * (1 + w) of its weight (quark.torch.algorithm.structure.norm_offset)"
            )
        if offset:  # in float32 at least: (1 + w) / s - 1 is a difference of numbers near 1
            dtype = torch.promote_types(prev.weight.dtype, torch.float32)
            prev.weight.copy_(((offset + prev.weight.to(dtype)) / scales.to(dtype) - offset).to(prev.weight.dtype))
        else:
            prev.weight.div_(scales.to(prev.weight.dtype))
    else:
        raise ValueError(
            f"{where}: cannot fold a scale into {type(prev).__name__} (needs a Linear or a norm with a weight)"
        )
    bias = getattr(prev, "bias", None)
    if isinstance(bias, torch.Tensor):
        bias.div_(scales.to(bias.dtype))
    for layer in layers:
        linear_weight(layer).mul_(channel_scales.reshape(1, -1).to(layer.weight.dtype))


def _output_rows(prev: nn.Module, where: str) -> int:
    """How many output channels ``prev`` (a Linear or a norm) has."""
    weight = linear_weight(prev) if is_linear(prev) else getattr(prev, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"{where}: cannot fold a scale into {type(prev).__name__} (needs a Linear or a norm with a weight)"
        )
    return weight.shape[0]


@torch.no_grad()
def smooth_layer(
    layer: nn.Module, inputs: LayerInputs, config: SmoothQuantConfig, where: str = "the decoder layer"
) -> dict[str, torch.Tensor]:
    """Smooth every scaling group of one decoder layer (named ``where`` in errors); returns the scales by ``prev_op``
    name. EquivalenceError when the folded layer no longer computes what it did (the caller restores it)."""
    modules = dict(named_modules_with_parts(layer))
    groups = scaling_groups(layer, config.scaling_layers)
    absmax: dict[str, torch.Tensor] = {}

    def record(name: str, module: nn.Module, x: torch.Tensor) -> None:
        current = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
        absmax[name] = current if name not in absmax else torch.maximum(absmax[name], current)

    with collect_inputs({g.inp: modules[g.inp] for g in groups}, record):
        reference = run_layer(layer, inputs)  # the float function does not change, so one pass serves every group
    scales = {}
    for g in groups:
        if g.inp not in absmax:
            continue  # the group's input never ran (an expert no calibration token reached)
        linears = [modules[n] for n in g.layers]
        w_max = torch.stack([linear_weight(m).detach().abs().amax(dim=0).float() for m in linears]).amax(dim=0)
        x_max = absmax[g.inp]
        s = (x_max.pow(config.alpha) / w_max.clamp(min=1e-8).pow(1 - config.alpha)).clamp(min=config.scale_clamp_min)
        rows = producer_rows(g.rows, modules, g.prev_op, g.layers)
        s = tie_scales(s, rows)
        fold_scales(modules[g.prev_op], linears, s, f"SmoothQuant {g.prev_op} -> {g.layers}", rows=rows)
        scales[g.prev_op] = s
    if scales:
        check_layer_kept("SmoothQuant", where, layer, inputs, reference)
    return scales
