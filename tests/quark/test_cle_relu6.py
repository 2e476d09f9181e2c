"""Cross-layer equalization never makes a model worse (issue 33): on a small EfficientNet-Lite-style network
(depthwise convs, ReLU6, TF-"same" zero pads written with F.pad, BatchNorm with log-uniform gammas), W8A8 graph PTQ
with CLE is no worse than without it; pairs across zero pads are found; the float function is kept and activation
ranges are not stretched (the per-channel ReLU6 clamp of before); a broken CLE or BatchNorm fold raises
EquivalenceError naming the pass and the layer, and leaves the graph as it was."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import quark.torch.quantization.graph.cle as cle_module
import quark.torch.quantization.graph.passes as passes_module
from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import CLEConfig, Config
from quark.torch.quantization.equivalence import EquivalenceError
from quark.torch.quantization.graph import (
    QUANTIZERS,
    QuantConvBn2d,
    capture,
    equalize_graph,
    find_cle_pairs,
    fold_batch_norms,
)
from quark.torch.quantization.nn.modules import iter_quantizers

warnings.filterwarnings("ignore", message=".*LeafSpec.*")

SYM8 = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "scale_type": "float",
    "is_dynamic": False,
}
W8_CHANNEL = {**SYM8, "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}
WEIGHTS = {"per_tensor": SYM8, "per_channel": W8_CHANNEL}


def conv_bn(
    cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, groups: int = 1, act: type | None = nn.ReLU6
) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act is not None else []))


class LiteBlock(nn.Module):
    """EfficientNet-Lite inverted residual: [expand 1x1] -> zero pad (TF "same") -> depthwise 3x3 -> project 1x1."""

    def __init__(self, cin: int, cout: int, t: int, stride: int, act: type = nn.ReLU6) -> None:
        super().__init__()
        h = cin * t
        self.expand = conv_bn(cin, h, 1, act=act) if t != 1 else None
        self.pad = (1, 1, 1, 1) if stride == 1 else (0, 1, 0, 1)
        self.dw = conv_bn(h, h, 3, stride, groups=h, act=act)
        self.project = conv_bn(h, cout, 1, act=None)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.expand(x) if self.expand is not None else x
        y = self.project(self.dw(F.pad(y, self.pad)))
        return x + y if self.residual else y


class LiteNet(nn.Module):
    """Stem (conv with its own zero padding), four blocks (the last one with ReLU), 1x1 head, pooling, classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = conv_bn(3, 16, 3, stride=2, padding=1)
        self.blocks = nn.Sequential(
            LiteBlock(16, 8, 1, 1),
            LiteBlock(8, 12, 4, 2),
            LiteBlock(12, 12, 4, 1),
            LiteBlock(12, 16, 4, 2, act=nn.ReLU),
        )
        self.head = conv_bn(16, 32, 1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.blocks(self.stem(x))).mean((2, 3)))


#: (first, second) of every pair with a zero pad between: the stem into block 0's depthwise, each expand into its
#: depthwise (an independent list, written from the architecture above)
PADDED_PAIRS = {("stem.0", "blocks.0.dw.0")} | {(f"blocks.{i}.expand.0", f"blocks.{i}.dw.0") for i in (1, 2, 3)}


def lite_net(seed: int) -> tuple[nn.Module, torch.Tensor]:
    """LiteNet whose BatchNorms have gammas drawn log-uniform over two decades (the per-channel spread of trained
    depthwise networks) and running statistics of the data; eval mode."""
    torch.manual_seed(seed)
    model, x = LiteNet(), torch.randn(48, 3, 16, 16)
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data = 10 ** (torch.rand(m.num_features, generator=gen) * 2 - 1)
            m.bias.data = torch.randn(m.num_features, generator=gen) * 0.5
            m.momentum = None  # running statistics: the cumulative average of the batches below
    model.train()
    with torch.no_grad():
        for _ in range(4):
            model(x)
    return model.eval(), x


