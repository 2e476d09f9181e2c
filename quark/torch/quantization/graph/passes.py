"""Graph passes on the float function before observation: BatchNorm folding and cross-layer equalization (CLE).

Both must keep what the graph computes: each runs the graph's captured example batch with quantizers off before
and after (``checks.checked``) and, on a difference beyond float noise, is undone and raises ``EquivalenceError``
naming the pass and the layer. CLE, in addition, is kept only where it does not make the quantized model worse:

- ReLU6 (and any clamp with an upper bound) between a pair: the pair is left alone. Nagel et al. (2019) replace
  ReLU6 by ReLU before equalizing, which changes the function; keeping it exact needs a per-channel clamp at 6/s_i,
  which stretches the per-tensor activation range (up to 89x on EfficientNet-Lite0) and no integer runtime fuses.
- Zero padding between the pair (``F.pad`` / ``constant_pad_nd`` with value 0, reflect / replicate / circular
  pads, max pooling: all commute with a positive per-channel scale) is looked through, like the conv's own padding.
- Only pairs whose first layer's weight quantization shares qparams across output channels (per tensor) are
  rescaled. Per-channel weights gain nothing on the first layer (its qparams scale with the channel), and shrinking
  the second layer's input channels grows the activation values its weight noise multiplies: such pairs are left
  alone (measured worse on a depthwise test network otherwise).
- The activation between the pair is quantized per tensor: no channel's range may exceed the largest channel range
  it had (s_i >= a_i / max_j a_j, a_i measured on the example batch, else bounded from the weights: the L1 norm of
  the channel's weight row plus its bias, for inputs in [-1, 1]).
- Finally, on the example batch, the quantized model's output error with CLE (weights and activations calibrated on
  that batch) is compared with the error without it; CLE is undone when it is larger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from quark.torch.quantization.algo_registry import AlgorithmContext, register_algorithm, run_stage
from quark.torch.quantization.config.config import CLEConfig, Config
from quark.torch.quantization.config.type import QSchemeType
from quark.torch.quantization.graph.checks import Example, checked, example_for, float_run, quantized_error
from quark.torch.quantization.graph.cle import Bounds, absorb_high_bias, equalize
from quark.torch.quantization.graph.modules import QuantActivation, QuantConvBnNd, fold_conv_bn
from quark.torch.quantization.graph.rules import ACTIVATIONS, is_relu, is_relu6
from quark.torch.quantization.nn.modules.quant_modules import QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear

__all__ = ["fold_batch_norms", "find_cle_pairs", "equalize_graph", "CLEPair", "fold_and_equalize", "is_folded_state"]

logger = logging.getLogger(__name__)
_EQUALIZABLE = (QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear)
_CLE = "cross-layer equalization (CLE)"
aten = torch.ops.aten
_PADS = {aten.constant_pad_nd.default, aten.pad.default}
_MAX_POOLS = {aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default}
_EQUIVARIANT_PAD_MODES = ("reflect", "replicate", "circular")


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def _graphs(model: nn.Module) -> list[fx.GraphModule]:
    """The captured graphs in ``model`` (itself, or its children in a LightningModule), not the graphs nested in
    them (the bodies of higher-order ops)."""
    graphs = [m for m in model.modules() if isinstance(m, fx.GraphModule)]
    nested = {id(sub) for gm in graphs for sub in gm.modules() if sub is not gm}
    return [gm for gm in graphs if id(gm) not in nested]


def fold_batch_norms(model: nn.Module, check: bool = True) -> int:
    """Fold every conv + BatchNorm unit into a plain quantized conv (new folded Parameters; the quantizers and their
    state kept) and drop the BatchNorm modules nothing uses any more. ``check``: compare the float function before
    and after on the captured example (EquivalenceError naming the layer, units put back). Returns how many."""
    count = 0
    for gm in _graphs(model):
        units = [(name, m) for name, m in gm.named_modules() if isinstance(m, QuantConvBnNd)]
        if not units:
            continue

        def apply(units: list[tuple[str, QuantConvBnNd]] = units, gm: fx.GraphModule = gm) -> None:
            for name, unit in units:
                _set(gm, name, fold_conv_bn(unit))

        def undo(units: list[tuple[str, QuantConvBnNd]] = units, gm: fx.GraphModule = gm) -> None:
            for name, unit in units:
                _set(gm, name, unit)

        checked("BatchNorm folding", gm, apply, undo) if check else apply()
        gm.delete_all_unused_submodules()
        count += len(units)
    return count


def fold_and_equalize(model: nn.Module, config: Config, structure_only: bool = False) -> None:
    """The PTQ passes on the float function, before any statistic: BatchNorm folding, then CLE when the Config
    asks for it, on every captured graph inside ``model`` (the model itself or, in a LightningModule, its children).
    ``structure_only`` (loading a checkpoint whose values replace the Parameters): only the folding, unchecked (CLE
    changes values, not the module tree)."""
    fold_batch_norms(model, check=not structure_only)
    if structure_only:
        return
    run_stage("graph", model, config.pre_quant_opt_configs, None)


def _equalize(model: nn.Module, cle: CLEConfig, context: AlgorithmContext | None = None) -> None:
    """CLE's handler: equalize every captured graph inside ``model``."""
    for gm in _graphs(model):
        equalize_graph(gm, cle)


