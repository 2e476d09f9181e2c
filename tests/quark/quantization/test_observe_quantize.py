"""The fused observe-and-quantize pass (``observe_quantize``): with the compiled kernels on, a quantizer whose min-max
observer is on computes statistics, qparams and the rounding in one compiled call. It must give the step-by-step
path's bits (output, gradient, scale, zero point, running statistics) over several batches, refuse NaN as that path
does without touching the statistics, and warn where a narrow scale saturates."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType, ZeroPointType
from quark.torch.quantization.formats import Backend, set_compile
from quark.torch.quantization.observer.observer import (
    PerChannelMinMaxObserver,
    PerGroupMinMaxObserver,
    PerTensorMinMaxObserver,
    PerTensorPercentileObserver,
)
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

ROWS, COLS = 96, 128  # 12288 elements: above the fused pass's auto-mode threshold (8192), so auto mode fuses too


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Shapes of the inputs the fused pass took (it is called through tensor_quantize's import)."""
    import quark.torch.quantization.tensor_quantize as tq

    calls: list[tuple[int, ...]] = []
    inner = tq.observe_fake_quantize

    def counting(x: torch.Tensor, *args: object) -> object:
        calls.append(tuple(x.shape))
        return inner(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(tq, "observe_fake_quantize", counting)
    return calls


def _spec(dtype: Dtype, qscheme: QSchemeType, observer: type, **kw: object) -> QuantizationSpec:
    if dtype in (Dtype.int8, Dtype.uint8, Dtype.int4):
        kw.setdefault("scale_type", ScaleType.float)
        kw.setdefault("round_method", RoundType.half_even)
        kw.setdefault("symmetric", True)
    kw.setdefault("is_dynamic", False)
    return QuantizationSpec(dtype=dtype, qscheme=qscheme, observer_cls=observer, **kw)  # type: ignore[arg-type]


SPECS = {
    "int8 per-channel symmetric": _spec(Dtype.int8, QSchemeType.per_channel, PerChannelMinMaxObserver, ch_axis=0),
    "uint8 per-tensor asymmetric": _spec(Dtype.uint8, QSchemeType.per_tensor, PerTensorMinMaxObserver, symmetric=False),
    "int8 per-tensor asymmetric, float zero point": _spec(
        Dtype.int8,
        QSchemeType.per_tensor,
        PerTensorMinMaxObserver,
        symmetric=False,
        zero_point_type=ZeroPointType.float32,
    ),
    "int4 per-group asymmetric, round half away": _spec(
        Dtype.int4,
        QSchemeType.per_group,
        PerGroupMinMaxObserver,
        ch_axis=1,
        group_size=32,
        symmetric=False,
        round_method=RoundType.round,
    ),
    "int8 per-tensor pof2, dynamic": _spec(
        Dtype.int8, QSchemeType.per_tensor, PerTensorMinMaxObserver, scale_type=ScaleType.pof2, is_dynamic=True
    ),
    "fp8 e4m3 per-tensor": _spec(Dtype.fp8_e4m3, QSchemeType.per_tensor, PerTensorMinMaxObserver),
    "fp4 per-channel": _spec(Dtype.fp4, QSchemeType.per_channel, PerChannelMinMaxObserver, ch_axis=0),
}


def _batches(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(0)
    xs = [torch.randn(ROWS, COLS) * s for s in (1.0, 3.0, 0.5)]
    xs[1][0, :4] = torch.tensor([0.0, -0.0, 1e-40, 250.0])  # zeros, a subnormal, an outlier that widens a range
    xs[2][5] = 0.0  # an all-zero channel
    return [x.to(dtype) for x in xs]


def _run(spec: QuantizationSpec, xs: list[torch.Tensor], fused: bool, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Train-mode calls of one quantizer on ``xs``: outputs, input gradients and the state after each."""
    import quark.torch.quantization.tensor_quantize as tq

    with monkeypatch.context() as m:
        if not fused:
            m.setattr(tq, "fused_pass_active", lambda x: False)
        fq = FakeQuantizeBase.get_fake_quantize(spec)
        got: dict[str, list[torch.Tensor]] = {"out": [], "grad": [], "scale": [], "zp": [], "min": [], "max": []}
        for x in xs:
            x = x.clone().requires_grad_()
            y = fq(x)
            (y.float() * torch.linspace(-2, 2, y.numel()).reshape(y.shape)).sum().backward()
            got["out"].append(y.detach())
            got["grad"].append(x.grad)
            got["scale"].append(fq.scale.clone())
            got["zp"].append(fq.zero_point.clone())
            got["min"].append(fq.observer.min_val.clone())
            got["max"].append(fq.observer.max_val.clone())
    return got


@pytest.mark.parametrize("name", list(SPECS))
def test_fused_pass_gives_the_step_by_step_bits(
    name: str, compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    xs = _batches()
    fused = _run(SPECS[name], xs, True, monkeypatch)
    # a per-channel / per-group observer's first batch binds its statistics' shape step by step; then it fuses
    assert len(fused_calls) == (len(xs) if SPECS[name].qscheme == QSchemeType.per_tensor else len(xs) - 1), name
    plain = _run(SPECS[name], xs, False, monkeypatch)
    for key in fused:
        for step, (a, b) in enumerate(zip(fused[key], plain[key], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {key} differs at batch {step}"
    if name == "int8 per-channel symmetric":  # a channel's extreme lands on 127.5 steps and rounds past qmax
        assert any(bool((g == 0).any()) for g in plain["grad"]), "no clipped value was tested"


@pytest.mark.parametrize("name", list(SPECS))
def test_the_fused_pass_served_directly_gives_the_same_bits(
    name: str, compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signature served by a direct kernel (``formats.direct_kernel``, here from its first call; the backward's as
    well) computes what the step-by-step path does, writes the running statistics, and its tracing (nested format kernels inside the fused
    pass) leaves the compiled backend on."""
    from quark.torch.quantization import observe_quantize
    from quark.torch.quantization.formats import kernel_cache

    monkeypatch.setattr(kernel_cache, "DIRECT_AFTER_CALLS", 1)
    cache = observe_quantize._observe_fake_quantize.kernel_cache
    grad_cache = observe_quantize._observe_fake_quantize_grad.kernel_cache  # the backward: a compiled pass too
    before, grad_before = cache.directs, grad_cache.directs
    xs = _batches()
    fused = _run(SPECS[name], xs, True, monkeypatch)
    assert fused_calls and cache.directs > before and Backend.failure is None, name
    plain = _run(SPECS[name], xs, False, monkeypatch)
    if any(bool((g == 0).any()) for g in plain["grad"]):  # a batch clipped: its backward ran its compiled pass
        assert grad_cache.directs > grad_before, name
    for key in fused:
        for step, (a, b) in enumerate(zip(fused[key], plain[key], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: {key} differs at batch {step}"


def test_bfloat16_inputs_fuse_with_the_same_bits(
    compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = SPECS["int8 per-channel symmetric"]
    xs = _batches(torch.bfloat16)
    fused, plain = _run(spec, xs, True, monkeypatch), _run(spec, xs, False, monkeypatch)
    assert fused_calls and all(torch.equal(a, b) for k in fused for a, b in zip(fused[k], plain[k], strict=True))
    assert fused["out"][0].dtype == torch.bfloat16 and fused["grad"][0].dtype == torch.bfloat16


def test_nan_is_refused_naming_the_layer_and_statistics_stay(compiled: None, fused_calls: list) -> None:
    fq = FakeQuantizeBase.get_fake_quantize(SPECS["uint8 per-tensor asymmetric"])
    fq.where = "layer 'fc1' (Linear, input_tensors)"
    fq.observer.where = fq.where
    x = torch.randn(ROWS, COLS)
    fq(x)
    before = (fq.observer.min_val.clone(), fq.observer.max_val.clone(), fq.scale.clone())
    bad = x.clone()
    bad[3, 3] = float("nan")
    with pytest.raises(ValueError, match="fc1.*NaN or Inf"):
        fq(bad)
    assert len(fused_calls) == 2, "the NaN batch went through the fused pass"
    assert torch.equal(fq.observer.min_val, before[0]) and torch.equal(fq.observer.max_val, before[1])
    assert torch.equal(fq.scale, before[2])


def test_a_saturating_narrow_scale_still_warns(compiled: None, fused_calls: list) -> None:
    spec = _spec(Dtype.int8, QSchemeType.per_tensor, PerTensorMinMaxObserver, scale_type=ScaleType.float16)
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    x = torch.randn(ROWS, COLS)
    x[0, 0] = 3e7  # scale 3e7 / 127.5 > float16's largest value
    with pytest.warns(UserWarning, match="exceeds float16's largest value"):
        fq(x)
    assert fused_calls and float(fq.scale) == torch.finfo(torch.float16).max


def test_what_does_not_fuse(compiled: None, fused_calls: list) -> None:
    """Other observers, fake quant off, a quantizer with its observer off, and tensors auto mode leaves eager."""
    x = torch.randn(ROWS, COLS)
    FakeQuantizeBase.get_fake_quantize(_spec(Dtype.int8, QSchemeType.per_tensor, PerTensorPercentileObserver))(x)
    off = FakeQuantizeBase.get_fake_quantize(SPECS["uint8 per-tensor asymmetric"])
    off.disable_fake_quant()
    off(x)
    fixed = FakeQuantizeBase.get_fake_quantize(SPECS["uint8 per-tensor asymmetric"])
    fixed(x)
    fixed.disable_observer()
    fixed(x)
    assert len(fused_calls) == 1  # fixed's first call only
    set_compile(None)  # auto: a small tensor stays on the eager path
    FakeQuantizeBase.get_fake_quantize(SPECS["uint8 per-tensor asymmetric"])(torch.randn(8, 8))
    assert len(fused_calls) == 1


def test_calibration_under_inference_mode_fuses(
    compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning validates and tests under ``torch.inference_mode``: PTQ calibration with fake quant on runs there."""
    spec = SPECS["int8 per-channel symmetric"]
    xs = _batches()
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    with torch.inference_mode():
        outs = [fq(x) for x in xs]
    assert len(fused_calls) == len(xs) - 1
    plain = _run(spec, xs, False, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(outs, plain["out"], strict=True))
    assert torch.equal(fq.scale, plain["scale"][-1]) and torch.equal(fq.observer.min_val, plain["min"][-1])


def test_training_after_statistics_made_under_inference_mode(
    compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics made under ``inference_mode`` (a calibration or an evaluation with the observers on) are inference
    tensors, which the fused pass cannot update in place outside it: the next training call takes the step-by-step
    path, which rebinds them, and the calls after it fuse again; the bits are the step-by-step path's throughout (this
    raised ``Inplace update to inference tensor`` once the compiled kernels ran)."""
    spec = SPECS["int8 per-channel symmetric"]
    xs = _batches()
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    with torch.inference_mode():
        fq(xs[0])
    assert fq.observer.min_val.is_inference()
    got = []
    for x in xs[1:]:
        x = x.clone().requires_grad_()
        y = fq(x)
        (y.float() * torch.linspace(-2, 2, y.numel()).reshape(y.shape)).sum().backward()  # as _run weighs it
        got.append((y.detach(), x.grad, fq.observer.min_val.clone(), fq.observer.max_val.clone()))
    assert not fq.observer.min_val.is_inference()
    assert fused_calls == [tuple(xs[2].shape)]  # the first training call rebinds, the second fuses
    plain = _run(spec, xs, False, monkeypatch)
    for i, (y, g, lo, hi) in enumerate(got, start=1):
        assert torch.equal(y, plain["out"][i]) and torch.equal(g, plain["grad"][i]), f"batch {i}"
        assert torch.equal(lo, plain["min"][i]) and torch.equal(hi, plain["max"][i]), f"batch {i}"


def test_a_quantizer_cast_to_bfloat16_keeps_float32_statistics_and_fuses_alike(
    compiled: None, fused_calls: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``precision="bf16-true"`` casts the whole module. Before, the statistics became bfloat16: the eager path
    computed qparams from the rounded range (narrower than the data: -3.8005 held as -3.7969) and the fused one from
    the exact range, so they differed."""
    spec = SPECS["uint8 per-tensor asymmetric"]
    xs = _batches(torch.bfloat16)

    def run(fused: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        import quark.torch.quantization.tensor_quantize as tq

        with monkeypatch.context() as m:
            if not fused:
                m.setattr(tq, "fused_pass_active", lambda x: False)
            fq = FakeQuantizeBase.get_fake_quantize(spec).to(torch.bfloat16)
            outs = [fq(x) for x in xs]
        assert fq.observer.min_val.dtype == torch.float32
        return outs, fq.scale, fq.observer.min_val

    (a, scale_a, min_a), (b, scale_b, min_b) = run(True), run(False)
    assert fused_calls and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert torch.equal(scale_a, scale_b) and torch.equal(min_a, min_b)
    assert float(min_a) == min(float(x.float().min()) for x in xs)  # the exact range of the data


def test_a_weight_observer_reset_before_every_batch_keeps_fusing(compiled: None, fused_calls: list) -> None:
    """QAT's warm-up resets a weight's observer before each batch (its range is the current weights'): the reset
    keeps the statistics' shape (+inf / -inf in place), so every batch after the first takes the fused pass, with
    the qparams of that batch alone, as a fresh observer gives them."""
    spec = SPECS["int8 per-channel symmetric"]
    xs = _batches()
    fq = FakeQuantizeBase.get_fake_quantize(spec)
    for x in xs:
        fq.observer.reset_state()
        assert not fq.observer.has_statistics
        out = fq(x)
        fresh = FakeQuantizeBase.get_fake_quantize(spec)
        assert torch.equal(out, fresh(x)) and torch.equal(fq.scale, fresh.scale)
    assert fused_calls == [tuple(x.shape) for x in xs[1:]]
    assert fq.observer.min_val.shape == (ROWS,)
