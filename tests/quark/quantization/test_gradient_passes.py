"""The fused observe-and-quantize pass skips its backward where the whole input lies inside the format's range
(``formats.gradient_passes`` on the folded statistics): the gradient is then the incoming one, and the input is not
kept. The decision must be exact: True only where the straight-through mask is all ones, checked here against torch's
own fake-quant kernel (int8), against the step-by-step path at a range end that lands an ulp past fp8's largest
value, and on the saved tensors (nothing kept where the backward is skipped)."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.formats import gradient_passes
from quark.torch.quantization.observer.observer import PerChannelMinMaxObserver, PerTensorMinMaxObserver
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase


def _torch_mask(x: torch.Tensor, scale: float, zero_point: int, qmin: int, qmax: int) -> torch.Tensor:
    """torch's own straight-through mask: the gradient of its fused per-tensor fake-quant kernel for ones."""
    x = x.clone().requires_grad_()
    torch.fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax).sum().backward()
    return x.grad


@pytest.mark.parametrize("qmin,qmax,symmetric", [(-128, 127, True), (0, 255, False)])
def test_int8_decision_agrees_with_torch_fake_quant(qmin: int, qmax: int, symmetric: bool) -> None:
    """For ranges of every kind (a symmetric range's positive end on 127.5 steps, which rounds past 127; ends inside;
    asymmetric ranges), ``gradient_passes`` on the two ends is True exactly where torch's mask is 1 at both, and then
    torch's mask is 1 at every value between them too."""
    gen = torch.Generator().manual_seed(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        lo, hi = sorted((torch.randn(2, generator=gen) * 3).tolist())
        if symmetric:
            amax = max(-lo, hi)
            scale = torch.tensor(amax / ((qmax - qmin) / 2), dtype=torch.float32)
            zp = torch.tensor(0, dtype=torch.int32)
        else:  # a range away from 0 clamps its zero point, and its far end then maps past the codes
            scale = torch.tensor((hi - lo) / (qmax - qmin), dtype=torch.float32)
            zp = torch.tensor(int(qmin - round(lo / float(scale))), dtype=torch.int32).clamp(qmin, qmax)
        ends = torch.tensor([lo, hi], dtype=torch.float32)
        passes = bool(gradient_passes(ends, Dtype.uint8 if qmin == 0 else Dtype.int8, scale, zp, RoundType.half_even))
        reference = _torch_mask(ends, float(scale), int(zp), qmin, qmax)
        assert passes == bool((reference == 1).all()), (lo, hi, float(scale), int(zp))
        if passes:
            between = torch.empty(4096).uniform_(lo, hi, generator=gen)
            assert bool((_torch_mask(between, float(scale), int(zp), qmin, qmax) == 1).all())
        seen[passes] += 1
    assert seen[True] > 20 and seen[False] > 20, seen  # both answers were tested


def _quantizer(dtype: Dtype, qscheme: QSchemeType) -> FakeQuantizeBase:
    kw: dict = {"ch_axis": 0} if qscheme == QSchemeType.per_channel else {}
    if dtype == Dtype.int8:
        kw.update(scale_type=ScaleType.float, round_method=RoundType.half_even, symmetric=True)
    observer = PerChannelMinMaxObserver if qscheme == QSchemeType.per_channel else PerTensorMinMaxObserver
    spec = QuantizationSpec(dtype=dtype, qscheme=qscheme, observer_cls=observer, is_dynamic=False, **kw)
    return FakeQuantizeBase.get_fake_quantize(spec)


def _fused_and_plain(
    dtype: Dtype, qscheme: QSchemeType, xs: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[torch.Tensor, int]], list[torch.Tensor]]:
    """(gradient, tensors the backward kept) per batch through the fused pass; the step-by-step path's gradients."""
    import quark.torch.quantization.tensor_quantize as tq

    upstream = [torch.linspace(-2, 2, x.numel()).reshape(x.shape) for x in xs]
    fused, plain = [], []
    fq = _quantizer(dtype, qscheme)
    for x, g in zip(xs, upstream, strict=True):
        x = x.clone().requires_grad_()
        y = fq(x)
        kept = len(y.grad_fn.saved_tensors)
        y.backward(g)
        fused.append((x.grad, kept))
    with monkeypatch.context() as m:
        m.setattr(tq, "fused_pass_active", lambda x: False)
        fq = _quantizer(dtype, qscheme)
        for x, g in zip(xs, upstream, strict=True):
            x = x.clone().requires_grad_()
            fq(x).backward(g)
            plain.append(x.grad)
    return fused, plain


