"""SmoothQuant per decoder layer: the scales against the closed form max|X_j|^alpha / max|W_j|^(1-alpha) (clamped),
computed here from the layer's inputs, and the float function unchanged after folding (into a norm or a Linear)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quark.torch.algorithm.smoothquant import smooth_layer
from quark.torch.quantization.config.config import SmoothQuantConfig
from quark_lightning.tasks.char_lm import DecoderLayer

D = 24


class NormBlock(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(D) if norm == "rms" else nn.LayerNorm(D)
        self.a = nn.Linear(D, 40)
        self.b = nn.Linear(D, 16, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        y = self.norm(hidden_states)
        return torch.cat([self.a(y), self.b(y)], dim=-1)


class LinearPair(nn.Module):
    """up (with bias) -> ReLU -> down: a positive per-channel scale commutes with the ReLU, so it folds into up."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 32)
        self.act = nn.ReLU()
        self.down = nn.Linear(32, D)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.down(self.act(self.up(hidden_states)))


def _inputs(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(2, n, D, generator=g) * 2 + 0.3,), {}) for n in (9, 15, 4)]  # sequence lengths differ


def _closed_form(x_max: torch.Tensor, weights: list[torch.Tensor], alpha: float, clamp_min: float) -> torch.Tensor:
    w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    return (x_max.double() ** alpha / w_max.double() ** (1 - alpha)).clamp(min=clamp_min).float()


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_scales_closed_form_and_unchanged_float_function(alpha: float, norm: str) -> None:
    torch.manual_seed(1)
    block = NormBlock(norm).eval()
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.weight[[2, 17]] = 30.0  # outlier channels
        block.norm.weight[5] = 0.0  # a channel that is always zero (RMSNorm): its scale is clamped
        if norm == "layer":
            block.norm.bias.uniform_(-0.2, 0.2)
            block.norm.bias[5] = 0.0
    original = copy.deepcopy(block)
    inputs = _inputs()
    with torch.no_grad():
        x_max = torch.stack([original.norm(a[0]).abs().reshape(-1, D).amax(dim=0) for a, _ in inputs]).amax(dim=0)
        before = [original(*a) for a, _ in inputs]
    clamp_min = 0.05
    scales = smooth_layer(
        block,
        inputs,
        SmoothQuantConfig(
            alpha=alpha, scale_clamp_min=clamp_min, scaling_layers=[{"prev_op": "norm", "layers": ["a", "b"]}]
        ),
    )

    expected = _closed_form(x_max, [original.a.weight.detach(), original.b.weight.detach()], alpha, clamp_min)
    torch.testing.assert_close(scales["norm"], expected, rtol=1e-5, atol=1e-7)
    assert float(scales["norm"][5]) == pytest.approx(clamp_min)  # x_max 0 -> clamped
    assert float(scales["norm"][2]) > 5 * float(scales["norm"].median())  # outliers get the largest scales
    s = scales["norm"]
    torch.testing.assert_close(block.norm.weight, original.norm.weight / s)
    torch.testing.assert_close(block.a.weight, original.a.weight * s)
    torch.testing.assert_close(block.b.weight, original.b.weight * s)
    if norm == "layer":
        torch.testing.assert_close(block.norm.bias, original.norm.bias / s)
    assert not torch.equal(block.a.weight, original.a.weight)
    with torch.no_grad():
        for (args, _), ref in zip(inputs, before, strict=True):
            torch.testing.assert_close(block(*args), ref, rtol=1e-4, atol=1e-5)
        # the point: the linears' input has no outlier channel left (max over channels / median shrinks)
        x_new = torch.cat([block.norm(a[0]).reshape(-1, D) for a, _ in inputs]).abs().amax(dim=0)
        assert float(x_new.max() / x_new.median()) < float(x_max.max() / x_max.median())