def is_folded_state(model: nn.Module, state_dict: dict[str, object], prefix: str = "") -> bool:
    """Whether ``state_dict`` was saved after BatchNorm folding (PTQ) while ``model`` still has conv + BatchNorm
    units: it holds none of their BatchNorms' statistics."""
    names = {id(m): n for n, m in model.named_modules()}
    units = [m for m in model.modules() if isinstance(m, QuantConvBnNd)]
    bns = [names.get(id(u.bn)) for u in units]
    return bool(units) and all(n is not None and f"{prefix}{n}.running_mean" not in state_dict for n in bns)


@dataclass
class CLEPair:
    """Two layers whose channels CLE may rescale: ``first``'s output channel i feeds ``second``'s input channel i
    through ``act`` and ``between`` (quantizers, zero pads, max pooling; their node names). ``bounded``: the
    activation is ReLU6 / a clamp with an upper bound (the pair is left alone). ``padded``: a pad is between.
    ``quantized``: an activation quantizer is between (its range bounds the scales)."""

    first: str
    second: str
    act: fx.Node | None
    between: list[str] = field(default_factory=list)
    bounded: bool = False
    padded: bool = False
    quantized: bool = False


def _quantizer_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), QuantActivation)


def _equalizable(gm: fx.GraphModule, node: fx.Node) -> nn.Module | None:
    """The conv / linear layer ``node`` calls, if CLE can rescale it."""
    if node.op != "call_module":
        return None
    layer = gm.get_submodule(str(node.target))
    return layer if isinstance(layer, _EQUALIZABLE) else None


def _zero_pad(node: fx.Node, channel_dim_padded: bool) -> bool:
    """A pad that commutes with a positive per-channel scale: zeros (or values copied within each channel), and
    not along the channel dimension."""
    if node.target is aten.constant_pad_nd.default:
        ok = float(node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0.0)) == 0.0
    else:
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
        ok = mode in _EQUIVARIANT_PAD_MODES or (mode == "constant" and (value is None or float(value) == 0.0))
    return ok and not channel_dim_padded


def _pads_channels(node: fx.Node, linear: bool) -> bool:
    """Whether a pad reaches the channel dimension (dim 1 of a conv's input, the last dim of a linear's)."""
    if linear:
        return True
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    ndim = val.ndim if isinstance(val, torch.Tensor) else 4
    return len(node.args[1]) // 2 > ndim - 2  # type: ignore[arg-type]


def _step(gm: fx.GraphModule, cur: fx.Node, user: fx.Node, act: fx.Node | None, linear: bool) -> str | None:
    """What ``user`` (the only reader of ``cur``) is on the way from a first layer to a second: "act", "bounded"
    (ReLU6-like), "pad", "through" (a quantizer, max pooling), or None (the chain ends)."""
    if _quantizer_node(gm, user):
        return "through"
    if user.op != "call_function" or not user.args or user.args[0] is not cur:
        return None
    if user.target in ACTIVATIONS and act is None:
        return "act" if is_relu(user) else "bounded" if is_relu6(user) else None
    if user.target in _PADS:
        return "pad" if _zero_pad(user, _pads_channels(user, linear)) else None
    return "through" if user.target in _MAX_POOLS and not linear else None


def find_cle_pairs(gm: fx.GraphModule) -> list[CLEPair]:
    """conv/linear -> [ReLU | ReLU6] -> [quantizers, zero pads, max pooling] -> conv/linear chains where each tensor
    in between has that single consumer (anything else reading it would see rescaled channels)."""
    pairs = []
    for node in gm.graph.nodes:
        first = _equalizable(gm, node)
        if first is None:
            continue
        linear = isinstance(first, QuantLinear)
        cur, act, between, bounded, padded = node, None, [], False, False
        while len(cur.users) == 1:
            user = next(iter(cur.users))
            kind = _step(gm, cur, user, act, linear)
            if kind is None:
                second = _equalizable(gm, user)
                if (
                    second is not None
                    and user.args[:1] == (cur,)
                    and isinstance(second, QuantLinear) == linear
                    and second is not first
                ):
                    quantized = any(_quantizer_node(gm, n) for n in between)
                    pairs.append(
                        CLEPair(
                            str(node.target),
                            str(user.target),
                            act,
                            [n.name for n in between],
                            bounded,
                            padded,
                            quantized,
                        )
                    )
                break
            if kind in ("act", "bounded"):
                act, bounded = user, kind == "bounded"
            padded |= kind == "pad"
            between.append(user)
            cur = user
    return pairs


