"""Fake quantization modules against torch's own fused kernels and the closed forms of TQT and LSQ."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch
from specs import int_spec

from quark.torch.quantization.config.config import LSQSpec, QuantizationSpec, TQTSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType, TQTThresholdInitMeth
from quark.torch.quantization.fake_quant.base import apply_format
from quark.torch.quantization.formats import fake_quantize_mx
from quark.torch.quantization.observer.observer import (
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    threshold_kl_j,
)
from quark.torch.quantization.tensor_quantize import (
    FakeQuantizeBase,
    FrozenScaledFakeQuantize,
    LSQFakeQuantize,
    NonScaledFakeQuantize,
    ScaledFakeQuantize,
    TQTFakeQuantize,
)


def per_channel_spec(ch_axis: int = 0, **overrides: Any) -> QuantizationSpec:
    return int_spec(
        qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=ch_axis, **overrides
    )


def tqt_spec(dtype: Dtype = Dtype.int8, meth: TQTThresholdInitMeth | None = None) -> QuantizationSpec:
    return int_spec(dtype=dtype, scale_type=ScaleType.pof2, qat_spec=TQTSpec(threshold_init_meth=meth))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)) * scale


# ----------------------------------------------------------------------------------------------- dispatch
def test_get_fake_quantize_picks_the_class() -> None:
    cases = [
        (int_spec(), ScaledFakeQuantize),
        (per_channel_spec(), ScaledFakeQuantize),
        (
            QuantizationSpec(dtype="fp8_e4m3", qscheme="per_tensor", observer_cls=PerTensorMinMaxObserver),
            ScaledFakeQuantize,
        ),
        (QuantizationSpec(dtype="bfloat16"), NonScaledFakeQuantize),
        (QuantizationSpec(dtype="float16"), NonScaledFakeQuantize),
        (QuantizationSpec(dtype="mx", mx_element_dtype="fp4", observer_cls=PerBlockMXObserver), NonScaledFakeQuantize),
        (QuantizationSpec(dtype="mx6"), NonScaledFakeQuantize),
        (QuantizationSpec(dtype="bfp16", observer_cls=PerBlockBFPObserver), NonScaledFakeQuantize),
        (tqt_spec(), TQTFakeQuantize),
        (int_spec(qat_spec=LSQSpec()), LSQFakeQuantize),
        (per_channel_spec(qat_spec=LSQSpec()), LSQFakeQuantize),
    ]
    for spec, cls in cases:
        fq = FakeQuantizeBase.get_fake_quantize(spec)
        assert type(fq) is cls, spec
        assert fq.spec is spec


# ----------------------------------------------------------------------------------------------- ScaledFakeQuantize
@pytest.mark.parametrize(
    ("dtype", "symmetric", "qmin", "qmax"),
    [(Dtype.int8, True, -128, 127), (Dtype.uint8, False, 0, 255), (Dtype.int4, False, -8, 7)],
)
def test_per_tensor_static_matches_torch(dtype: Dtype, symmetric: bool, qmin: int, qmax: int) -> None:
    fq = ScaledFakeQuantize(int_spec(dtype=dtype, symmetric=symmetric))
    calib = randn(64, 16, seed=0, scale=2) + 0.5
    fq(calib)
    fq.disable_observer()
    scale, zp = fq.calculate_qparams()
    assert scale.item() > 0

    x = (randn(32, 16, seed=1, scale=3) + 0.5).requires_grad_()  # wider than calibration: some values clip
    x_ref = x.detach().clone().requires_grad_()
    y = fq(x)
    y_ref = torch.fake_quantize_per_tensor_affine(x_ref, scale.item(), int(zp), qmin, qmax)
    assert torch.equal(y, y_ref)
    grad = randn(32, 16, seed=2)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    assert (x.grad == 0).any() and (x.grad != 0).any()  # some clipped, some passed through


def test_per_tensor_static_matches_closed_form() -> None:
    fq = ScaledFakeQuantize(int_spec())
    fq(torch.tensor([-0.5, 1.0]))
    fq.disable_observer()
    s = 1 / 127.5
    x = torch.tensor([0.0, 0.1, -0.3, 0.9, 1.5, -2.0])
    expected = torch.clamp(torch.round(x / s), -128, 127) * s
    torch.testing.assert_close(fq(x), expected, rtol=1e-6, atol=1e-7)


def test_round_method_round_matches_torch_off_ties() -> None:
    # half-away-from-zero differs from torch's half-even only on exact ties: random data has none
    fq = ScaledFakeQuantize(int_spec(round_method=RoundType.round))
    fq(randn(1000, seed=3))
    fq.disable_observer()
    scale, zp = fq.calculate_qparams()
    x = randn(1000, seed=4).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = fq(x)
    y_ref = torch.fake_quantize_per_tensor_affine(x_ref, scale.item(), int(zp), -128, 127)
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    assert torch.equal(x.grad, x_ref.grad)


def test_round_method_on_ties() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997])
    expected = {
        RoundType.half_even: [0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 0.0],
        RoundType.round: [1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 0.0],
        RoundType.floor: [0.0, 1.0, 2.0, -1.0, -2.0, -3.0, 0.0],
    }
    for method, values in expected.items():
        fq = ScaledFakeQuantize(int_spec(round_method=method))
        fq(torch.tensor([127.5]))  # scale exactly 1
        assert fq.calculate_qparams()[0].item() == 1.0
        assert fq(x).tolist() == values, method


@pytest.mark.parametrize("ch_axis", [0, 1, -1])
def test_per_channel_static_matches_torch(ch_axis: int) -> None:
    fq = ScaledFakeQuantize(per_channel_spec(ch_axis=ch_axis))
    w = randn(8, 12, seed=5)
    fq(w)
    scale, zp = fq.calculate_qparams()
    assert scale.shape == (w.shape[ch_axis],)
    torch.testing.assert_close(scale, w.abs().amax(dim=1 - ch_axis % 2) / 127.5, rtol=1e-7, atol=0)

    x = (w * 1.3).requires_grad_()  # some values beyond each channel's range
    x = x.detach().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    fq.disable_observer()
    y = fq(x)
    y_ref = torch.fake_quantize_per_channel_affine(x_ref, scale, zp, ch_axis % 2, -128, 127)
    assert torch.equal(y, y_ref)
    grad = randn(8, 12, seed=6)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(x.grad, x_ref.grad)
    assert (x.grad == 0).any()


def test_per_channel_asymmetric_matches_torch() -> None:
    fq = ScaledFakeQuantize(per_channel_spec(ch_axis=0, dtype=Dtype.uint8, symmetric=False))
    w = randn(6, 20, seed=7) + torch.linspace(-1, 1, 6).unsqueeze(1)
    y = fq(w)
    scale, zp = fq.calculate_qparams()
    assert zp.dtype == torch.int32 and (zp > 0).any()
    assert torch.equal(y, torch.fake_quantize_per_channel_affine(w, scale, zp, 0, 0, 255))


def test_per_group_matches_torch_per_row() -> None:
    spec = int_spec(dtype=Dtype.int4, qscheme="per_group", observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=8)
    fq = ScaledFakeQuantize(spec)
    w = randn(4, 32, seed=8)
    y = fq(w)
    scale, zp = fq.calculate_qparams()
    assert scale.shape == (4, 4)
    rows = w.reshape(16, 8)  # every group a row
    ref = torch.fake_quantize_per_channel_affine(rows, scale.reshape(-1), zp.reshape(-1), 0, -8, 7).reshape(4, 32)
    assert torch.equal(y, ref)


def test_fp8_per_tensor_output_on_e4m3_grid() -> None:
    spec = QuantizationSpec(dtype="fp8_e4m3", qscheme="per_tensor", observer_cls=PerTensorMinMaxObserver)
    fq = ScaledFakeQuantize(spec)
    x = randn(256, seed=9, scale=5)
    y = fq(x)
    scale = fq.calculate_qparams()[0]
    assert scale.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-6)
    ref = (x / scale).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------- switches
def test_observer_off_freezes_qparams() -> None:
    fq = ScaledFakeQuantize(int_spec())
    fq(torch.tensor([-1.0, 1.0]))
    scale_before = fq.calculate_qparams()[0].clone()
    fq.disable_observer()
    big = torch.tensor([-10.0, 10.0, 0.3])
    y = fq(big)
    assert torch.equal(fq.calculate_qparams()[0], scale_before)
    assert y.tolist() == pytest.approx([-128 / 127.5, 127 / 127.5, 38 / 127.5], rel=1e-6)  # clipped to the old range
    fq.enable_observer()
    fq(big)
    assert fq.calculate_qparams()[0].item() == pytest.approx(10 / 127.5, rel=1e-7)


def test_fake_quant_off_returns_input_but_still_observes() -> None:
    fq = ScaledFakeQuantize(int_spec())
    fq.disable_fake_quant()
    x = randn(50, seed=10)
    y = fq(x)
    assert torch.equal(y, x)
    assert fq.calculate_qparams()[0].item() == pytest.approx(x.abs().max().item() / 127.5, rel=1e-7)
    fq.enable_fake_quant()
    assert not torch.equal(fq(x), x)


def test_both_switches_off_is_identity_without_statistics() -> None:
    fq = ScaledFakeQuantize(int_spec())
    fq.disable_observer()
    fq.disable_fake_quant()
    x = randn(10, seed=11)
    assert torch.equal(fq(x), x)


def test_static_without_statistics_and_observer_off_raises() -> None:
    fq = ScaledFakeQuantize(int_spec())
    fq.disable_observer()
    with pytest.raises(RuntimeError):
        fq(randn(10, seed=12))


def test_switch_methods_chain_and_buffers() -> None:
    fq = ScaledFakeQuantize(int_spec())
    assert fq.disable_observer() is fq
    assert fq.observer_enabled.item() == 0 and fq.fake_quant_enabled.item() == 1
    fq.enable_observer(False).disable_fake_quant()
    assert fq.observer_enabled.item() == 0 and fq.fake_quant_enabled.item() == 0


# ----------------------------------------------------------------------------------------------- state_dict / dynamic / frozen
@pytest.mark.parametrize(
    "spec_fn", [lambda: int_spec(), lambda: per_channel_spec(ch_axis=1, dtype=Dtype.uint4, symmetric=False)]
)
def test_static_state_dict_reproduces_outputs(spec_fn: Any) -> None:
    fq = ScaledFakeQuantize(spec_fn())
    fq(randn(6, 10, seed=13))
    fq(randn(6, 10, seed=14, scale=2))
    fq.disable_observer()
    state = fq.state_dict()
    assert "scale" in state and "zero_point" in state
    assert torch.equal(state["scale"], fq.calculate_qparams()[0])

    fresh = ScaledFakeQuantize(spec_fn())
    fresh.load_state_dict(state)
    assert fresh.observer_enabled.item() == 0  # the switch travels with the state
    x = randn(6, 10, seed=15, scale=3)
    assert torch.equal(fresh(x), fq(x))
    s1, z1 = fq.calculate_qparams()
    s2, z2 = fresh.calculate_qparams()
    assert torch.equal(s1, s2) and torch.equal(z1, z2)


def test_float_zero_point_survives_state_dict() -> None:
    spec = int_spec(dtype=Dtype.uint8, symmetric=False, zero_point_type="float32")
    fq = ScaledFakeQuantize(spec)
    fq(torch.tensor([-1.0, 3.0]))
    fq.disable_observer()
    zp = fq.calculate_qparams()[1]
    assert zp.is_floating_point() and zp.item() == pytest.approx(63.75, rel=1e-6)
    fresh = ScaledFakeQuantize(spec)
    fresh.load_state_dict(fq.state_dict())
    assert torch.equal(fresh.calculate_qparams()[1], zp)  # not truncated to 63
    x = randn(200, seed=49, scale=2)
    y = fresh(x)
    assert torch.equal(y, fq(x))
    s = fq.calculate_qparams()[0]
    expected = (torch.clamp(torch.round(x * (1 / s) + zp), 0, 255) - zp) * s
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-6)


def test_state_dict_of_mse_quantizer_reproduces_outputs() -> None:
    spec = int_spec(observer_cls=PerTensorMSEObserver)
    fq = ScaledFakeQuantize(spec)
    fq(randn(4000, seed=16))
    fresh = ScaledFakeQuantize(spec)
    fresh.load_state_dict(fq.state_dict())
    fq.disable_observer()
    fresh.disable_observer()
    x = randn(100, seed=17)
    assert torch.equal(fresh(x), fq(x))


def test_dynamic_recomputes_per_call() -> None:
    fq = ScaledFakeQuantize(int_spec(is_dynamic=True))
    fq.disable_observer()  # dynamic quantizers observe every call regardless
    for seed, amp in ((18, 1.0), (19, 10.0), (20, 0.1)):
        x = randn(200, seed=seed, scale=amp)
        s = x.abs().max() / 127.5
        assert torch.equal(fq(x), torch.fake_quantize_per_tensor_affine(x, s.item(), 0, -128, 127))
    assert "scale" not in fq.state_dict()


def test_dynamic_per_channel_recomputes_per_call() -> None:
    fq = ScaledFakeQuantize(per_channel_spec(ch_axis=0, is_dynamic=True))
    a, b = randn(4, 8, seed=21, scale=5), randn(4, 8, seed=22, scale=0.2)
    fq(a)
    y = fq(b)
    s = b.abs().amax(1) / 127.5
    assert torch.equal(y, torch.fake_quantize_per_channel_affine(b, s, torch.zeros(4, dtype=torch.int32), 0, -128, 127))


def test_to_frozen_is_identical_and_ignores_enable_observer() -> None:
    fq = ScaledFakeQuantize(per_channel_spec(ch_axis=0))
    fq(randn(5, 7, seed=23))
    frozen = fq.to_frozen()
    assert isinstance(frozen, FrozenScaledFakeQuantize)
    fq.disable_observer()
    x = randn(5, 7, seed=24, scale=4)
    assert torch.equal(frozen(x), fq(x))
    frozen.enable_observer()
    assert frozen.observer_enabled.item() == 0
    big = randn(5, 7, seed=25, scale=100)
    assert torch.equal(frozen(big), fq(big))
    assert torch.equal(frozen.calculate_qparams()[0], fq.calculate_qparams()[0])
    frozen.disable_fake_quant()
    assert torch.equal(frozen(x), x)


def test_frozen_state_dict_round_trip() -> None:
    fq = ScaledFakeQuantize(per_channel_spec(ch_axis=1))
    fq(randn(3, 9, seed=26))
    frozen = fq.to_frozen()
    fresh = FrozenScaledFakeQuantize(fq.spec)
    fresh.load_state_dict(frozen.state_dict())
    x = randn(3, 9, seed=27)
    assert torch.equal(fresh(x), frozen(x))


def test_dynamic_to_frozen_stays_dynamic() -> None:
    fq = ScaledFakeQuantize(int_spec(is_dynamic=True))
    assert fq.to_frozen() is fq


# ----------------------------------------------------------------------------------------------- NonScaledFakeQuantize
@pytest.mark.parametrize(("dtype", "torch_dtype"), [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_cast_fake_quantize(dtype: str, torch_dtype: torch.dtype) -> None:
    fq = FakeQuantizeBase.get_fake_quantize(QuantizationSpec(dtype=dtype))
    x = randn(64, 33, seed=28, scale=100).requires_grad_()
    y = fq(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, x.detach().to(torch_dtype).float())
    assert not torch.equal(y, x.detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight through


def test_mx_fp4_fake_quantize() -> None:
    spec = QuantizationSpec(
        dtype=Dtype.mx,
        mx_element_dtype=Dtype.fp4,
        observer_cls=PerBlockMXObserver,
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        is_dynamic=True,
    )
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    x = randn(4, 96, seed=29, scale=3)
    y = fq(x)
    assert torch.equal(y, fake_quantize_mx(x, Dtype.fp4, 32, -1))
    # each block: shared power-of-two scale times an fp4 (e2m1) value
    scale, _ = fq.observer.calculate_qparams()
    fp4_grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    elements = (y.reshape(4, 3, 32) / scale.unsqueeze(-1)).abs()
    assert torch.isin(elements, fp4_grid).all()
    fq.disable_fake_quant()
    assert torch.equal(fq(x), x)


# ----------------------------------------------------------------------------------------------- LSQ
def _lsq_per_tensor(dtype: Dtype = Dtype.int8) -> LSQFakeQuantize:
    fq = FakeQuantizeBase.get_fake_quantize(int_spec(dtype=dtype, qat_spec=LSQSpec()))
    assert isinstance(fq, LSQFakeQuantize)
    return fq


@pytest.mark.parametrize(("dtype", "qmin", "qmax"), [(Dtype.int8, -128, 127), (Dtype.int4, -8, 7)])
def test_lsq_init_is_two_mean_abs_over_sqrt_qmax(dtype: Dtype, qmin: int, qmax: int) -> None:
    fq = _lsq_per_tensor(dtype)
    x = randn(16, 32, seed=30, scale=2)
    fq(x)
    assert fq.scale.item() == pytest.approx(2 * x.abs().mean().item() / math.sqrt(qmax), rel=1e-6)
    # initialised once: a second batch does not re-initialise
    fq(x * 100)
    assert fq.scale.item() == pytest.approx(2 * x.abs().mean().item() / math.sqrt(qmax), rel=1e-6)


@pytest.mark.parametrize(("dtype", "qmin", "qmax"), [(Dtype.int8, -128, 127), (Dtype.int4, -8, 7)])
def test_lsq_per_tensor_matches_torch(dtype: Dtype, qmin: int, qmax: int) -> None:
    fq = _lsq_per_tensor(dtype)
    fq(randn(8, 64, seed=31))  # initialise
    with torch.no_grad():
        fq.scale.mul_(0.2)  # narrow enough that both ends clip
    x = randn(8, 64, seed=32, scale=2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    s_ref = fq.scale.detach().clone().requires_grad_()
    grad_factor = 1.0 / math.sqrt(x.numel() * qmax)

    y = fq(x)
    y_ref = torch._fake_quantize_learnable_per_tensor_affine(x_ref, s_ref, torch.zeros(1), qmin, qmax, grad_factor)
    assert torch.equal(y, y_ref)
    g = randn(8, 64, seed=33)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert (x.grad == 0).any()  # some elements clipped
    assert fq.scale.grad.shape == s_ref.grad.shape
    torch.testing.assert_close(fq.scale.grad, s_ref.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ch_axis", [0, 1, -1])
def test_lsq_per_channel_matches_torch(ch_axis: int) -> None:
    fq = FakeQuantizeBase.get_fake_quantize(per_channel_spec(ch_axis=ch_axis, qat_spec=LSQSpec()))
    assert isinstance(fq, LSQFakeQuantize)
    init = randn(6, 10, 4, seed=34) * torch.linspace(0.5, 2, 10).reshape(1, 10, 1)
    fq(init)
    channels = init.shape[ch_axis]
    abs_mean = init.abs().movedim(ch_axis, 0).reshape(channels, -1).mean(1)
    torch.testing.assert_close(fq.scale.detach(), 2 * abs_mean / math.sqrt(127), rtol=1e-6, atol=0)
    with torch.no_grad():
        fq.scale.mul_(0.1)

    x = randn(6, 10, 4, seed=35, scale=2).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    s_ref = fq.scale.detach().clone().requires_grad_()
    grad_factor = 1.0 / math.sqrt(x.numel() / channels * 127)
    y = fq(x)
    y_ref = torch._fake_quantize_learnable_per_channel_affine(
        x_ref, s_ref, torch.zeros(channels), ch_axis % x.ndim, -128, 127, grad_factor
    )
    assert torch.equal(y, y_ref)
    g = randn(6, 10, 4, seed=36)
    y.backward(g)
    y_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)
    assert (x.grad == 0).any()
    torch.testing.assert_close(fq.scale.grad, s_ref.grad, rtol=1e-5, atol=1e-7)


def test_lsq_scale_is_a_trainable_parameter() -> None:
    fq = _lsq_per_tensor()
    fq(randn(100, seed=37))
    assert any(p is fq.scale for p in fq.parameters())
    opt = torch.optim.SGD(fq.parameters(), lr=0.1)
    before = fq.scale.item()
    x = randn(100, seed=38, scale=3)
    loss = ((fq(x) - x) ** 2).sum()
    loss.backward()
    opt.step()
    assert fq.scale.item() != before


def test_lsq_needs_observer_for_init_and_freezes() -> None:
    fq = _lsq_per_tensor()
    fq.disable_observer()
    with pytest.raises(RuntimeError):
        fq(randn(10, seed=39))
    fq.enable_observer()
    x = randn(10, seed=40)
    y = fq(x)
    frozen = fq.to_frozen()
    assert isinstance(frozen, FrozenScaledFakeQuantize)
    assert torch.equal(frozen(x), y.detach())


@pytest.mark.parametrize("method", [RoundType.floor, RoundType.round, RoundType.half_even])
def test_learnable_quantizers_honour_round_method_and_freeze_identically(method: RoundType) -> None:
    x = randn(2000, seed=50, scale=2)
    for spec in (
        int_spec(round_method=method, qat_spec=LSQSpec()),
        int_spec(round_method=method, scale_type="pof2", qat_spec=TQTSpec()),
    ):
        fq = FakeQuantizeBase.get_fake_quantize(spec)
        y = fq(x)
        s = fq.calculate_qparams()[0]
        v = x * (1 / s)
        r = {RoundType.floor: torch.floor(v), RoundType.half_even: torch.round(v)}.get(method)
        if r is None:  # half away from zero
            r = torch.sign(v) * torch.floor(v.abs() + 0.5)
        assert torch.equal(y.detach(), torch.clamp(r, -128, 127) * s), (type(fq).__name__, method)
        assert torch.equal(fq.to_frozen()(x), y.detach()), (type(fq).__name__, method)


def test_lsq_per_channel_state_dict_loads_into_fresh() -> None:
    spec = per_channel_spec(ch_axis=0, qat_spec=LSQSpec())
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    fq(randn(5, 6, seed=41))
    fresh = FakeQuantizeBase.get_fake_quantize(spec)
    fresh.load_state_dict(fq.state_dict())
    assert fresh.scale.shape == (5,)
    x = randn(5, 6, seed=42)
    assert torch.equal(fresh(x), fq(x))


# ----------------------------------------------------------------------------------------------- TQT
def _tqt_reference(x: torch.Tensor, log_t: float, bits: int) -> tuple[torch.Tensor, float]:
    s = 2.0 ** math.ceil(log_t) / 2 ** (bits - 1)
    return torch.clamp(torch.round(x / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s, s


@pytest.mark.parametrize("bits", [8, 4])
def test_tqt_init_3sd_forward_and_gradients(bits: int) -> None:
    dtype = Dtype.int8 if bits == 8 else Dtype.int4
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec(dtype))
    assert isinstance(fq, TQTFakeQuantize)
    x = torch.cat([randn(2000, seed=43, scale=0.7), torch.tensor([9.0, -9.0, 6.5, -7.25])]).requires_grad_()

    y = fq(x)
    # _3SD: log2(|mean| + 3 * population std)
    xd = x.detach().double()
    t = xd.mean().abs() + 3 * xd.std(correction=0)
    assert fq.log_threshold.item() == pytest.approx(math.log2(t.item()), rel=1e-5)

    log_t = fq.log_threshold.item()
    expected, s = _tqt_reference(x.detach(), log_t, bits)
    assert fq.scale.item() == s
    assert math.log2(s) == round(math.log2(s))
    assert torch.equal(y, expected)

    g = randn(x.numel(), seed=44)
    y.backward(g)
    v = x.detach() / s
    r = torch.round(v)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    inside = (r >= qmin) & (r <= qmax)
    assert (~inside).sum() >= 4  # the tails do clip
    assert torch.equal(x.grad, torch.where(inside, g, torch.zeros_like(g)))

    ln2 = math.log(2.0)
    local = torch.where(inside, r - v, torch.where(r < qmin, torch.full_like(v, qmin), torch.full_like(v, qmax)))
    expected_grad = (g.double() * local.double()).sum().item() * s * ln2
    assert fq.log_threshold.grad.shape == (1,)
    assert fq.log_threshold.grad.item() == pytest.approx(expected_grad, rel=1e-4, abs=1e-6)


def test_tqt_gradient_split_inside_and_clipped() -> None:
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec())
    with torch.no_grad():
        fq.log_threshold.fill_(0.0)  # threshold 1: s = 2^0 / 128
    fq.initialized.fill_(1)
    s = 1 / 128
    x = torch.tensor([0.3, -0.7, 2.0, -3.0], requires_grad=True)  # two inside, one above, one below
    y = fq(x)
    assert y.tolist() == pytest.approx([round(0.3 * 128) * s, round(-0.7 * 128) * s, 127 * s, -128 * s])
    y.backward(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    ln2 = math.log(2.0)
    inside = 1.0 * (round(0.3 * 128) - 0.3 * 128) + 2.0 * (round(-0.7 * 128) - (-0.7 * 128))
    clipped = 3.0 * 127 + 4.0 * (-128)
    assert fq.log_threshold.grad.item() == pytest.approx(s * ln2 * (inside + clipped), rel=1e-5)
    assert x.grad.tolist() == [1.0, 2.0, 0.0, 0.0]


def test_tqt_init_ll_j_uses_threshold_kl_j() -> None:
    x = torch.rand(20_000, generator=gen(45)) * 4 - 2
    for meth in (TQTThresholdInitMeth._LL_J, TQTThresholdInitMeth._KL_J, "_kl_j"):
        fq = FakeQuantizeBase.get_fake_quantize(tqt_spec(meth=meth))
        fq(x)
        assert fq.log_threshold.item() == pytest.approx(math.log2(threshold_kl_j(x, 8).item()), rel=1e-6)
        assert 2 ** fq.log_threshold.item() == pytest.approx(2.0, rel=0.03)  # uniform: ~ max|x|


def test_tqt_default_init_is_3sd() -> None:
    x = randn(1000, seed=46)
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec(meth=None))
    fq(x)
    assert fq.log_threshold.item() == pytest.approx(
        math.log2((x.mean().abs() + 3 * x.std(correction=0)).item()), rel=1e-6
    )


def test_tqt_threshold_trains_and_freezes() -> None:
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec())
    x = randn(500, seed=47)
    fq(x)
    assert any(p is fq.log_threshold for p in fq.parameters())
    before = fq.log_threshold.item()
    y = fq(x * 5)  # far beyond the threshold: clipping error pulls it up
    ((y - x * 5) ** 2).mean().backward()
    assert fq.log_threshold.grad.item() < 0
    opt = torch.optim.SGD([fq.log_threshold], lr=0.5 / abs(fq.log_threshold.grad.item()))
    opt.step()  # a step of 0.5 in log2 t
    assert fq.log_threshold.item() == pytest.approx(before + 0.5, rel=1e-6)
    frozen = fq.to_frozen()
    assert torch.equal(frozen(x), fq(x).detach())
    assert frozen.calculate_qparams()[1].item() == 0


@pytest.mark.parametrize("dtype", [Dtype.int8, Dtype.int4])
def test_tqt_host_check_of_one_threshold_is_the_tensor_check(dtype: Dtype) -> None:
    """A per-tensor threshold is checked on the host in training (``_invalid_value``, Python arithmetic): the same
    verdict as the tensor check (float32's ``exp2``) at every quarter step across and past float32's range of
    powers of two, and at the infinities, NaN and huge values."""
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec(dtype))
    values = [*torch.arange(-170.0, 150.0, 0.25).tolist(), math.inf, -math.inf, math.nan, 1e30, -1e30, 3e38]
    verdicts = set()
    for v in values:
        with torch.no_grad():
            fq.log_threshold.fill_(v)
        expected = bool(fq._invalid().any())
        assert fq._invalid_value(fq.log_threshold.item()) is expected, v
        verdicts.add(expected)
    assert verdicts == {True, False}


def test_lsq_output_can_be_modified_in_place() -> None:
    """An in-place op on LSQ's output (``ReLU(inplace=True)`` after it) leaves its backward intact: the output is
    not what the backward reads. The gradients are those of the out-of-place op."""
    grads = []
    for inplace in (True, False):
        fq = FakeQuantizeBase.get_fake_quantize(int_spec(qat_spec=LSQSpec()))
        x = randn(64, seed=70).requires_grad_()
        fq(x.detach())  # initialises the scale
        y = fq(x)
        y = torch.relu_(y) if inplace else torch.relu(y)
        (y * randn(64, seed=71)).sum().backward()
        grads.append((x.grad, fq.scale.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_lsq_host_check_of_one_scale_is_the_tensor_check() -> None:
    """A per-tensor LSQ scale is checked on the host in training: the same verdict as the tensor check (finite,
    positive, a finite float32 reciprocal) at the float32 values around where ``1 / s`` overflows, subnormals, zeros,
    negatives, the infinities and NaN."""
    fq = FakeQuantizeBase.get_fake_quantize(int_spec(qat_spec=LSQSpec()))
    edge = torch.tensor(1 / (2.0**128 - 2.0**103), dtype=torch.float32)
    around = [edge]
    for direction in (0.0, 1.0):
        t = edge
        for _ in range(4):
            t = torch.nextafter(t, torch.tensor(direction))
            around.append(t)
    values = [float(t) for t in around] + [1e-45, 1e-40, 0.0, -0.0, -1.0, 0.02, 3e38, math.inf, -math.inf, math.nan]
    verdicts = set()
    for v in values:
        with torch.no_grad():
            fq.scale.fill_(v)
        expected = bool(fq._invalid().any())
        assert fq._invalid_value(fq.scale.item()) is expected, v
        verdicts.add(expected)
    assert verdicts == {True, False}


def test_tqt_needs_observer_for_init() -> None:
    fq = FakeQuantizeBase.get_fake_quantize(tqt_spec())
    fq.disable_observer()
    with pytest.raises(RuntimeError):
        fq(randn(10, seed=48))


# ----------------------------------------------------------------------------------------------- TQT per channel
def tqt_channel_spec(
    ch_axis: int, dtype: Dtype = Dtype.int4, init: str | None = None, round_method: RoundType = RoundType.half_even
) -> QuantizationSpec:
    return per_channel_spec(
        ch_axis,
        dtype=dtype,
        scale_type=ScaleType.pof2,
        round_method=round_method,
        qat_spec=TQTSpec(threshold_init_meth=init),
    )


@pytest.mark.parametrize("round_method", [RoundType.half_even, RoundType.round])
def test_tqt_per_channel_forward_and_gradients_match_the_closed_form_per_channel(round_method: RoundType) -> None:
    """One learned threshold per channel along axis 1 of a 4-D tensor: each channel is TQT of its own threshold,
    and each threshold's gradient is the paper's sum over that channel only."""
    spec = tqt_channel_spec(1, round_method=round_method)
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    assert isinstance(fq, TQTFakeQuantize)
    widths = torch.tensor([0.05, 0.4, 1.0, 3.0])  # channel ranges two orders of magnitude apart
    x = randn(3, 4, 5, 6, seed=60)
    x[0, :, 0, 0], x[1, :, 0, 0] = 16.0, -16.0  # outliers beyond any 3SD power of two: the clipped branch
    x = (x * widths.view(1, 4, 1, 1)).requires_grad_()
    y = fq(x)
    rows = x.detach().double().movedim(1, 0).reshape(4, -1)
    t = rows.mean(dim=1).abs() + 3 * rows.std(dim=1, correction=0)  # 3SD per channel
    assert fq.log_threshold.shape == (4,)
    assert torch.allclose(fq.log_threshold.double(), torch.log2(t), rtol=1e-5)
    s = 2.0 ** torch.ceil(fq.log_threshold.detach().double()) / 8  # int4: b - 1 = 3 fraction bits
    assert torch.equal(fq.scale, s.float())
    assert len(set(s.tolist())) == 4  # each channel got its own power of two
    sv = s.view(1, 4, 1, 1)
    v = x.detach().double() / sv
    # half to even (torch.round), or half away from zero
    r = torch.round(v) if round_method == RoundType.half_even else torch.sign(v) * torch.floor(v.abs() + 0.5)
    assert torch.equal(y.double(), r.clamp(-8, 7) * sv)

    g = randn(3, 4, 5, 6, seed=61)
    y.backward(g)
    inside = (r >= -8) & (r <= 7)
    assert (~inside).any() and inside.any()
    assert torch.equal(x.grad, torch.where(inside, g, torch.zeros_like(g)))
    local = torch.where(inside, r - v, r.clamp(-8, 7))
    expected = (g.double() * local).sum(dim=(0, 2, 3)) * s * math.log(2.0)
    assert torch.allclose(fq.log_threshold.grad.double(), expected, rtol=1e-4, atol=1e-7)


def test_tqt_per_channel_ll_j_initialises_each_channel_from_its_own_values() -> None:
    fq = FakeQuantizeBase.get_fake_quantize(tqt_channel_spec(0, dtype=Dtype.int8, init="_LL_J"))
    x = torch.stack([torch.rand(4000, generator=gen(62)) * 2 - 1, (torch.rand(4000, generator=gen(63)) * 2 - 1) * 8])
    fq(x)
    expected = [math.log2(threshold_kl_j(row, 8).item()) for row in x]
    assert fq.log_threshold.tolist() == pytest.approx(expected, rel=1e-6)
    assert 2 ** fq.log_threshold[1].item() == pytest.approx(8.0, rel=0.05)  # uniform: about max|x| of its channel


def test_tqt_per_channel_freezes_and_reloads_with_its_shape() -> None:
    fq = FakeQuantizeBase.get_fake_quantize(tqt_channel_spec(0))
    x = randn(6, 10, seed=64) * torch.linspace(0.1, 2.0, 6).unsqueeze(1)
    fq(x)
    frozen = fq.to_frozen()
    scale, zp = frozen.calculate_qparams()
    assert scale.shape == (6,) and torch.equal(zp, torch.zeros(6, dtype=torch.int32))
    assert torch.equal(frozen(x), fq(x).detach())
    fresh = FakeQuantizeBase.get_fake_quantize(tqt_channel_spec(0))
    assert fresh.log_threshold.shape == (1,) and not fresh.channels_known
    fresh.load_state_dict(fq.state_dict())
    assert fresh.log_threshold.shape == (6,) and fresh.channels_known
    assert torch.equal(fresh(x), fq(x))


def lsq_spec() -> QuantizationSpec:
    return int_spec(qat_spec=LSQSpec())


@pytest.mark.parametrize(
    "spec_fn",
    [int_spec, lambda: int_spec(is_dynamic=True), per_channel_spec, tqt_spec, lsq_spec],
    ids=["static", "dynamic", "per-channel", "tqt", "lsq"],
)
def test_an_empty_input_passes_through_before_and_after_calibration(spec_fn: Any) -> None:
    """An MoE expert no token was routed to gets an empty slice, in QAT (observer and fake quant on) as in inference:
    nothing to quantize, so it comes back as it is; no qparams are made up from it and no learned threshold is
    initialised from it (before, a quantizer without statistics raised, and TQT / LSQ initialised NaN)."""
    fq = FakeQuantizeBase.get_fake_quantize(spec_fn())
    empty = torch.randn(0, 16, requires_grad=True)
    out = fq(empty)
    assert out.shape == (0, 16) and out.dtype == torch.float32
    out.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, 16)
    assert not bool(fq.initialized)
    x = torch.randn(4, 16)
    first = fq(x)  # the first real batch initialises as if the empty one had not been there
    reference = FakeQuantizeBase.get_fake_quantize(spec_fn())
    assert torch.equal(first, reference(x)) and bool(fq.initialized)
    assert fq(torch.randn(0, 16)).shape == (0, 16)  # and after calibration too
    assert all(bool(torch.isfinite(p).all()) for p in fq.parameters())


def test_frozen_per_group_quantizers_pass_an_empty_input_through() -> None:
    spec = int_spec(
        dtype=Dtype.int4, qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=-1, group_size=16
    )
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    fq(torch.randn(64, 64))
    frozen = fq.to_frozen()
    assert isinstance(frozen, FrozenScaledFakeQuantize)
    assert frozen(torch.randn(0, 64)).shape == (0, 64)  # before: the qparams' shape did not fit, and it raised


# ----------------------------------------------------------------------------------------------- fixed-qparam path
@pytest.mark.parametrize(
    "spec",
    [int_spec(), per_channel_spec()],
    ids=["per_tensor", "per_channel"],
)
def test_fixed_qparams_follow_every_change_of_the_qparams(spec: QuantizationSpec) -> None:
    """With observers off a quantizer keeps its qparams prepared between calls: torch's kernels (the reference)
    must still agree after the scale is changed in place, replaced by set_qparams, loaded from a state_dict, and
    for an input of another rank, and for a zero point held as int64 (cast to int32 for the kernel: a copy, which
    an in-place change must renew)."""
    q = ScaledFakeQuantize(spec)
    x = randn(8, 16, seed=0)
    q(x)
    q.disable_observer()

    def reference(t: torch.Tensor) -> torch.Tensor:
        s, z = q.scale.float(), q.zero_point.to(torch.int32)
        if spec.qscheme == QSchemeType.per_tensor:
            return torch.fake_quantize_per_tensor_affine(t, s.reshape(()), z.reshape(()), -128, 127)
        return torch.fake_quantize_per_channel_affine(t, s.reshape(-1), z.reshape(-1), 0, -128, 127)

    y = randn(8, 16, seed=1, scale=1.5)
    torch.testing.assert_close(q(y), reference(y), rtol=0, atol=0)
    assert torch.equal(q(y), reference(y))  # the second call: the prepared form
    q.scale.mul_(0.5)  # in place: the same tensor object
    assert torch.equal(q(y), reference(y))
    q.set_qparams(q.scale * 3, q.zero_point)
    assert torch.equal(q(y), reference(y))
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["scale"] = state["scale"] / 7
    q.load_state_dict(state)
    assert torch.equal(q(y), reference(y))
    y3 = randn(8, 16, 3, seed=2)  # another rank: per channel along axis 0 still
    assert torch.equal(q(y3), reference(y3))
    q.zero_point = q.zero_point.to(torch.int64)
    assert torch.equal(q(y), reference(y))
    q.zero_point.add_(3)
    assert torch.equal(q(y), reference(y))


def test_switches_skip_repeated_writes_and_follow_any_other_write() -> None:
    """``enable_observer`` / ``enable_fake_quant`` run on every QAT batch: a repeated switch writes nothing, and a
    write by anything else (a state_dict load, a direct fill) is never taken for the switch's own."""
    q = ScaledFakeQuantize(int_spec())
    q.enable_observer(True)
    version = q.observer_enabled._version
    q.enable_observer(True)
    assert q.observer_enabled._version == version  # nothing written
    q.observer_enabled.fill_(0)
    q.enable_observer(True)
    assert bool(q.observer_enabled)
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["observer_enabled"].fill_(0)
    state["fake_quant_enabled"].fill_(0)
    q.enable_fake_quant(True)
    q.load_state_dict(state)
    assert not bool(q.observer_enabled) and not bool(q.fake_quant_enabled)
    q.enable_observer(True)
    q.enable_fake_quant(True)
    assert bool(q.observer_enabled) and bool(q.fake_quant_enabled)
    q.observer_enabled = torch.tensor(0, dtype=torch.uint8)  # a new buffer object
    q.enable_observer(True)
    assert bool(q.observer_enabled)


def test_switches_are_written_on_a_deepcopied_or_unpickled_quantizer() -> None:
    """The switches' record of their last write vouches for a buffer by its version counter, which a copy does not
    carry (a deepcopied or unpickled buffer starts again at version 1): a copy writes its switches as asked."""
    q = ScaledFakeQuantize(int_spec())
    q.disable_observer()  # version 1, recorded as 0
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["observer_enabled"].fill_(1)
    q.load_state_dict(state)  # version 2, holding 1
    for copy_of in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        c = copy_of(q)
        assert bool(c.observer_enabled)
        c.disable_observer()  # before: taken for the recorded write (version 1, 0) and skipped
        assert not bool(c.observer_enabled)


@pytest.mark.parametrize("spec", [int_spec(), per_channel_spec()], ids=["per_tensor", "per_channel"])
def test_fixed_qparams_follow_writes_that_bypass_the_version_counter(spec: QuantizationSpec) -> None:
    """Writes through ``.data`` bump no version counter: the prepared qparams must still follow them, for a scale
    held in float16 (a model cast with ``.half()`` after calibration: prepared as a float32 copy), an int64 zero
    point, and a ``.data`` assignment of new tensors; and a copy of a quantizer must not reuse its prepared form."""
    y = randn(8, 16, seed=1, scale=1.5)

    def calibrated() -> ScaledFakeQuantize:
        q = ScaledFakeQuantize(spec)
        q(randn(8, 16, seed=0))
        q.disable_observer()
        return q

    def reference(q: ScaledFakeQuantize) -> torch.Tensor:
        return apply_format(y, q.spec, q.scale, q.zero_point)

    q = calibrated()
    q.scale = q.scale.half()
    assert torch.equal(q(y), reference(q))
    q.scale.data.mul_(0.5)
    assert torch.equal(q(y), reference(q))

    q = calibrated()
    q.zero_point = q.zero_point.to(torch.int64)
    assert torch.equal(q(y), reference(q))
    q.zero_point.data.add_(3)
    assert torch.equal(q(y), reference(q))

    q = calibrated()
    assert torch.equal(q(y), reference(q))
    q.scale.data = q.scale.data * 0.5
    assert torch.equal(q(y), reference(q))
    q.zero_point.data = q.zero_point.data + 3
    assert torch.equal(q(y), reference(q))

    q = calibrated()
    q(y)
    c = pickle.loads(pickle.dumps(q))  # (a plain pickle does not keep the prepared views on the buffers' storage)
    c.scale.data.mul_(0.5)
    assert torch.equal(c(y), reference(c))


def test_fixed_qparams_load_under_the_swap_flag() -> None:
    """``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` swaps the buffers'
    tensors (``swap_tensors``, which refuses a tensor that others view): the prepared qparams view detached aliases,
    and follow the swap."""
    q = ScaledFakeQuantize(per_channel_spec())
    q(randn(8, 16, seed=0))
    q.disable_observer()
    y = randn(8, 16, seed=1, scale=1.5)
    q(y)
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["scale"] = state["scale"] / 3
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        q.load_state_dict(state)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert torch.equal(q.scale, state["scale"])
    assert torch.equal(q(y), apply_format(y, q.spec, q.scale, q.zero_point))


def test_switches_follow_a_new_storage_under_the_same_buffer_object() -> None:
    """``.data = t`` and ``load_state_dict(..., assign=True)`` under torch.__future__'s swap flag keep the buffer
    object but give it another storage (and, for the swap, the loaded tensor's version counter): a switch after
    either writes."""
    q = ScaledFakeQuantize(int_spec())
    q.disable_observer()  # version 1, recorded as 0
    state = {k: v.clone() for k, v in q.state_dict().items()}
    state["observer_enabled"].fill_(1)  # version 1 too
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        q.load_state_dict(state, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert bool(q.observer_enabled)
    q.disable_observer()
    assert not bool(q.observer_enabled)
    q.observer_enabled.data = torch.tensor(1, dtype=torch.uint8)
    q.disable_observer()
    assert not bool(q.observer_enabled)