def config(weight: str, cle: bool) -> Config:
    extra = {"pre_quant_opt_config": [{"name": "cle", "iterations": 10}]} if cle else {}
    return Config.from_dict(
        {
            "global_quant_config": {"input_tensors": SYM8, "weight": WEIGHTS[weight]},
            "quant_mode": "fx_graph_mode",
            **extra,
        }
    )


def quantized(model: nn.Module, x: torch.Tensor, cfg: Config) -> fx.GraphModule:
    gm = capture(model, (x[:8],))
    return ModelQuantizer(cfg).quantize_model(gm, [x[:24], x[24:]])  # type: ignore[return-value]


def relative_mse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).pow(2).mean() / ref.pow(2).mean())


def activation_ranges(gm: fx.GraphModule) -> dict[str, float]:
    """max |value| each activation quantizer saw in calibration, by its holder's name."""
    holders = gm.get_submodule(QUANTIZERS)
    out = {}
    for name, holder in holders.named_children():
        q = holder._output_quantizer
        scale, _ = q.calculate_qparams()
        out[name] = float(scale.max())
    return out


def prepared_folded(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    gm = ModelQuantizer(config("per_tensor", cle=False)).prepare(capture(model, (x[:8],)))
    fold_batch_norms(gm)
    return gm


def float_output(gm: fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    flags = [(q, bool(q.fake_quant_enabled), bool(q.observer_enabled)) for _, q in iter_quantizers(gm)]
    for q, _, _ in flags:
        q.fake_quant_enabled.fill_(0)
        q.observer_enabled.fill_(0)
    try:
        with torch.no_grad():
            return gm(x)
    finally:
        for q, fq, obs in flags:
            q.fake_quant_enabled.fill_(int(fq))
            q.observer_enabled.fill_(int(obs))


def snapshot(gm: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in gm.state_dict().items()}


# ----------------------------------------------------------------------------------------------- never worse
@pytest.mark.parametrize("weight", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cle_is_no_worse_than_without(weight: str, seed: int) -> None:
    model, x = lite_net(seed)
    ref = model(x).detach()
    plain = relative_mse(quantized(model, x, config(weight, cle=False))(x), ref)
    with_cle = relative_mse(quantized(model, x, config(weight, cle=True))(x), ref)
    assert with_cle <= plain * 1.001, f"W8A8 ({weight} weights): CLE {with_cle:.4g} vs without {plain:.4g}"


def test_activation_ranges_are_not_stretched() -> None:
    """The activation quantizers' ranges with CLE are those without it (up to the data CLE's bounds were measured
    on): no per-channel ReLU6 clamp at 6/s that stretches them."""
    model, x = lite_net(0)
    plain = activation_ranges(quantized(model, x, config("per_tensor", cle=False)))
    with_cle = activation_ranges(quantized(model, x, config("per_tensor", cle=True)))
    assert plain.keys() == with_cle.keys()
    ratios = {k: with_cle[k] / plain[k] for k in plain if plain[k] > 0}
    worst = max(ratios, key=ratios.get)  # type: ignore[arg-type]
    assert ratios[worst] < 1.25, f"{worst}: range x{ratios[worst]:.3g}"


# ----------------------------------------------------------------------------------------------- pairs and function
def test_pairs_across_zero_pads_are_found() -> None:
    model, x = lite_net(0)
    pairs = {(p.first, p.second) for p in find_cle_pairs(prepared_folded(model, x))}
    assert PADDED_PAIRS <= pairs, f"missing: {sorted(PADDED_PAIRS - pairs)}"
    # and the pairs without a pad between: block 0's projection feeds block 1's expansion, the last one the head
    assert {("blocks.0.project.0", "blocks.1.expand.0"), ("blocks.3.project.0", "head.0")} <= pairs


def test_float_function_unchanged_and_relu6_pairs_left_alone() -> None:
    model, x = lite_net(0)
    gm = prepared_folded(model, x)
    before = float_output(gm, x)
    weights = snapshot(gm)
    info = equalize_graph(gm, CLEConfig(iterations=10))
    after = float_output(gm, x)
    assert float((after - before).norm() / before.norm()) < 1e-5
    assert float((after - model(x)).norm() / model(x).norm()) < 1e-5
    # the graph is the same graph: no node was added (a per-channel clamp would be one)
    assert not [n for n in gm.graph.nodes if "clamp" in n.name]
    # layers only in ReLU6 pairs (stem, the depthwise convs of blocks 0..2) keep their weights
    assert info["bounded"] >= 3 and info["padded"] == len(PADDED_PAIRS)
    for name in ("stem.0", "blocks.0.dw.0", "blocks.1.dw.0", "blocks.2.dw.0"):  # in ReLU6 pairs only
        assert torch.equal(gm.get_submodule(name).weight, weights[f"{name}.weight"]), name


# ----------------------------------------------------------------------------------------------- broken transforms
def test_broken_cle_raises_naming_cle_and_layer_and_leaves_graph_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = lite_net(0)
    gm = prepared_folded(model, x)
    before, weights = float_output(gm, x), snapshot(gm)
    original = cle_module._scale_in_channels

    def corrupt(layer: nn.Module, factor: torch.Tensor) -> None:  # channel 0 gets a wrong scale
        original(layer, factor * torch.where(torch.arange(len(factor)) == 0, 1.5, 1.0).to(factor))

    monkeypatch.setattr(cle_module, "_scale_in_channels", corrupt)
    with pytest.raises(
        EquivalenceError,
        match=r"cross-layer equalization \(CLE\) changed what layer '[\w.]+' \(pair '[\w.]+' -> '[\w.]+'\)",
    ):
        equalize_graph(gm, CLEConfig(iterations=3))
    after = snapshot(gm)
    assert after.keys() == weights.keys() and all(torch.equal(after[k], v) for k, v in weights.items())
    assert torch.equal(float_output(gm, x), before)


def test_broken_cle_through_the_quantizer_api(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = lite_net(1)
    state = snapshot(model)
    monkeypatch.setattr(
        cle_module, "_scale_out_channels", lambda layer, factor: None
    )  # the first layer is not rescaled
    with pytest.raises(EquivalenceError, match="cross-layer equalization.*layer '"):
        quantized(model, x, config("per_tensor", cle=True))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_broken_batchnorm_fold_raises_naming_layer_and_leaves_graph_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = lite_net(0)
    gm = ModelQuantizer(config("per_tensor", cle=False)).prepare(capture(model, (x[:8],)))
    before, state = float_output(gm, x), snapshot(gm)
    original = passes_module.fold_conv_bn

    def corrupt(unit: nn.Module) -> nn.Module:  # a wrong bias for block 1's depthwise
        plain = original(unit)
        if unit is gm.get_submodule("blocks.1.dw.0"):
            plain.bias.data += 0.5
        return plain

    monkeypatch.setattr(passes_module, "fold_conv_bn", corrupt)
    with pytest.raises(EquivalenceError, match=r"BatchNorm folding changed what layer 'blocks\.1\.dw\.0' computes"):
        fold_batch_norms(gm)
    assert isinstance(gm.get_submodule("blocks.1.dw.0"), QuantConvBn2d)
    assert isinstance(gm.get_submodule("blocks.1.dw.1"), nn.BatchNorm2d)  # the BatchNorm modules are still there
    after = snapshot(gm)
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert torch.equal(float_output(gm, x), before)


def test_cle_is_undone_when_the_quantized_error_on_the_batch_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last guard: the quantized error with CLE (measured on the captured batch) larger than without it puts
    every rescaled layer back."""
    model, x = lite_net(0)
    gm = prepared_folded(model, x)
    weights = snapshot(gm)
    errors = iter([0.1, 0.2])  # without CLE, then with it
    monkeypatch.setattr(passes_module, "quantized_error", lambda *args: next(errors))
    info = equalize_graph(gm, CLEConfig(iterations=3))
    assert info["kept"] == 0 and info["equalized"] == 0
    after = snapshot(gm)
    assert all(torch.equal(after[k], v) for k, v in weights.items())