def _own_parameters(layer: nn.Module) -> None:
    """Give ``layer`` its own copies of weight and bias before CLE rescales them: the captured graph shares its
    Parameters with the user's float model, which must stay as it was."""
    for name in ("weight", "bias"):
        p = getattr(layer, name, None)
        if isinstance(p, nn.Parameter):
            setattr(layer, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


# ----------------------------------------------------------------------------------------------- what CLE may scale
def _weight_qscheme(layer: nn.Module) -> tuple[QSchemeType | None, int]:
    """(qscheme, ch_axis in 0..ndim-1) of the layer's weight quantizer; (None, 0) when the weight stays float."""
    spec = getattr(getattr(layer, "_weight_quantizer", None), "spec", None)
    if spec is None:
        return None, 0
    return spec.qscheme, (spec.ch_axis or 0) % layer.weight.ndim


def _first_gains(layer: nn.Module) -> bool:
    """Whether rescaling the first layer's output channels can change its weight quantization: some qparams are
    shared by several output channels (per tensor, per channel along another axis, groups along the outputs)."""
    qscheme, axis = _weight_qscheme(layer)
    if qscheme is None:
        return False
    if qscheme == QSchemeType.per_channel:
        return axis != 0
    if qscheme == QSchemeType.per_group:
        return axis == 0
    return True


def _channel_dim(layer: nn.Module) -> int:
    return -1 if isinstance(layer, QuantLinear) else 1


def _channel_ranges(y: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each channel of ``y`` along ``dim``."""
    flat = y.detach().movedim(dim, 0).reshape(y.shape[dim], -1).double()
    return flat.amin(1), flat.amax(1)


def _weight_ranges(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Without data: each output channel's range for inputs in [-1, 1] (L1 norm of its row, plus its bias)."""
    w = layer.weight.detach().double()
    reach = w.reshape(w.shape[0], -1).abs().sum(1)
    b = layer.bias.detach().double() if layer.bias is not None else torch.zeros_like(reach)
    return b - reach, b + reach


def _bounds(pair: CLEPair, first: nn.Module, ranges: tuple[torch.Tensor, torch.Tensor] | None) -> Bounds:
    """(low, high) of the cumulative scale of a pair: a quantized activation between keeps its per-tensor range
    (s_i >= a_i / max a); no upper bound."""
    if not pair.quantized:
        return None, None
    low_y, high_y = ranges if ranges is not None else _weight_ranges(first)
    if pair.act is not None:  # ReLU
        low_y, high_y = low_y.clamp(min=0), high_y.clamp(min=0)
    a = torch.maximum(low_y.abs(), high_y.abs())
    top = float(a.max()) if a.numel() else 0.0
    return (a / top if top > 0 else None), None


# ----------------------------------------------------------------------------------------------- CLE
@dataclass
class _Plan:
    """The pairs CLE rescales, the statistics it used and how to put the layers back."""

    pairs: list[CLEPair]
    layers: list[tuple[nn.Module, nn.Module]]
    bounds: list[Bounds]
    pre_min: list[torch.Tensor | None]  # first's smallest pre-activation per channel on the example (high-bias)
    saved: list[tuple[nn.Module, str, nn.Parameter | None]]

    def undo(self) -> None:
        for layer, name, param in self.saved:
            setattr(layer, name, param)


def _measure(
    gm: fx.GraphModule, pairs: list[CLEPair], example: Example | None
) -> tuple[object, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The float output on the example and each first layer's per-channel output (min, max) on it."""
    if example is None:
        return None, {}
    ranges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str, dim: int) -> Callable[..., None]:
        return lambda module, args, out: ranges.__setitem__(name, _channel_ranges(out, dim))

    hooks = {gm.get_submodule(p.first): hook(p.first, _channel_dim(gm.get_submodule(p.first))) for p in pairs}
    return float_run(gm, example, hooks), ranges


def _plan(gm: fx.GraphModule, pairs: list[CLEPair], ranges: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> _Plan:
    """The pairs worth rescaling (the first layer's weight quantization can gain) with their bounds."""
    plan = _Plan([], [], [], [], [])
    for pair in pairs:
        first, second = gm.get_submodule(pair.first), gm.get_submodule(pair.second)
        if not _first_gains(first):
            continue
        plan.pairs.append(pair)
        plan.layers.append((first, second))
        plan.bounds.append(_bounds(pair, first, ranges.get(pair.first)))
        plan.pre_min.append(ranges[pair.first][0] if pair.first in ranges else None)
    seen: set[int] = set()
    for layer in (m for f_s in plan.layers for m in f_s):
        if id(layer) not in seen:
            seen.add(id(layer))
            plan.saved += [(layer, "weight", layer.weight), (layer, "bias", layer.bias)]
    return plan


def _absorbable(pair: CLEPair, first: nn.Module, second: nn.Module) -> bool:
    """High-bias absorption is exact only through ReLU, into a second layer with a bias and no zero padding (a
    padded border would not get the absorbed constant), from a first layer with folded BatchNorm statistics."""
    padding = getattr(second, "padding", 0)
    unpadded = not pair.padded and (padding == 0 or (isinstance(padding, tuple) and not any(padding)))
    return (
        unpadded and pair.act is not None and second.bias is not None and getattr(first, "folded_bn", None) is not None
    )


def _apply(plan: _Plan, cle: CLEConfig) -> tuple[int, float]:
    """Rescale the planned pairs (and absorb high biases); returns (passes, absorbed bias)."""
    for first, second in plan.layers:
        _own_parameters(first)
        _own_parameters(second)
    passes, scales = equalize(plan.layers, iterations=cle.iterations, threshold=cle.threshold, bounds=plan.bounds)
    absorbed = 0.0
    for pair, (first, second), scale, pre_min in zip(plan.pairs, plan.layers, scales, plan.pre_min, strict=True):
        if cle.high_bias_absorption and _absorbable(pair, first, second):
            gamma, beta, _ = first.folded_bn
            gamma, beta = gamma.to(scale) / scale, beta.to(scale) / scale
            if pre_min is not None:  # never more than the example's smallest pre-activation: exact on it
                beta = torch.minimum(beta, pre_min.to(scale) / scale + 3 * gamma.abs())
            absorbed += float(absorb_high_bias(first, second, gamma, beta).abs().sum())
    return passes, absorbed


def _label(plan: _Plan) -> Callable[[fx.Node], str]:
    """Failure messages name the pair whose second layer's output changed."""
    seconds = {p.second: p for p in plan.pairs}

    def label(node: fx.Node) -> str:
        pair = seconds.get(str(node.target)) if node.op == "call_module" else None
        return (
            f"layer '{pair.second}' (pair '{pair.first}' -> '{pair.second}')"
            if pair
            else f"node '{node.name}' ({node.target})"
        )

    return label


def equalize_graph(gm: fx.GraphModule, cle: CLEConfig, check: bool = True) -> dict[str, float]:
    """CLE (and high-bias absorption) on the folded graph, in place, under the rules of this module's docstring.
    ``check``: compare the float function on the captured example and keep CLE only where the quantized error on it
    does not grow. Returns what was done (pairs found / across pads / skipped / equalized, passes, absorbed bias)."""
    pairs = find_cle_pairs(gm)
    info = {
        "pairs": len(pairs),
        "padded": sum(p.padded for p in pairs),
        "bounded": sum(p.bounded for p in pairs),
        "equalized": 0,
        "iterations": 0,
        "absorbed": 0.0,
        "kept": 1,
    }
    if info["bounded"]:
        logger.info("CLE: %d pair(s) with ReLU6 between left alone (not scalable exactly)", info["bounded"])
    example = example_for(gm) if check else None
    reference, ranges = _measure(gm, [p for p in pairs if not p.bounded], example)
    plan = _plan(gm, [p for p in pairs if not p.bounded], ranges)
    if not plan.pairs:
        why = "none whose first layer has per-tensor weights" if len(pairs) > info["bounded"] else "no ReLU pair"
        logger.info("CLE: %d pair(s) found, %s: nothing to equalize", len(pairs), why)
        return info
    rescaled = {
        n for p in plan.pairs for n in [gm.graph.find_nodes(op="call_module", target=p.first)[0].name, *p.between]
    }
    before = quantized_error(gm, example, reference) if example is not None else None
    passes, absorbed = (
        checked(_CLE, gm, lambda: _apply(plan, cle), plan.undo, rescaled, _label(plan), reference)
        if check
        else _apply(plan, cle)
    )
    info.update(equalized=len(plan.pairs), iterations=passes, absorbed=absorbed)
    if before is not None:
        after = quantized_error(gm, example, reference)  # type: ignore[arg-type]
        if after > before:
            plan.undo()
            logger.info(
                "CLE: undone, it made the quantized output error on the example batch worse (%.4g -> %.4g)",
                before,
                after,
            )
            info.update(equalized=0, iterations=0, absorbed=0.0, kept=0)
            return info
    logger.info("CLE: %d of %d pair(s) equalized in %d pass(es)", len(plan.pairs), len(pairs), passes)
    return info


register_algorithm(CLEConfig, stage="graph", handler=_equalize)
