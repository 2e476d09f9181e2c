"""Cross-layer equalization and high-bias absorption (quark/torch/quantization/graph/cle.py) against independent
references: the float output of the layers, dense (block-diagonal) expansions of grouped convs, and the paper's
fixed point r1_i == r2_i."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from quark.torch.quantization.graph.cle import absorb_high_bias, equalize, equalize_pair


def _unequal(layer: nn.Module, dim: int, gen: torch.Generator) -> nn.Module:
    """Multiply each slice of the weight along dim by 10**U(-2, 2), so channel ranges span four decades."""
    with torch.no_grad():
        w = layer.weight
        shape = [1] * w.dim()
        shape[dim] = w.shape[dim]
        w.mul_(10 ** (torch.rand(w.shape[dim], generator=gen) * 4 - 2).view(shape))
    return layer


def _dense(layer: nn.Module) -> torch.Tensor:
    """The weight as an ungrouped [out, in, ...] tensor (zeros outside each group's block)."""
    w, g = layer.weight.detach(), getattr(layer, "groups", 1)
    out_g, in_g = w.shape[0] // g, w.shape[1]
    full = torch.zeros(w.shape[0], in_g * g, *w.shape[2:], dtype=w.dtype)
    for k in range(g):
        full[k * out_g : (k + 1) * out_g, k * in_g : (k + 1) * in_g] = w[k * out_g : (k + 1) * out_g]
    return full


def _r1(layer: nn.Module) -> torch.Tensor:
    w = layer.weight.detach()
    return w.abs().reshape(w.shape[0], -1).amax(1)


def _r2(layer: nn.Module) -> torch.Tensor:
    w = _dense(layer).abs()
    return w.transpose(0, 1).reshape(w.shape[1], -1).amax(1)


def _net(*layers: nn.Module) -> nn.Sequential:
    """layers with a ReLU between consecutive ones."""
    mods: list[nn.Module] = []
    for layer in layers:
        mods += [layer, nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def _assert_same(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    assert torch.isfinite(out).all()
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < rtol, f"relative error {err:.3g}"


def _int8_per_tensor(w: torch.Tensor) -> torch.Tensor:
    scale = float(w.abs().max()) / 127
    return torch.fake_quantize_per_tensor_affine(w, scale, 0, -128, 127)


def test_conv_relu_conv_equalizes_ranges_and_preserves_output():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    first = _unequal(nn.Conv2d(4, 16, 3, padding=1), 0, gen)
    second = _unequal(nn.Conv2d(16, 8, 3, padding=1), 1, gen)
    net = _net(first, second)
    x = torch.randn(2, 4, 10, 10)
    ref = net(x)
    r1, r2 = _r1(first), _r2(second)
    b1 = first.bias.detach().clone()

    def quant_out_err() -> float:
        q = copy.deepcopy(net)
        with torch.no_grad():
            for m in (q[0], q[2]):
                m.weight.copy_(_int8_per_tensor(m.weight))
        return float(((q(x) - ref).pow(2).mean() / ref.pow(2).mean()).detach())

    err_before = quant_out_err()
    s = equalize_pair(first, second)

    _assert_same(net(x), ref)
    torch.testing.assert_close(s, torch.sqrt(r1 / r2))
    torch.testing.assert_close(first.bias.detach(), b1 / s)
    torch.testing.assert_close(_r1(first), _r2(second))
    torch.testing.assert_close(_r1(first), torch.sqrt(r1 * r2))
    err_after = quant_out_err()
    assert err_after < 0.5 * err_before, (err_before, err_after)


def test_chain_with_depthwise_iterates_and_returns_cumulative_scales():
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    a = _unequal(nn.Conv2d(3, 12, 3, padding=1), 0, gen)
    b = _unequal(nn.Conv2d(12, 12, 3, padding=1, groups=12), 0, gen)
    c = _unequal(nn.Conv2d(12, 5, 1), 1, gen)
    net = _net(a, b, c)
    x = torch.randn(2, 3, 8, 8)
    ref = net(x)
    wa, wc = a.weight.detach().clone(), c.weight.detach().clone()

    run, scales = equalize([(a, b), (b, c)], iterations=5)

    assert run == 5
    assert [t.shape for t in scales] == [torch.Size([12]), torch.Size([12])]
    _assert_same(net(x), ref)
    # a is only touched by pair 0, c only by pair 1: their weights carry exactly the cumulative scales
    torch.testing.assert_close(a.weight.detach(), wa / scales[0].view(-1, 1, 1, 1))
    torch.testing.assert_close(c.weight.detach(), wc * scales[1].view(1, -1, 1, 1))
    # the last pair was equalized last, so it sits exactly on the fixed point; the first one nearly
    torch.testing.assert_close(_r1(b), _r2(c))
    torch.testing.assert_close(_r1(a), _r2(b), rtol=0.05, atol=0)


@pytest.mark.parametrize(
    "first_kw, second_kw",
    [
        ({"in_channels": 3, "out_channels": 8}, {"in_channels": 8, "out_channels": 6, "groups": 2}),
        ({"in_channels": 4, "out_channels": 8, "groups": 2}, {"in_channels": 8, "out_channels": 4, "groups": 4}),
        ({"in_channels": 3, "out_channels": 6}, {"in_channels": 6, "out_channels": 12, "groups": 6}),
    ],
    ids=["second_groups2", "both_grouped", "depthwise_multiplier2"],
)
def test_grouped_second_preserves_output_and_equalizes(first_kw, second_kw):
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    first = _unequal(nn.Conv2d(kernel_size=3, padding=1, **first_kw), 0, gen)
    second = _unequal(nn.Conv2d(kernel_size=3, padding=1, **second_kw), 1, gen)
    net = _net(first, second)
    x = torch.randn(2, first_kw["in_channels"], 7, 7)
    ref = net(x)
    r1, r2 = _r1(first), _r2(second)

    s = equalize_pair(first, second)

    _assert_same(net(x), ref)
    torch.testing.assert_close(s, torch.sqrt(r1 / r2))
    torch.testing.assert_close(_r1(first), _r2(second))


def test_conv1d_and_conv3d_pairs():
    torch.manual_seed(3)
    for conv, shape in ((nn.Conv1d, (2, 3, 9)), (nn.Conv3d, (1, 3, 5, 5, 5))):
        first, second = conv(3, 6, 3, padding=1), conv(6, 4, 3, padding=1)
        with torch.no_grad():
            first.weight.mul_(torch.logspace(-2, 2, 6).view(-1, *[1] * (first.weight.dim() - 1)))
        net = _net(first, second)
        x = torch.randn(*shape)
        ref = net(x)
        equalize_pair(first, second)
        _assert_same(net(x), ref)
        torch.testing.assert_close(_r1(first), _r2(second))


def test_linear_relu_linear():
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    first = _unequal(nn.Linear(10, 20), 0, gen)
    second = _unequal(nn.Linear(20, 7), 1, gen)
    net = _net(first, second)
    x = torch.randn(16, 10)
    ref = net(x)
    r1, r2 = _r1(first), _r2(second)

    s = equalize_pair(first, second)

    _assert_same(net(x), ref)
    torch.testing.assert_close(s, torch.sqrt(r1 / r2))
    torch.testing.assert_close(_r1(first), _r2(second))


def test_zero_channels_keep_unit_scale_and_stay_finite():
    torch.manual_seed(5)
    first, second = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3, bias=False)
    with torch.no_grad():
        first.weight[0] = 0
        second.weight[:, 1] = 0
    net = _net(first, second)
    x = torch.randn(2, 3, 9, 9)
    ref = net(x)

    s = equalize_pair(first, second)

    assert torch.isfinite(s).all() and torch.isfinite(first.weight).all() and torch.isfinite(second.weight).all()
    assert s[0] == 1 and s[1] == 1
    assert (s[2:] != 1).all()
    _assert_same(net(x), ref)


def test_threshold_stops_early():
    gen = torch.Generator().manual_seed(6)
    make = lambda: (_unequal(nn.Conv2d(3, 8, 3), 0, gen), _unequal(nn.Conv2d(8, 4, 3), 1, gen))  # noqa: E731
    run, _ = equalize([make()], iterations=10, threshold=1e9)
    assert run == 1
    # a single pair reaches its fixed point in one pass; the second pass has s == 1 up to rounding
    run, _ = equalize([make()], iterations=10, threshold=1e-4)
    assert run == 2
    run, _ = equalize([make()], iterations=3)
    assert run == 3


def test_conv_then_linear_is_rejected():
    with pytest.raises(ValueError, match="Conv2d.*Linear"):
        equalize_pair(nn.Conv2d(3, 8, 3), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="Linear.*Conv2d"):
        absorb_high_bias(nn.Linear(3, 8), nn.Conv2d(8, 4, 1), torch.ones(8), torch.ones(8))


def _high_bias_first(conv: bool, c_in: int, c: int, gamma: torch.Tensor, beta: torch.Tensor) -> nn.Module:
    """first whose pre-activation of channel i lies in [beta_i - 3|gamma_i|, beta_i + 3|gamma_i|] for x in [-1, 1]:
    bias = beta, each weight row has L1 norm exactly 3|gamma_i|."""
    layer = nn.Conv2d(c_in, c, 3) if conv else nn.Linear(c_in, c)
    with torch.no_grad():
        w = torch.randn_like(layer.weight)
        w /= w.abs().reshape(c, -1).sum(1).view(-1, *[1] * (w.dim() - 1))
        layer.weight.copy_(w * 3 * gamma.abs().view(-1, *[1] * (w.dim() - 1)))
        layer.bias.copy_(beta)
    return layer


@pytest.mark.parametrize(
    "second_factory, conv",
    [
        (lambda c: nn.Conv2d(c, 5, 3), True),
        (lambda c: nn.Conv2d(c, 5, 3, bias=False), True),
        (lambda c: nn.Conv2d(c, c, 3, groups=c), True),
        (lambda c: nn.Conv2d(c, 6, 3, groups=2, bias=False), True),
        (lambda c: nn.Linear(c, 5), False),
    ],
    ids=["conv", "conv_no_bias", "depthwise", "grouped_no_bias", "linear"],
)
def test_absorb_high_bias(second_factory, conv):
    torch.manual_seed(7)
    c_in, c = 3, 8
    gamma = torch.rand(c) + 0.1
    beta = torch.randn(c) * 2 + 1.5
    first = _high_bias_first(conv, c_in, c, gamma, beta)
    second = second_factory(c)  # padding 0: the absorbed constant is exact on every output position
    had_bias = second.bias is not None
    net = _net(first, second)
    x = torch.rand(4, c_in, 9, 9) * 2 - 1 if conv else torch.rand(64, c_in) * 2 - 1
    ref = net(x)
    b1 = first.bias.detach().clone()
    expected_c = torch.clamp(beta - 3 * gamma, min=0)
    assert (expected_c > 0).sum() >= 3 and (expected_c == 0).sum() >= 1

    got_c = absorb_high_bias(first, second, gamma, beta)

    torch.testing.assert_close(got_c, expected_c)
    torch.testing.assert_close(first.bias.detach(), b1 - expected_c)
    assert isinstance(second.bias, nn.Parameter) and second.bias.shape == (second.weight.shape[0],)
    if not had_bias:
        # the created bias is exactly W2 applied to the constant c (independent dense reference)
        dense = _dense(second)
        expected_b2 = (dense * expected_c.view(1, -1, *[1] * (dense.dim() - 2))).reshape(dense.shape[0], c, -1)
        torch.testing.assert_close(second.bias.detach(), expected_b2.sum((1, 2)))
    _assert_same(net(x), ref)


def test_absorb_high_bias_after_equalize_and_requires_first_bias():
    torch.manual_seed(8)
    gamma, beta = torch.rand(8) + 0.1, torch.randn(8) * 2 + 1.5
    first, second = _high_bias_first(True, 3, 8, gamma, beta), nn.Conv2d(8, 4, 3)
    net = _net(first, second)
    x = torch.rand(2, 3, 9, 9) * 2 - 1
    ref = net(x)
    s = equalize_pair(first, second)
    # the BN statistics of first's output are divided by the CLE scale, like its weight and bias
    absorb_high_bias(first, second, gamma / s, beta / s)
    _assert_same(net(x), ref)

    with pytest.raises(ValueError, match="bias"):
        absorb_high_bias(nn.Conv2d(3, 8, 3, bias=False), nn.Conv2d(8, 4, 3), gamma, beta)
