"""Graph passes on the float function before observation: BatchNorm folding and cross-layer equalization."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx, nn

from quark.torch.quantization.config.config import CLEConfig, Config
from quark.torch.quantization.graph.cle import absorb_high_bias, equalize
from quark.torch.quantization.graph.modules import ChannelClamp, QuantActivation, _QuantConvBnNd, fold_conv_bn
from quark.torch.quantization.graph.rules import ACTIVATIONS, is_relu, is_relu6
from quark.torch.quantization.nn.modules.quant_modules import QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear

__all__ = ["fold_batch_norms", "find_cle_pairs", "equalize_graph", "CLEPair", "fold_and_equalize", "is_folded_state"]

logger = logging.getLogger(__name__)
_EQUALIZABLE = (QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def fold_batch_norms(model: nn.Module) -> int:
    """Fold every conv + BatchNorm unit into a plain quantized conv (new folded Parameters; the quantizers and their
    state kept) and drop the BatchNorm modules nothing uses any more. Returns how many were folded."""
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, _QuantConvBnNd)]
    for name, unit in units:
        _set(model, name, fold_conv_bn(unit))
    if units:
        for gm in [m for m in model.modules() if isinstance(m, fx.GraphModule)]:
            gm.delete_all_unused_submodules()
    return len(units)


def fold_and_equalize(model: nn.Module, config: Config) -> None:
    """The PTQ passes on the float function, before any statistic: BatchNorm folding, then CLE when the Config
    asks for it, on every captured graph inside ``model`` (the model itself or, in a LightningModule, its children)."""
    fold_batch_norms(model)
    for cle in config.pre_quant_opt_configs:
        if isinstance(cle, CLEConfig):
            for gm in [m for m in model.modules() if isinstance(m, fx.GraphModule)]:
                equalize_graph(gm, cle)


def is_folded_state(model: nn.Module, state_dict: dict[str, object], prefix: str = "") -> bool:
    """Whether ``state_dict`` was saved after BatchNorm folding (PTQ) while ``model`` still has conv + BatchNorm
    units: it holds none of their BatchNorms' statistics."""
    names = {id(m): n for n, m in model.named_modules()}
    units = [m for m in model.modules() if isinstance(m, _QuantConvBnNd)]
    bns = [names.get(id(u.bn)) for u in units]
    return bool(units) and all(n is not None and f"{prefix}{n}.running_mean" not in state_dict for n in bns)


@dataclass
class CLEPair:
    """Two layers CLE equalizes: ``first``'s output channels feed ``second``'s input channels through ``act``."""

    first: str
    second: str
    act: fx.Node | None


def _quantizer_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), QuantActivation)


def find_cle_pairs(gm: fx.GraphModule) -> list[CLEPair]:
    """conv/linear -> [ReLU | ReLU6] -> [activation quantizer] -> conv/linear chains where each tensor in between
    has that single consumer (anything else reading it would see rescaled channels)."""
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), _EQUALIZABLE):
            continue
        first = gm.get_submodule(str(node.target))
        cur, act = node, None
        while True:
            users = list(cur.users)
            if len(users) != 1:
                break
            user = users[0]
            if user.op == "call_function" and user.target in ACTIVATIONS and act is None and (is_relu(user) or is_relu6(user)):
                cur = act = user
            elif _quantizer_node(gm, user):
                cur = user
            elif user.op == "call_module" and user.args[:1] == (cur,):
                second = gm.get_submodule(str(user.target))
                same_kind = isinstance(first, QuantLinear) == isinstance(second, QuantLinear)
                if isinstance(second, _EQUALIZABLE) and same_kind and second is not first:
                    pairs.append(CLEPair(str(node.target), str(user.target), act))
                break
            else:
                break
    return pairs


def _own_parameters(layer: nn.Module) -> None:
    """Give ``layer`` its own copies of weight and bias before CLE rescales them: the captured graph shares its
    Parameters with the user's float model, which must stay as it was."""
    for name in ("weight", "bias"):
        p = getattr(layer, name, None)
        if isinstance(p, nn.Parameter):
            setattr(layer, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def equalize_graph(gm: fx.GraphModule, cle: CLEConfig) -> dict[str, float]:
    """CLE (and high-bias absorption) on the folded graph, in place; ReLU6 between a pair becomes a per-channel
    clamp at 6/s, so the float function is unchanged. Returns what was done (pairs, passes, absorbed bias)."""
    pairs = find_cle_pairs(gm)
    if not pairs:
        logger.info("CLE: no conv/linear -> ReLU -> conv/linear chain to equalize")
        return {"pairs": 0, "iterations": 0, "absorbed": 0.0}
    for pair in pairs:
        _own_parameters(gm.get_submodule(pair.first))
        _own_parameters(gm.get_submodule(pair.second))
    layers = [(gm.get_submodule(p.first), gm.get_submodule(p.second)) for p in pairs]
    passes, scales = equalize(layers, iterations=cle.iterations, threshold=cle.threshold)
    absorbed = 0.0
    for pair, (first, second), scale in zip(pairs, layers, scales, strict=True):
        if pair.act is not None and is_relu6(pair.act):
            _clamp_per_channel(gm, pair.act, 6.0 / scale)
        stats = getattr(first, "folded_bn", None)
        if cle.high_bias_absorption and stats is not None and pair.act is not None and is_relu(pair.act):
            gamma, beta, _ = stats
            c = absorb_high_bias(first, second, gamma.to(scale) / scale, beta.to(scale) / scale)
            absorbed += float(c.abs().sum())
    gm.recompile()
    logger.info("CLE: %d pair(s) equalized in %d pass(es)", len(pairs), passes)
    return {"pairs": len(pairs), "iterations": passes, "absorbed": absorbed}


def _clamp_per_channel(gm: fx.GraphModule, act: fx.Node, upper: torch.Tensor) -> None:
    name = f"_cle_clamp_{act.name}"
    gm.add_submodule(name, ChannelClamp(upper))
    with gm.graph.inserting_before(act):
        call = gm.graph.call_module(name, (act.args[0],))
    call.meta = dict(act.meta)
    act.replace_all_uses_with(call)
    gm.graph.erase_node(act)
