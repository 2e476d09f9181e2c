"""Observers: Quark's qparam conventions, running vs dynamic statistics, histogram/percentile/MSE calibration and
the TQT threshold initialisers, against closed forms, hand-computed numbers and torch.ao's own observers."""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import pytest
import torch
from specs import int_spec

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, ScaleType, ZeroPointType
from quark.torch.quantization.observer.observer import (
    OBSERVER_MAP,
    PerBlockBFPObserver,
    PerBlockMXObserver,
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorHistogramObserverPro,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
    PlaceholderObserver,
    UniformScalingObserver,
    threshold_3sd,
    threshold_kl_j,
)


def observer(**overrides: Any) -> Any:
    spec = int_spec(**overrides)
    return spec.observer_cls(spec)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mse_of(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, qmin: int, qmax: int) -> float:
    y = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zp), qmin, qmax)
    return float(((y - x) ** 2).mean())


# ----------------------------------------------------------------------------------------------- Quark conventions
def test_symmetric_int8_scale_is_amax_over_127_5() -> None:
    obs = observer()
    obs(torch.tensor([-0.5, 0.25, 1.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(1 / 127.5, rel=1e-7)
    assert scale.item() == pytest.approx(0.00784314, abs=1e-8)
    assert zp.item() == 0
    assert zp.dtype == torch.int32


def test_symmetric_uses_larger_magnitude_of_min() -> None:
    obs = observer()
    obs(torch.tensor([-2.0, 0.5]))
    scale, _ = obs.calculate_qparams()
    assert scale.item() == pytest.approx(2 / 127.5, rel=1e-7)


def test_asymmetric_uint4() -> None:
    obs = observer(dtype=Dtype.uint4, symmetric=False)
    obs(torch.tensor([-1.0, 3.0, 10.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(11 / 15, rel=1e-7)
    assert scale.item() == pytest.approx(0.7333, abs=1e-4)
    assert zp.item() == 1  # 0 - round(-1 / (11/15)) = round(1.364)
    assert zp.dtype == torch.int32


def test_asymmetric_int8_zero_point() -> None:
    obs = observer(symmetric=False)
    obs(torch.tensor([-1.0, 3.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(4 / 255, rel=1e-7)
    assert zp.item() == -128 + round(1 / (4 / 255))  # -128 + 64 = -64


@pytest.mark.parametrize(("dtype", "qmin"), [(Dtype.int8, -128), (Dtype.uint8, 0), (Dtype.uint4, 0), (Dtype.int4, -8)])
def test_range_includes_zero_for_all_positive_data(dtype: Dtype, qmin: int) -> None:
    obs = observer(dtype=dtype, symmetric=False)
    obs(torch.tensor([2.0, 3.5, 5.0]))
    scale, zp = obs.calculate_qparams()
    qmax = qmin + 2 ** (8 if dtype in (Dtype.int8, Dtype.uint8) else 4) - 1
    assert scale.item() == pytest.approx(5.0 / (qmax - qmin), rel=1e-7)  # range [0, 5], not [2, 5]
    assert zp.item() == qmin


def test_range_includes_zero_for_all_negative_data() -> None:
    obs = observer(dtype=Dtype.uint8, symmetric=False)
    obs(torch.tensor([-4.0, -1.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(4 / 255, rel=1e-7)
    assert zp.item() == 255


def test_float32_zero_point_is_unrounded() -> None:
    obs = observer(dtype=Dtype.uint8, symmetric=False, zero_point_type=ZeroPointType.float32)
    obs(torch.tensor([-1.0, 3.0]))
    scale, zp = obs.calculate_qparams()
    assert zp.is_floating_point()
    assert scale.item() == pytest.approx(4 / 255, rel=1e-7)
    assert zp.item() == pytest.approx(0 - (-1.0) / (4 / 255), rel=1e-6)  # 63.75, not 64
    assert zp.item() != round(zp.item())


def test_unsigned_symmetric_zero_point_is_midpoint() -> None:
    obs = observer(dtype=Dtype.uint8)
    obs(torch.tensor([-1.0, 0.5]))
    scale, zp = obs.calculate_qparams()
    assert zp.item() == 128
    assert scale.item() == pytest.approx(1 / 127.5, rel=1e-7)
    obs4 = observer(dtype=Dtype.uint4)
    obs4(torch.tensor([-1.0, 0.5]))
    assert obs4.calculate_qparams()[1].item() == 8


def test_fp8_e4m3_scale_is_amax_over_448() -> None:
    spec = QuantizationSpec(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMinMaxObserver)
    obs = PerTensorMinMaxObserver(spec)
    obs(torch.tensor([-3.5, 1.0, 2.0]))
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(3.5 / 448, rel=1e-7)
    assert zp.item() == 0


def test_fp8_e5m2_scale_is_amax_over_57344() -> None:
    spec = QuantizationSpec(dtype=Dtype.fp8_e5m2, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMinMaxObserver)
    obs = PerTensorMinMaxObserver(spec)
    obs(torch.tensor([-3.5, 7.0]))
    assert obs.calculate_qparams()[0].item() == pytest.approx(7.0 / 57344, rel=1e-7)


@pytest.mark.parametrize("amax", [1.0, 0.3, 5.0, 100.0])
def test_pof2_scale_is_power_of_two(amax: float) -> None:
    obs = observer(scale_type=ScaleType.pof2)
    obs(torch.tensor([-amax / 2, amax]))
    scale = obs.calculate_qparams()[0].item()
    exponent = math.log2(scale)
    assert exponent == round(exponent)
    # nearest power of two to amax / 127.5 (in log domain)
    assert abs(exponent - math.log2(amax / 127.5)) <= 0.5 + 1e-9
    assert scale == 2.0 ** round(math.log2(amax / 127.5))


def test_bfloat16_scale_type_rounds_scale() -> None:
    obs = observer(scale_type=ScaleType.bfloat16)
    obs(torch.tensor([1.0]))
    scale = obs.calculate_qparams()[0]
    assert scale.item() == torch.tensor(1 / 127.5).to(torch.bfloat16).float().item()


def test_calculate_qparams_with_explicit_range() -> None:
    obs = observer(dtype=Dtype.uint8, symmetric=False)
    scale, zp = obs.calculate_qparams(torch.tensor(-2.0), torch.tensor(6.0))
    assert scale.item() == pytest.approx(8 / 255, rel=1e-7)
    assert zp.item() == 64  # 0 - round(-2 / (8/255)) = round(63.75)
    assert obs.min_val.item() == float("inf")  # an explicit range records nothing


def test_no_data_raises_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        observer().calculate_qparams()


# ----------------------------------------------------------------------------------------------- static vs dynamic
def test_static_observer_keeps_running_min_max() -> None:
    obs = observer(symmetric=False, dtype=Dtype.uint8)
    obs(torch.tensor([-1.0, 2.0]))
    obs(torch.tensor([-3.0, 1.0]))
    obs(torch.tensor([0.0, 0.5]))
    assert obs.min_val.item() == -3.0
    assert obs.max_val.item() == 2.0
    scale, zp = obs.calculate_qparams()
    assert scale.item() == pytest.approx(5 / 255, rel=1e-7)
    assert zp.item() == round(3 / (5 / 255))


def test_dynamic_observer_recomputes_per_call() -> None:
    obs = observer(is_dynamic=True)
    obs(torch.tensor([-1.0, 2.0]))
    assert obs.calculate_qparams()[0].item() == pytest.approx(2 / 127.5, rel=1e-7)
    obs(torch.tensor([-0.5, 0.25]))
    assert obs.calculate_qparams()[0].item() == pytest.approx(0.5 / 127.5, rel=1e-7)
    assert obs.min_val.item() == -0.5 and obs.max_val.item() == 0.25


def test_static_per_channel_running_statistics() -> None:
    obs = observer(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0)
    a = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    b = torch.tensor([[0.1, 0.2], [-4.0, 1.0]])
    obs(a)
    obs(b)
    expected = torch.maximum(a.abs().amax(1), b.abs().amax(1)) / 127.5
    torch.testing.assert_close(obs.calculate_qparams()[0], expected, rtol=1e-7, atol=0)


def test_reset_min_max_vals() -> None:
    obs = observer()
    obs(torch.tensor([5.0]))
    obs.reset_min_max_vals()
    obs(torch.tensor([1.0]))
    assert obs.calculate_qparams()[0].item() == pytest.approx(1 / 127.5, rel=1e-7)


def test_forward_returns_input_unchanged() -> None:
    x = torch.randn(4, 8, generator=gen(0))
    for obs in (observer(), observer(qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=1)):
        out = obs(x)
        assert out is x


# ----------------------------------------------------------------------------------------------- per channel / group
@pytest.mark.parametrize("ch_axis", [0, 1, -1])
def test_per_channel_scales(ch_axis: int) -> None:
    w = torch.randn(6, 10, generator=gen(1))
    obs = observer(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=ch_axis)
    obs(w)
    scale, zp = obs.calculate_qparams()
    reduce_dim = 1 if ch_axis == 0 else 0
    expected = w.abs().amax(dim=reduce_dim) / 127.5
    assert scale.shape == expected.shape
    torch.testing.assert_close(scale, expected, rtol=1e-7, atol=0)
    assert torch.equal(zp, torch.zeros_like(zp))


def test_per_channel_4d_weight_and_asymmetric() -> None:
    w = torch.randn(5, 3, 2, 2, generator=gen(2)) + 0.3
    obs = observer(
        dtype=Dtype.uint8, symmetric=False, qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=0
    )
    obs(w)
    scale, zp = obs.calculate_qparams()
    flat = w.reshape(5, -1)
    mn, mx = flat.amin(1).clamp(max=0), flat.amax(1).clamp(min=0)
    expected_scale = (mx - mn) / 255
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(zp, torch.round(-mn / expected_scale).to(torch.int32))


@pytest.mark.parametrize(("dtype", "divisor"), [(Dtype.int8, 127.5), (Dtype.int4, 7.5)])
def test_per_group_scales(dtype: Dtype, divisor: float) -> None:
    rows, cols, group = 6, 96, 32
    w = torch.randn(rows, cols, generator=gen(3))
    obs = observer(
        dtype=dtype, qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=group
    )
    obs(w)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (rows, cols // group)
    expected = w.reshape(rows, cols // group, group).abs().amax(-1) / divisor
    torch.testing.assert_close(scale, expected, rtol=1e-7, atol=0)
    assert zp.shape == scale.shape and not zp.any()


def test_per_group_along_axis_0() -> None:
    w = torch.randn(64, 3, generator=gen(4))
    obs = observer(qscheme=QSchemeType.per_group, observer_cls=PerGroupMinMaxObserver, ch_axis=0, group_size=16)
    obs(w)
    scale, _ = obs.calculate_qparams()
    expected = w.t().reshape(3, 4, 16).abs().amax(-1) / 127.5
    assert scale.shape == (3, 4)
    torch.testing.assert_close(scale, expected, rtol=1e-7, atol=0)


# ----------------------------------------------------------------------------------------------- NaN / Inf / constants
def _all_observers() -> list[Any]:
    return [
        observer(),
        observer(qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=0),
        observer(qscheme="per_group", observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=4),
        observer(observer_cls=PerTensorHistogramObserver),
        observer(observer_cls=PerTensorHistogramObserverPro),
        observer(observer_cls=PerTensorPercentileObserver),
        observer(observer_cls=PerTensorMSEObserver),
        observer(observer_cls=PerTensorMSEObserver, symmetric=False, dtype=Dtype.uint8),
        observer(is_dynamic=True),
        PerBlockMXObserver(QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, group_size=4)),
        PerBlockBFPObserver(QuantizationSpec(dtype=Dtype.bfp16, group_size=4)),
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("index", range(11))
def test_nan_or_inf_raises_value_error(bad: float, index: int) -> None:
    obs = _all_observers()[index]
    x = torch.randn(4, 8, generator=gen(5))
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN"):
        obs(x)


@pytest.mark.parametrize("value", [0.0, 3.0, -2.0])
@pytest.mark.parametrize("index", range(11))
def test_constant_tensor_gives_finite_positive_scale(value: float, index: int) -> None:
    obs = _all_observers()[index]
    obs(torch.full((4, 8), value))
    scale, zp = obs.calculate_qparams()
    assert torch.isfinite(scale).all()
    assert (scale > 0).all()
    assert torch.isfinite(zp.float()).all()


def test_constant_tensor_symmetric_scale_value() -> None:
    obs = observer()
    obs(torch.full((3,), 3.0))
    assert obs.calculate_qparams()[0].item() == pytest.approx(3 / 127.5, rel=1e-7)
    zero = observer()
    zero(torch.zeros(3))
    assert zero.calculate_qparams()[0].item() == pytest.approx(torch.finfo(torch.float32).eps)


# ----------------------------------------------------------------------------------------------- histogram pro
@pytest.mark.parametrize(
    ("dtype", "symmetric", "torch_dtype", "torch_qscheme", "qmin", "qmax"),
    [
        (Dtype.int8, True, torch.qint8, torch.per_tensor_symmetric, -128, 127),
        (Dtype.uint8, False, torch.quint8, torch.per_tensor_affine, 0, 255),
        (Dtype.int8, False, torch.qint8, torch.per_tensor_affine, -128, 127),
        (Dtype.int4, True, torch.qint8, torch.per_tensor_symmetric, -8, 7),
        (Dtype.uint4, False, torch.quint8, torch.per_tensor_affine, 0, 15),
    ],
)
def test_histogram_pro_matches_torch_histogram_observer(
    dtype: Dtype, symmetric: bool, torch_dtype: torch.dtype, torch_qscheme: torch.qscheme, qmin: int, qmax: int
) -> None:
    g = gen(6)
    batches = [
        torch.randn(2000, generator=g) * 2 + 0.7,
        torch.randn(2000, generator=g) * 3 - 0.2,
        torch.rand(500, generator=g) * 9,
    ]
    ours = observer(dtype=dtype, symmetric=symmetric, observer_cls=PerTensorHistogramObserverPro)
    ref = torch.ao.quantization.HistogramObserver(
        bins=256, dtype=torch_dtype, qscheme=torch_qscheme, quant_min=qmin, quant_max=qmax
    )
    for b in batches:
        ours(b)
        ref(b)
    scale, zp = ours.calculate_qparams()
    ref_scale, ref_zp = ref.calculate_qparams()
    torch.testing.assert_close(scale.reshape(-1), ref_scale.reshape(-1).float(), rtol=1e-6, atol=0)
    assert int(zp) == int(ref_zp)
    # and it is not the min-max answer: the histogram search narrows the range
    minmax = observer(dtype=dtype, symmetric=symmetric)
    for b in batches:
        minmax(b)
    assert scale.item() < minmax.calculate_qparams()[0].item()


def test_dynamic_histogram_pro_recomputes_per_call() -> None:
    g = gen(25)
    first, second = torch.randn(3000, generator=g) * 50, torch.randn(3000, generator=g)
    ours = observer(observer_cls=PerTensorHistogramObserverPro, is_dynamic=True)
    ours(first)
    ours(second)
    ref = torch.ao.quantization.HistogramObserver(bins=256, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    ref(second)  # a dynamic observer sees only the last call
    torch.testing.assert_close(
        ours.calculate_qparams()[0].reshape(-1), ref.calculate_qparams()[0].reshape(-1), rtol=1e-6, atol=0
    )


def test_histogram_pro_rejects_wide_integers() -> None:
    spec = int_spec(dtype=Dtype.int16, observer_cls=PerTensorMinMaxObserver)
    with pytest.raises(ValueError):
        PerTensorHistogramObserverPro(spec)


# ----------------------------------------------------------------------------------------------- percentile
def test_percentile_signature() -> None:
    params = list(inspect.signature(PerTensorPercentileObserver.get_min_max_by_percentile).parameters)
    assert params == ["self", "histogram", "bin_edges", "percentile"]


@pytest.mark.parametrize("percentile", [-0.1, 100.5, 1000])
def test_percentile_out_of_range_raises(percentile: float) -> None:
    obs = observer(observer_cls=PerTensorPercentileObserver)
    hist = torch.ones(10)
    edges = torch.linspace(0, 10, 11)
    with pytest.raises(ValueError):
        obs.get_min_max_by_percentile(hist, edges, percentile)


def test_percentile_on_hand_made_histograms() -> None:
    obs = observer(observer_cls=PerTensorPercentileObserver)
    # magnitudes: 100 unit bins of one count each over [0, 100]
    mn, mx = obs.get_min_max_by_percentile(torch.ones(100), torch.linspace(0, 100, 101), 50)
    assert mn.item() == 0
    assert mx.item() == pytest.approx(50.0, abs=1e-4)
    _, mx = obs.get_min_max_by_percentile(torch.ones(100), torch.linspace(0, 100, 101), 100)
    assert mx.item() == pytest.approx(100.0, abs=1e-4)
    # signed: 100 unit bins over [-50, 50]; 90% in the middle leaves 5% in each tail
    mn, mx = obs.get_min_max_by_percentile(torch.ones(100), torch.linspace(-50, 50, 101), 90)
    assert mn.item() == pytest.approx(-45.0, abs=1e-4)
    assert mx.item() == pytest.approx(45.0, abs=1e-4)
    # all the mass in one bin [3, 4] of [0, 10]: any percentile lands in it
    hist = torch.zeros(10)
    hist[3] = 7
    _, mx = obs.get_min_max_by_percentile(hist, torch.linspace(0, 10, 11), 99)
    assert 3.0 <= mx.item() <= 4.0


def test_percentile_observer_constructor_rejects_bad_percentile() -> None:
    with pytest.raises(ValueError):
        PerTensorPercentileObserver(int_spec(observer_cls=PerTensorPercentileObserver), percentile=120)


def test_default_percentile_clips_a_rare_outlier() -> None:
    x = torch.cat([torch.randn(100_000, generator=gen(7)), torch.tensor([1000.0])])
    obs = observer(observer_cls=PerTensorPercentileObserver)
    obs(x)
    scale, zp = obs.calculate_qparams()
    observed_max = scale.item() * 127.5
    assert observed_max < 10.0
    assert observed_max > 2.5  # still covers the Gaussian bulk (99.99% of |N(0,1)| lies below ~3.9)
    assert zp.item() == 0
    minmax = observer()
    minmax(x)
    assert minmax.calculate_qparams()[0].item() * 127.5 == pytest.approx(1000.0)


def test_percentile_100_is_the_maximum() -> None:
    x = torch.randn(10_000, generator=gen(8))
    obs = PerTensorPercentileObserver(int_spec(observer_cls=PerTensorPercentileObserver), percentile=100)
    obs(x)
    assert obs.calculate_qparams()[0].item() * 127.5 == pytest.approx(x.abs().max().item(), rel=1e-5)


def test_percentile_asymmetric_uses_both_tails() -> None:
    x = torch.cat([torch.rand(100_000, generator=gen(9)) * 4 - 1, torch.tensor([-500.0, 800.0])])  # U(-1, 3) + outliers
    obs = observer(observer_cls=PerTensorPercentileObserver, dtype=Dtype.uint8, symmetric=False)
    obs(x)
    scale, zp = obs.calculate_qparams()
    lo = -zp.item() * scale.item()
    hi = lo + 255 * scale.item()
    assert -1.2 < lo < -0.8
    assert 2.8 < hi < 3.2


@pytest.mark.parametrize("symmetric", [True, False])
def test_histogram_merges_when_later_batches_exceed_range(symmetric: bool) -> None:
    g = gen(10)
    a = torch.randn(5000, generator=g)
    b = torch.randn(5000, generator=g) * 13  # far outside the first batch's range
    c = torch.randn(3000, generator=g) * 0.1
    obs = observer(observer_cls=PerTensorPercentileObserver, symmetric=symmetric)
    obs(a)
    first_range = float(obs.calib_range)
    obs(b)
    obs(c)
    hist, edges = obs.histogram()
    all_x = torch.cat([a, b, c])
    assert hist.sum().item() == float((all_x != 0).sum())  # no count lost or duplicated
    r = float(obs.calib_range)
    assert r >= all_x.abs().max().item()
    assert math.log2(r / first_range) == round(math.log2(r / first_range))  # widened by powers of two
    # the merged histogram is the histogram of all data over the final range, up to elements on bin edges
    if symmetric:
        ref = torch.histc(all_x.abs(), obs.num_bins, 0, r)
    else:
        ref = torch.histc(all_x, 2 * obs.num_bins, -r, r)
    assert edges[0].item() == pytest.approx(0.0 if symmetric else -r)
    assert edges[-1].item() == pytest.approx(r)
    assert (ref.double() - hist).abs().sum().item() <= 0.005 * all_x.numel()


def test_histogram_observer_min_max_qparams() -> None:
    x = torch.randn(1000, generator=gen(11))
    obs = observer(observer_cls=PerTensorHistogramObserver)
    obs(x)
    assert obs.calculate_qparams()[0].item() == pytest.approx(x.abs().max().item() / 127.5, rel=1e-6)


def test_dynamic_histogram_forgets_previous_batches() -> None:
    obs = observer(observer_cls=PerTensorPercentileObserver, is_dynamic=True)
    obs(torch.randn(1000, generator=gen(12)) * 100)
    obs(torch.randn(1000, generator=gen(13)))
    hist, _ = obs.histogram()
    assert hist.sum().item() == 1000
    assert obs.calculate_qparams()[0].item() * 127.5 < 5


# ----------------------------------------------------------------------------------------------- MSE
def test_mse_signature() -> None:
    sig = inspect.signature(PerTensorMSEObserver.get_min_max_by_mse)
    assert list(sig.parameters) == ["self", "calib_hist", "calib_bin_edges", "stride", "start_bin"]
    assert sig.parameters["stride"].default == 1
    assert sig.parameters["start_bin"].default == 2045


@pytest.mark.parametrize(("dtype", "qmin", "qmax"), [(Dtype.int8, -128, 127), (Dtype.int4, -8, 7)])
def test_mse_observer_beats_min_max_on_heavy_tails(dtype: Dtype, qmin: int, qmax: int) -> None:
    torch.manual_seed(0)
    x = torch.distributions.StudentT(3.0).sample((200_000,))
    mse_obs = observer(dtype=dtype, observer_cls=PerTensorMSEObserver)
    minmax_obs = observer(dtype=dtype)
    mse_obs(x)
    minmax_obs(x)
    err_mse = mse_of(x, *mse_obs.calculate_qparams(), qmin, qmax)
    err_minmax = mse_of(x, *minmax_obs.calculate_qparams(), qmin, qmax)
    assert err_mse < err_minmax
    assert mse_obs.calculate_qparams()[0].item() < minmax_obs.calculate_qparams()[0].item()


def test_mse_observer_keeps_full_range_on_uniform_data() -> None:
    x = torch.rand(50_000, generator=gen(14)) * 2 - 1
    obs = observer(observer_cls=PerTensorMSEObserver)
    obs(x)
    # clipping uniform data only adds error: the range stays close to the maximum
    assert obs.calculate_qparams()[0].item() * 127.5 == pytest.approx(1.0, abs=0.02)


def test_get_min_max_by_mse_default_arguments_search_top_bins() -> None:
    obs = observer(observer_cls=PerTensorMSEObserver)
    hist = torch.zeros(2048)
    hist[:1000] = 1.0
    edges = torch.linspace(0, 2048, 2049)
    mn, mx = obs.get_min_max_by_mse(hist, edges)  # stride 1 from bin 2045: candidates end at 2046..2048
    assert mn.item() == 0
    assert mx.item() in (2046.0, 2047.0, 2048.0)


def test_mse_asymmetric_observer() -> None:
    torch.manual_seed(1)
    x = torch.distributions.StudentT(3.0).sample((100_000,)) + 1.0
    mse_obs = observer(dtype=Dtype.uint8, symmetric=False, observer_cls=PerTensorMSEObserver)
    minmax_obs = observer(dtype=Dtype.uint8, symmetric=False)
    mse_obs(x)
    minmax_obs(x)
    assert mse_of(x, *mse_obs.calculate_qparams(), 0, 255) < mse_of(x, *minmax_obs.calculate_qparams(), 0, 255)


# ----------------------------------------------------------------------------------------------- TQT initialisers
def test_threshold_3sd_gaussian() -> None:
    x = torch.randn(200_000, generator=gen(15))
    t = threshold_3sd(x)
    assert abs(t.item() - 3.0) < 0.05
    # |mean| + 3 * population std (Quark's numpy np.std, ddof=0), in float64
    xd = x.double().numpy()
    closed = abs(np.mean(xd)) + 3 * np.std(xd)
    assert t.item() == pytest.approx(closed, rel=1e-6)
    assert torch.equal(t, x.mean().abs() + 3 * x.std(correction=0))


def test_threshold_3sd_shifted() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, population std sqrt(3.5)
    assert threshold_3sd(x).item() == pytest.approx(3 + 3 * math.sqrt(3.5), rel=1e-6)
    assert threshold_3sd(-x).item() == pytest.approx(3 + 3 * math.sqrt(3.5), rel=1e-6)


def test_threshold_kl_j_uniform() -> None:
    x = torch.rand(100_000, generator=gen(16)) * 2 - 1
    assert threshold_kl_j(x, 8).item() == pytest.approx(1.0, rel=0.02)
    assert threshold_kl_j(x, 4).item() == pytest.approx(1.0, rel=0.02)


def test_threshold_kl_j_gaussian() -> None:
    x = torch.randn(100_000, generator=gen(17))
    t = threshold_kl_j(x, 8).item()
    assert 2.5 < t < 5.0
    assert t < x.abs().max().item()


def test_threshold_kl_j_ignores_a_far_outlier() -> None:
    x = torch.cat([torch.randn(100_000, generator=gen(18)), torch.tensor([100.0])])
    t = threshold_kl_j(x, 4).item()
    assert t < 10.0  # far below the outlier ...
    assert t > 1.0  # ... and still covering the bulk


def test_threshold_kl_j_outlier_8_bits_below_outlier() -> None:
    x = torch.cat([torch.randn(100_000, generator=gen(19)), torch.tensor([1000.0])])
    assert threshold_kl_j(x, 8).item() < 500.0
    # with a finer histogram the 8-bit search resolves further below
    assert threshold_kl_j(x, 8, bins=2048).item() < 100.0


def test_threshold_kl_j_zero_tensor() -> None:
    assert threshold_kl_j(torch.zeros(10), 8).item() == 0.0


# ----------------------------------------------------------------------------------------------- block observers
def test_mx_observer_block_maxima_and_pof2_scales() -> None:
    x = torch.randn(4, 64, generator=gen(20)) * 3
    spec = QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, group_size=32, ch_axis=-1)
    obs = PerBlockMXObserver(spec)
    obs(x)
    amax = x.reshape(4, 2, 32).abs().amax(-1)
    assert torch.equal(obs.amax, amax)
    scale, zp = obs.calculate_qparams()
    assert scale.shape == (4, 2)
    assert not zp.any()
    log2 = torch.log2(scale)
    assert torch.equal(log2, torch.round(log2))  # powers of two
    # OCP MX: 2^(floor(log2 amax) - emax_elem), emax of fp4 (e2m1, max 6) is 2
    expected = torch.tensor([[2.0 ** (math.floor(math.log2(a)) - 2) for a in row] for row in amax.tolist()])
    assert torch.equal(scale, expected)


def test_mx_fp8_observer_scale() -> None:
    x = torch.tensor([[0.5, -3.0, 1.0, 2.0]])
    obs = PerBlockMXObserver(QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp8_e4m3, group_size=4))
    obs(x)
    # floor(log2 3) = 1; emax of e4m3 (max 448 = 1.75 * 2^8) is 8
    assert obs.calculate_qparams()[0].item() == 2.0 ** (1 - 8)


def test_mx_observer_static_vs_dynamic() -> None:
    spec_static = QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, group_size=2, is_dynamic=False)
    spec_dynamic = QuantizationSpec(dtype=Dtype.mx, mx_element_dtype=Dtype.fp4, group_size=2, is_dynamic=True)
    static, dynamic = PerBlockMXObserver(spec_static), PerBlockMXObserver(spec_dynamic)
    for obs in (static, dynamic):
        obs(torch.tensor([[4.0, 1.0, -0.5, 0.25]]))
        obs(torch.tensor([[1.0, 1.0, 8.0, 0.25]]))
    assert torch.equal(static.amax, torch.tensor([[4.0, 8.0]]))
    assert torch.equal(dynamic.amax, torch.tensor([[1.0, 8.0]]))


def test_bfp_observer_block_maxima_and_pof2_scales() -> None:
    x = torch.randn(3, 16, generator=gen(21)) * 5
    obs = PerBlockBFPObserver(QuantizationSpec(dtype=Dtype.bfp16, group_size=8))
    obs(x)
    amax = x.reshape(3, 2, 8).abs().amax(-1)
    assert torch.equal(obs.amax, amax)
    scale, _ = obs.calculate_qparams()
    # BFP16: 8-bit two's complement mantissas, step 2^(floor(log2 amax) - 6)
    expected = torch.tensor([[2.0 ** (math.floor(math.log2(a)) - 6) for a in row] for row in amax.tolist()])
    assert torch.equal(scale, expected)
    # the block maximum fits the 8-bit mantissa with that step
    assert ((amax / scale) < 128).all() and ((amax / scale) >= 64).all()


def test_placeholder_observer_passes_through() -> None:
    obs = PlaceholderObserver(QuantizationSpec(dtype=Dtype.bfloat16))
    x = torch.randn(3)
    assert obs(x) is x
    assert "bfloat16" in repr(obs)


# ----------------------------------------------------------------------------------------------- state_dict
def test_per_channel_state_dict_loads_into_fresh_observer() -> None:
    spec = int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0, symmetric=False)
    calibrated = PerChannelMinMaxObserver(spec)
    calibrated(torch.randn(7, 5, generator=gen(22)))
    state = calibrated.state_dict()
    assert state["min_val"].shape == (7,)
    fresh = PerChannelMinMaxObserver(spec)
    assert fresh.min_val.shape == ()
    fresh.load_state_dict(state)
    assert fresh.min_val.shape == (7,) and fresh.max_val.shape == (7,)
    s1, z1 = calibrated.calculate_qparams()
    s2, z2 = fresh.calculate_qparams()
    assert torch.equal(s1, s2) and torch.equal(z1, z2)
    # and it keeps accumulating from the loaded statistics
    extra = torch.full((7, 5), 10.0)
    calibrated(extra)
    fresh(extra)
    assert torch.equal(calibrated.calculate_qparams()[0], fresh.calculate_qparams()[0])


def test_per_group_and_histogram_state_dicts_load() -> None:
    spec = int_spec(qscheme="per_group", observer_cls=PerGroupMinMaxObserver, ch_axis=1, group_size=4)
    a = PerGroupMinMaxObserver(spec)
    a(torch.randn(3, 8, generator=gen(23)))
    b = PerGroupMinMaxObserver(spec)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.calculate_qparams()[0], b.calculate_qparams()[0])
    hspec = int_spec(observer_cls=PerTensorPercentileObserver)
    h1 = PerTensorPercentileObserver(hspec)
    h1(torch.randn(5000, generator=gen(24)))
    h2 = PerTensorPercentileObserver(hspec)
    h2.load_state_dict(h1.state_dict())
    assert torch.equal(h1.calculate_qparams()[0], h2.calculate_qparams()[0])


def test_observer_map_covers_documented_observers() -> None:
    documented = {
        "ObserverBase",
        "PlaceholderObserver",
        "UniformScalingObserver",
        "PerTensorMinMaxObserver",
        "PerChannelMinMaxObserver",
        "PerBlockMXObserver",
        "PerBlockBFPObserver",
        "PerGroupMinMaxObserver",
        "PerTensorHistogramObserver",
        "PerTensorHistogramObserverPro",
        "PerTensorPercentileObserver",
        "PerTensorMSEObserver",
    }
    assert documented <= set(OBSERVER_MAP)
    assert issubclass(PerTensorMinMaxObserver, UniformScalingObserver)
    assert issubclass(PerChannelMinMaxObserver, UniformScalingObserver)


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (PlaceholderObserver, {}),
        (PerTensorMinMaxObserver, {}),
        (UniformScalingObserver, {"eps": torch.finfo(torch.float32).eps}),
        (PerChannelMinMaxObserver, {"eps": torch.finfo(torch.float32).eps}),
        (PerGroupMinMaxObserver, {"eps": torch.finfo(torch.float32).eps}),
        (PerBlockMXObserver, {"eps": torch.finfo(torch.float32).eps}),
        (PerBlockBFPObserver, {"eps": torch.finfo(torch.float32).eps}),
        (PerTensorHistogramObserver, {}),
        (PerTensorHistogramObserverPro, {"bins": 256, "reduce_range": False, "upsample_rate": 384}),
        (PerTensorPercentileObserver, {}),
        (PerTensorMSEObserver, {}),
    ],
)
def test_documented_constructor_signatures(cls: type, extra: dict[str, Any]) -> None:
    params = inspect.signature(cls.__init__).parameters
    names = list(params)
    assert names[:3] == ["self", "qspec", "device"]
    assert params["device"].default is None
    for name, default in extra.items():
        assert params[name].default == default, name


def test_bfp_observer_reports_the_step_the_format_uses_when_a_code_overflows() -> None:
    """127.6 / 2^0 rounds to 128, which int8 cannot hold: BFP16 doubles that block's step, and so must the observer."""
    from quark.torch.quantization.formats import fake_quantize_bfp16

    x = torch.tensor([[127.6, 1.0, 0, 0, 0, 0, 0, 0, 3.0, 2.0, 1.0, 0, 0, 0, 0, 0]])
    obs = PerBlockBFPObserver(QuantizationSpec(dtype="bfp16"))
    obs(x)
    scale, _ = obs.calculate_qparams()
    assert scale.tolist() == [[2.0, 2.0**-5]]
    # the format's output sits on exactly that grid: 127.6 -> 128 (step 2), 3 -> 3 (step 1/32)
    out = fake_quantize_bfp16(x)
    assert out[0, 0].item() == 128.0 and out[0, 8].item() == 3.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32])
def test_the_finite_check_agrees_with_torchs_isfinite(dtype: torch.dtype) -> None:
    """``all_finite`` (one ``aminmax``) against ``torch.isfinite(v).all()`` on tensors of 0-4096 values holding NaN,
    +-inf, the dtype's extremes, -0.0 and subnormals in every position, one or several at a time."""
    from quark.torch.quantization.observer.base import all_finite

    gen = torch.Generator().manual_seed(0)
    floating = dtype.is_floating_point
    specials = [math.nan, math.inf, -math.inf] if floating else []
    edges = [torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny / 2, -0.0] if floating else []
    checked = bad = 0
    for numel in (0, 1, 2, 3, 31, 32, 257, 4096):
        base = (torch.randn(numel, generator=gen) * 100).to(dtype)
        cases = [base]
        for value in specials + edges:
            for index in {0, numel // 2, numel - 1} if numel else ():
                case = base.clone()
                case[index] = value
                cases.append(case)
        if numel > 3 and floating:
            mixed = base.clone()
            mixed[1], mixed[-2] = math.nan, math.inf
            cases += [mixed, mixed[::2], torch.full((numel,), math.nan, dtype=dtype)]  # (a strided view too)
        for case in cases:
            expected = bool(torch.isfinite(case).all())
            assert all_finite(case) is expected, (numel, case)
            checked += 1
            bad += not expected
    assert (checked > 40 and bad > 20) if floating else (checked == 8 and bad == 0)
