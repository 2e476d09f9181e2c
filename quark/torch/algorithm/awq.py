"""AWQ (Lin et al. 2023): protect the weights that meet large activations. Per scaling group a per-input-channel
scale ``s = mean|x|^ratio`` is searched on a grid (ratio 0, i.e. round-to-nearest, included, so the result is never
worse than RTN on the calibration data), folded into the previous op; then each weight's clipping range is searched
per output row and group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quark.torch.algorithm.capture import LayerInputs, capture_calls, collect_inputs, hidden_of, run_layer
from quark.torch.algorithm.gptq import observer_qparams
from quark.torch.algorithm.smoothquant import fold_scales
from quark.torch.algorithm.structure import ScalingGroup, scaling_groups
from quark.torch.quantization.config.config import AWQConfig, QuantizationSpec
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.formats import fake_quantize
from quark.torch.quantization.hf import is_linear, linear_weight

N_GRID = 20
MAX_SHRINK = 0.5
CLIP_TOKENS = 512
#: layers producing attention queries or keys (alone or fused): attention logits are sensitive to clipping them
_NO_CLIP = ("q_proj", "k_proj", "query", "key", "Wqkv", "qkv_proj", "c_attn", "query_key_value", "q_lin", "k_lin")


def rtn(weight: torch.Tensor, spec: QuantizationSpec | None) -> torch.Tensor:
    """Round-to-nearest fake quantization of ``weight`` with qparams from the spec's own observer."""
    if spec is None:
        return weight
    scale = zero_point = None
    if spec.observer_cls is not None and getattr(spec.observer_cls, "__name__", "") not in ("PlaceholderObserver",):
        scale, zero_point = observer_qparams(spec, weight)
    return fake_quantize(
        weight, spec.dtype, scale, zero_point, qscheme=spec.qscheme, axis=spec.ch_axis, group_size=spec.group_size,
        round_method=spec.round_method, mx_element_dtype=spec.mx_element_dtype, mx_scale_mode=spec.mx_scale_mode,
        block_size=spec.block_size,
    )  # fmt: skip


@torch.no_grad()
def awq_layer(
    layer: nn.Module, inputs: LayerInputs, config: AWQConfig, prefix: str, weight_spec_of: Callable[[str], QuantizationSpec | None]
) -> dict[str, float]:
    """Scale search and clipping for one decoder layer; returns the chosen ratio per scaling group."""
    modules = dict(layer.named_modules())
    ratios = {}
    for g in scaling_groups(layer, config.scaling_layers):
        specs = [weight_spec_of(f"{prefix}.{n}") for n in g.layers]
        if all(s is None for s in specs):
            continue
        ratios[g.prev_op] = _search_scale(layer, inputs, g, modules, specs)
    for name, module in modules.items():
        spec = weight_spec_of(f"{prefix}.{name}")
        if is_linear(module) and spec is not None and not any(k in name for k in _NO_CLIP):
            _search_clip(layer, inputs, name, module, spec)
    return ratios


def _search_scale(
    layer: nn.Module, inputs: LayerInputs, group: ScalingGroup, modules: dict[str, nn.Module], specs: list[QuantizationSpec | None]
) -> float:
    linears = [modules[n] for n in group.layers]
    inspect = modules[group.module2inspect] if group.module2inspect else None
    rows: list[torch.Tensor] = []
    with collect_inputs({group.inp: modules[group.inp]}, lambda n, m, x: rows.append(x.detach())):
        if inspect is not None:
            with capture_calls(inspect) as calls:
                run_layer(layer, inputs)
        else:
            run_layer(layer, inputs)
            calls = []

    def output() -> list[torch.Tensor]:
        if inspect is not None:
            return [hidden_of(inspect(*a, **k)).float() for a, k in calls]
        return [torch.cat([m(x) for m in linears], dim=-1).float() for x in rows]

    reference = output()
    x_mean = torch.cat([x.reshape(-1, x.shape[-1]).abs().float() for x in rows]).mean(dim=0)
    originals = [linear_weight(m).detach().clone() for m in linears]
    best = (float("inf"), 0.0, torch.ones_like(x_mean))
    for i in range(N_GRID):
        ratio = i / N_GRID
        s = x_mean.pow(ratio).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for m, w, spec in zip(linears, originals, specs, strict=True):
            scaled = w * s.reshape(1, -1).to(w.dtype)
            linear_weight(m).copy_(rtn(scaled, spec) / s.reshape(1, -1).to(w.dtype))
        loss = sum(float(((o - r) ** 2).sum()) for o, r in zip(output(), reference, strict=True))
        if loss < best[0]:
            best = (loss, ratio, s)
    for m, w in zip(linears, originals, strict=True):
        linear_weight(m).copy_(w)
    fold_scales(modules[group.prev_op], linears, best[2], f"AWQ {group.prev_op} -> {group.layers}")
    return best[1]


def _search_clip(layer: nn.Module, inputs: LayerInputs, name: str, module: nn.Module, spec: QuantizationSpec) -> None:
    """Per output row and input group: the clipping range (1.0 .. 0.5 of the group's max) with the least output error."""
    if spec.qscheme not in (QSchemeType.per_channel, QSchemeType.per_group) or spec.dtype.name.startswith(("mx", "bfp")):
        return
    rows: list[torch.Tensor] = []
    with collect_inputs({name: module}, lambda n, m, x: rows.append(x.detach().reshape(-1, x.shape[-1]))):
        run_layer(layer, inputs)
    x = torch.cat(rows).float()
    x = x[torch.linspace(0, x.shape[0] - 1, min(CLIP_TOKENS, x.shape[0])).long()]
    w = linear_weight(module).detach().float()
    out_features, in_features = w.shape
    group = spec.group_size if spec.qscheme == QSchemeType.per_group and spec.group_size else in_features
    n_groups = in_features // group
    xg = x.reshape(x.shape[0], n_groups, group)
    max_val = w.abs().reshape(out_features, n_groups, group).amax(dim=-1, keepdim=True)
    best_err = torch.full((out_features, n_groups), float("inf"), device=w.device)
    best_max = max_val.clone()
    for i in range(int(MAX_SHRINK * N_GRID) + 1):
        cur = max_val * (1 - i / N_GRID)
        clipped = torch.maximum(torch.minimum(w.reshape(out_features, n_groups, group), cur), -cur).reshape_as(w)
        delta = (rtn(clipped, spec) - w).reshape(out_features, n_groups, group)
        err = torch.einsum("tgc,rgc->trg", xg, delta).pow(2).mean(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better.unsqueeze(-1), cur, best_max)
    clipped = torch.maximum(torch.minimum(w.reshape(out_features, n_groups, group), best_max), -best_max)
    linear_weight(module).copy_(clipped.reshape_as(w).to(module.weight.dtype))
