"""Observers reset together (``reset_observers`` / ``ObserverResets``, QAT's per-batch weight reset): the same
statistics and qparams as each observer's own ``reset_state()``, written in place into the same tensors, and
observers whose reset does more (power-of-two records, inference buffers) or whose buffers were rebound since the
last call still reset correctly."""

from __future__ import annotations

import math

import torch
from specs import int_spec

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.observer import (
    ObserverResets,
    PerChannelMinMaxObserver,
    PerChannelPowOf2MinMaxObserver,
    PerTensorHistogramObserver,
    PerTensorHistogramObserverPro,
    PerTensorMinMaxObserver,
    PerTensorMSEObserver,
    PerTensorPercentileObserver,
    reset_observers,
)


def _observers() -> list:
    """A per-tensor int8, a per-channel int8, a per-tensor fp8 and a power-of-two per-channel observer, then the
    histogram family (their resets do more than fills)."""
    per_tensor = int_spec()
    per_channel = int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelMinMaxObserver, ch_axis=0)
    fp8 = QuantizationSpec(dtype=Dtype.fp8_e4m3, qscheme=QSchemeType.per_tensor, observer_cls=PerTensorMinMaxObserver)
    pow2 = int_spec(qscheme=QSchemeType.per_channel, observer_cls=PerChannelPowOf2MinMaxObserver, ch_axis=0)
    histograms = [
        int_spec(observer_cls=cls)
        for cls in (
            PerTensorHistogramObserver,
            PerTensorHistogramObserverPro,
            PerTensorPercentileObserver,
            PerTensorMSEObserver,
        )
    ]
    return [spec.observer_cls(spec) for spec in (per_tensor, per_channel, fp8, pow2, *histograms)]


def _batches(seed: int, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(6, 10, generator=g) * (i + 1) for i in range(n)]


def test_reset_together_gives_each_observers_own_reset() -> None:
    """Observing a batch after each reset gives the qparams of that batch alone, as ``reset_state()`` does, and
    the running statistics of the batches before are gone (a larger earlier batch would widen the range)."""
    together, alone = _observers(), _observers()
    resets = ObserverResets(together)
    for x in reversed(_batches(0)):  # largest first: a reset that left the running range (or histogram) would keep it
        resets()
        for obs in alone:
            obs.reset_state()
        for a, b in zip(together, alone, strict=True):
            a(x)
            b(x)
            for qa, qb in zip(a.calculate_qparams(), b.calculate_qparams(), strict=True):
                assert torch.equal(qa, qb), type(a).__name__
            fresh = type(a)(a.qspec)
            fresh(x)
            assert torch.equal(a.calculate_qparams()[0], fresh.calculate_qparams()[0]), type(a).__name__


def test_min_max_statistics_are_filled_in_their_own_tensors() -> None:
    """Per-tensor (0-dim) and per-channel statistics keep their tensors, so a quantizer's fused pass and its
    kernels keep serving them; after the reset they hold no statistics."""
    observers = _observers()[:3]
    for obs in observers:
        obs(_batches(1)[0])
    held = [(obs.min_val, obs.max_val) for obs in observers]
    reset_observers(observers)
    for obs, (mn, mx) in zip(observers, held, strict=True):
        assert obs.min_val is mn and obs.max_val is mx
        assert not obs.has_statistics
        assert bool((mn == math.inf).all()) and bool((mx == -math.inf).all())
    assert observers[0].min_val.shape == () and observers[1].min_val.shape == (6,)


def test_statistics_that_require_grad_are_reset_too() -> None:
    """A statistic loaded as a tensor that requires grad (``load_state_dict(assign=True)``) is filled as
    ``reset_state()`` fills it, not refused as an in-place write to a leaf."""
    obs = _observers()[0]
    obs(_batches(5)[0])
    obs.min_val.requires_grad_(True)
    reset_observers([obs])
    assert not obs.has_statistics


def test_an_observer_whose_reset_does_more_is_reset_by_its_own_method() -> None:
    """The power-of-two observer also forgets its records (a fill of the statistics alone would keep them)."""
    pow2 = _observers()[3]
    pow2(_batches(2)[0] * 100)
    assert pow2.records
    reset_observers([pow2])
    assert pow2.records == [] and not pow2.has_statistics


def test_rebound_buffers_are_gathered_again() -> None:
    """A per-channel observer's first batch rebinds its scalar placeholder to a [C] tensor, and a loaded
    state_dict or a buffer made under inference mode can rebind it too: the next call resets the new tensors."""
    obs = _observers()[1]
    resets = ObserverResets([obs])
    resets()  # gathered while the statistics are the scalar placeholder
    x = _batches(3)[0]
    obs(x)
    assert obs.min_val.shape == (6,) and obs.has_statistics
    resets()
    assert not obs.has_statistics
    with torch.inference_mode():
        obs.min_val, obs.max_val = torch.zeros(6), torch.ones(6)  # inference tensors: cannot be written in place
    resets()
    assert not obs.has_statistics and not obs.min_val.is_inference()
    obs(x)
    fresh = PerChannelMinMaxObserver(obs.qspec)
    fresh(x)
    assert torch.equal(obs.calculate_qparams()[0], fresh.calculate_qparams()[0])


def test_a_buffer_given_other_storage_in_place_is_gathered_again() -> None:
    """``.data =`` (and ``swap_tensors``) keep the tensor object but not its storage or shape: the next call fills
    the buffer as it is now, not through sources of its old shape."""
    obs = _observers()[1]
    obs(_batches(6)[0])  # [6] statistics
    resets = ObserverResets([obs])
    resets()
    with torch.no_grad():
        obs.min_val.data = torch.zeros(4)
        obs.max_val.data = torch.ones(4)
    resets()
    assert obs.min_val.shape == (4,) and not obs.has_statistics and bool((obs.max_val == -math.inf).all())


def test_the_torch_histogram_wrapper_forgets_its_histogram() -> None:
    """``PerTensorHistogramObserverPro``'s qparams come from torch's HistogramObserver inside it: a reset that left
    that histogram kept every earlier batch's range (a QAT weight observer then never followed its weight)."""
    spec = int_spec(observer_cls=PerTensorHistogramObserverPro)
    obs, fresh = spec.observer_cls(spec), spec.observer_cls(spec)
    wide, narrow = _batches(7, 2)[1] * 10, _batches(8, 1)[0]
    obs(wide)
    obs.reset_state()
    obs(narrow)
    fresh(narrow)
    assert torch.equal(obs.calculate_qparams()[0], fresh.calculate_qparams()[0])