def test_fp8_range_end_an_ulp_past_448_takes_the_backward(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """scale = amax / 448 maps amax onto 448 or an ulp past it. Past it, the step-by-step path's mask drops amax's
    gradient, so the fused pass must run its backward there; an amax landing on 448 skips it. Both match the
    step-by-step path bit for bit."""
    past = next(a for a in (torch.rand(10000, generator=torch.Generator().manual_seed(1)) + 0.5) if a / (a / 448) > 448)
    on = next(a for a in (torch.rand(10000, generator=torch.Generator().manual_seed(2)) + 0.5) if a / (a / 448) <= 448)
    xs = []
    for amax in (past, on):
        x = torch.randn(96, 128, generator=torch.Generator().manual_seed(3)).clamp(-0.4, 0.4)
        x[7, 9] = amax
        xs.append(x)
    # a second quantizer per amax: running statistics would carry the first batch's range into the second
    (past_fused,), (past_plain,) = _fused_and_plain(Dtype.fp8_e4m3, QSchemeType.per_tensor, xs[:1], monkeypatch)
    (on_fused,), (on_plain,) = _fused_and_plain(Dtype.fp8_e4m3, QSchemeType.per_tensor, xs[1:], monkeypatch)
    assert past_plain[7, 9] == 0 and torch.equal(past_fused[0], past_plain) and past_fused[1] == 3
    assert on_plain[7, 9] != 0 and torch.equal(on_fused[0], on_plain) and on_fused[1] == 0


def test_the_backward_is_skipped_only_where_nothing_clips(compiled: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 per tensor, a range growing over batches: inputs inside keep nothing for the backward and get the
    incoming gradient. int8 per channel, symmetric: each row's positive extreme lands on 127.5 and clips, so every
    batch keeps its input. Gradients equal the step-by-step path's throughout."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(96, 128, generator=gen) * s for s in (1.0, 2.0, 0.5)]
    fused, plain = _fused_and_plain(Dtype.fp8_e4m3, QSchemeType.per_tensor, xs, monkeypatch)
    assert [kept for _, kept in fused] == [0, 0, 0]
    assert all(torch.equal(f, p) for (f, _), p in zip(fused, plain, strict=True))
    fused, plain = _fused_and_plain(Dtype.int8, QSchemeType.per_channel, xs, monkeypatch)
    assert [kept for _, kept in fused[1:]] == [3, 3]  # (the first batch binds per-channel statistics step by step)
    # the third batch (half the scale) clips nowhere, but the running range it is quantized with does at its ends:
    # the decision is on the range, so the backward runs and masks nothing
    assert [bool((p == 0).any()) for p in plain] == [True, True, False]
    assert all(torch.equal(f, p) for (f, _), p in zip(fused, plain, strict=True))


def test_non_finite_batch_never_skips_the_backward() -> None:
    """A batch with NaN leaves the statistics as they were: ``gradient_passes`` on them says nothing about it, and the
    kernel's ``finite`` term keeps the backward (here: the helper itself is False on NaN ends)."""
    nan_ends = torch.tensor([float("nan"), 1.0])
    assert not bool(gradient_passes(nan_ends, Dtype.fp8_e4m3, torch.tensor(1.0), torch.tensor(0)))
    assert not bool(gradient_passes(nan_ends, Dtype.int8, torch.tensor(0.1), torch.tensor(0, dtype=torch.int32)))
    assert not bool(gradient_passes(torch.tensor([0.0, 1.0]), Dtype.mx, torch.tensor(1.0), torch.tensor(0)))