def test_fold_into_preceding_linear_with_bias() -> None:
    torch.manual_seed(2)
    block = LinearPair().eval()
    original = copy.deepcopy(block)
    inputs = _inputs(3)
    captured: list[torch.Tensor] = []
    handle = original.down.register_forward_pre_hook(lambda m, args: captured.append(args[0].reshape(-1, 32)))
    with torch.no_grad():
        before = [original(*a) for a, _ in inputs]
    handle.remove()
    x_max = torch.cat(captured).abs().amax(dim=0)
    scales = smooth_layer(
        block, inputs, SmoothQuantConfig(alpha=0.5, scaling_layers=[{"prev_op": "up", "layers": ["down"]}])
    )
    s = scales["up"]
    torch.testing.assert_close(s, _closed_form(x_max, [original.down.weight.detach()], 0.5, 1e-3), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(block.up.weight, original.up.weight / s.reshape(-1, 1))
    torch.testing.assert_close(block.up.bias, original.up.bias / s)
    torch.testing.assert_close(block.down.weight, original.down.weight * s)
    with torch.no_grad():
        for (args, _), ref in zip(inputs, before, strict=True):
            torch.testing.assert_close(block(*args), ref, rtol=1e-4, atol=1e-5)


def test_llama_decoder_layer_derived_groups() -> None:
    torch.manual_seed(3)
    layer = DecoderLayer(d_model=32, n_heads=4, d_ff=48).eval()
    with torch.no_grad():
        layer.input_layernorm.weight[[1, 9]] = 15.0
    original = copy.deepcopy(layer)
    inputs = [((torch.randn(2, 10, 32),), {}), ((torch.randn(1, 6, 32),), {})]
    seen: dict[str, list[torch.Tensor]] = {
        "self_attn.q_proj": [],
        "self_attn.o_proj": [],
        "mlp.gate_proj": [],
        "mlp.down_proj": [],
    }
    handles = [
        original.get_submodule(n).register_forward_pre_hook(
            lambda m, args, n=n: seen[n].append(args[0].reshape(-1, args[0].shape[-1]))
        )
        for n in seen
    ]
    with torch.no_grad():
        before = [original(*a) for a, _ in inputs]
    for h in handles:
        h.remove()
    scales = smooth_layer(layer, inputs, SmoothQuantConfig(alpha=0.5))
    assert set(scales) == {"input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"}
    groups = {
        "input_layernorm": ("self_attn.q_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
        "self_attn.v_proj": ("self_attn.o_proj", ["self_attn.o_proj"]),
        "post_attention_layernorm": ("mlp.gate_proj", ["mlp.gate_proj", "mlp.up_proj"]),
        "mlp.up_proj": ("mlp.down_proj", ["mlp.down_proj"]),
    }
    for prev, (inp, linears) in groups.items():
        x_max = torch.cat(seen[inp]).abs().amax(dim=0)
        expected = _closed_form(x_max, [original.get_submodule(n).weight.detach() for n in linears], 0.5, 1e-3)
        torch.testing.assert_close(scales[prev], expected, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        for (args, _), ref in zip(inputs, before, strict=True):
            torch.testing.assert_close(layer(*args), ref, rtol=1e-4, atol=1e-5)
    # v_proj is both a consumer (of the norm's scale) and a producer (of o_proj's): columns times one, rows over the other
    expected_v = (
        original.self_attn.v_proj.weight * scales["input_layernorm"] / scales["self_attn.v_proj"].reshape(-1, 1)
    )
    torch.testing.assert_close(layer.self_attn.v_proj.weight, expected_v, rtol=1e-5, atol=1e-7)


def test_scaling_layers_errors() -> None:
    block = LinearPair()
    with pytest.raises(ValueError, match=r"names \['nope'\].*'up'"):
        smooth_layer(block, _inputs(), SmoothQuantConfig(scaling_layers=[{"prev_op": "nope", "layers": ["down"]}]))
    with pytest.raises(ValueError, match="cannot fold a scale into ReLU"):
        smooth_layer(block, _inputs(), SmoothQuantConfig(scaling_layers=[{"prev_op": "act", "layers": ["down"]}]))
    with pytest.raises(ValueError, match="alpha"):
        SmoothQuantConfig(alpha=1.5)
