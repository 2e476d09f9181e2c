"""The steady paths: a quantizer whose kernels are served directly calls them straight, skipping the decisions and
signature lookups between it and the generated code: with fixed qparams (``PreparedInt``, ``_SteadyIntFakeQuant``)
and while observing (the fused observe pass, ``observe_quantize.steady_fused``).
Checked against the eager kernels (a reference the compiled path is itself tested against) for outputs and
straight-through gradients, and for what must send a call back to the normal path."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from quark.torch.quantization.config.config import QuantizationSpec
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType, ScaleType
from quark.torch.quantization.formats import Backend, fake_quantize_int, kernel_cache, set_compile
from quark.torch.quantization.formats.direct_kernel import DirectKernel
from quark.torch.quantization.formats.grouping import SteadyKernels
from quark.torch.quantization.formats.integer import PreparedInt
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize


def _spec(dtype: Dtype, per_channel: bool, **more: Any) -> QuantizationSpec:
    """A static min-max spec per tensor or per channel (axis 0)."""
    layout: dict[str, Any] = (
        {"qscheme": QSchemeType.per_channel, "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}
        if per_channel
        else {"qscheme": QSchemeType.per_tensor, "observer_cls": "PerTensorMinMaxObserver"}
    )
    return QuantizationSpec(dtype=dtype, is_dynamic=False, **layout, **more)


_INT = {"round_method": RoundType.half_even, "scale_type": ScaleType.float}
SPECS = {
    "per_channel_weight": (_spec(Dtype.int8, True, symmetric=True, **_INT), (64, 128)),
    "per_tensor_asymmetric": (_spec(Dtype.uint8, False, symmetric=False, **_INT), (32, 256)),
    "fp8_per_tensor": (_spec(Dtype.fp8_e4m3, False), (32, 256)),
    "fp8_per_channel_weight": (_spec(Dtype.fp8_e4m3, True), (64, 128)),
}


@pytest.fixture
def direct_soon(compiler: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Compiled kernels from the first call, served directly from a signature's third call; records every direct
    kernel call."""
    calls: list[str] = []
    original = DirectKernel.__call__

    def spy(self: DirectKernel, args: Any) -> Any:
        calls.append("direct")
        return original(self, args)

    monkeypatch.setattr(DirectKernel, "__call__", spy)
    monkeypatch.setattr(kernel_cache, "DIRECT_AFTER_CALLS", 2)
    before = Backend.compile
    set_compile(True)
    try:
        yield calls
    finally:
        set_compile(before)


def _quantizer(name: str) -> tuple[ScaledFakeQuantize, tuple[int, int]]:
    spec, shape = SPECS[name]
    q = ScaledFakeQuantize(spec)
    with torch.no_grad():
        q(torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2)  # calibrate
    q.disable_observer()
    return q, shape


def _step(q: ScaledFakeQuantize, shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).requires_grad_(True)
    y = q(x)
    y.backward(torch.randn(shape, generator=g))
    return y.detach(), x.grad  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(SPECS))
def test_the_steady_path_gives_the_eager_bits(name: str, direct_soon: list[str]) -> None:
    q, shape = _quantizer(name)
    set_compile(False)
    eager = [_step(q, shape, seed) for seed in range(8)]
    set_compile(True)
    got = [_step(q, shape, seed) for seed in range(8)]
    prepared = q.__dict__["_prepared_int"][4]
    assert prepared.steady, "the steady path never took over"
    steady = next(iter(prepared.steady.values()))
    assert steady.backward, "its backward kernel was never taken"
    for (y, gx), (ye, gxe) in zip(got, eager, strict=True):
        assert torch.equal(y, ye) and torch.equal(gx, gxe)
    assert not torch.equal(eager[0][0], eager[1][0])  # (different data each step)
    # the last steps ran on it: one direct call each way per step, nothing else between
    direct_soon.clear()
    _step(q, shape, 9)
    assert direct_soon == ["direct", "direct"]


def test_switching_the_compiled_kernels_off_leaves_the_steady_path(direct_soon: list[str]) -> None:
    q, shape = _quantizer("per_channel_weight")
    for seed in range(6):
        _step(q, shape, seed)
    assert q.__dict__["_prepared_int"][4].steady
    set_compile(False)
    direct_soon.clear()
    _step(q, shape, 7)
    assert direct_soon == []


def test_other_global_state_or_layout_takes_the_normal_path(direct_soon: list[str]) -> None:
    """Another thread count (the generated code was built for one) or other strides: a signature of its own, which
    the normal path serves (the same bits as eager) until its own kernels are served directly."""
    q, shape = _quantizer("per_channel_weight")
    for seed in range(6):
        _step(q, shape, seed)
    prepared = q.__dict__["_prepared_int"][4]
    before = set(prepared.steady)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        direct_soon.clear()
        _step(q, shape, 7)  # a new signature: its graph serves it (no direct kernel yet)
        assert direct_soon == []
    finally:
        torch.set_num_threads(threads)
    x = torch.randn(shape[1], shape[0]).t()  # the same shape, transposed strides
    set_compile(False)
    want = q(x)
    set_compile(True)
    direct_soon.clear()
    assert torch.equal(q(x), want)
    assert direct_soon == []
    assert set(prepared.steady) == before  # nothing taken for the new signatures yet


def test_qparams_written_between_forward_and_backward_are_refused(direct_soon: list[str]) -> None:
    """As on the normal path: the saved qparams are version-checked, so a write before the backward raises instead
    of masking with other qparams."""
    q, shape = _quantizer("per_channel_weight")
    for seed in range(6):
        _step(q, shape, seed)
    prepared = q.__dict__["_prepared_int"][4]
    assert prepared.steady
    x = torch.randn(shape, requires_grad=True)
    y = q(x)
    with torch.no_grad():
        prepared.scale.mul_(2)  # (a view of the quantizer's scale buffer)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a_one_shot_call_keeps_no_steady_state() -> None:
    """``fake_quantize_int`` builds a ``PreparedInt`` per call: it never looks for a steady path."""
    x = torch.randn(8, 16)
    prepared = PreparedInt.of(
        torch.tensor(0.1), torch.tensor(0, dtype=torch.int32), -128, 127, RoundType.half_even, None, 2
    )
    assert prepared.steady is None
    assert torch.equal(
        prepared(x), fake_quantize_int(x, torch.tensor(0.1), torch.tensor(0, dtype=torch.int32), -128, 127)
    )


# ------------------------------------------------------------------------------------- the fused observe pass's
def _observing(name: str) -> tuple[ScaledFakeQuantize, tuple[int, int]]:
    spec, shape = SPECS[name]
    q = ScaledFakeQuantize(spec)
    with torch.no_grad():
        q(torch.randn(shape, generator=torch.Generator().manual_seed(1)))  # binds the statistics' shape
    return q, shape


def _observe_step(q: ScaledFakeQuantize, shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    y, gx = _step(q, shape, seed)
    obs = q.observer
    return [y, gx, obs.min_val.clone(), obs.max_val.clone(), q.scale.clone(), q.zero_point.clone()]


@pytest.mark.parametrize("name", list(SPECS))
def test_the_fused_steady_path_gives_the_normal_paths_bits(
    name: str, direct_soon: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observers on (QAT's warm-up): outputs, gradients, running statistics and qparams step by step, against the
    same quantizer with its steady path off (the fused kernels through the kernel cache). Where a batch lies inside
    the format's range the backward is skipped (``_ObserveFakeQuant``: the gradient passes unchanged), so only
    batches that clip reach the backward's direct kernel."""
    import quark.torch.quantization.observe_quantize as oq
    import quark.torch.quantization.tensor_quantize as tq

    forward, skipped = oq._ObserveFakeQuant.forward, []

    def recording(ctx: Any, *args: Any) -> Any:
        out = forward(ctx, *args)
        skipped.append(ctx.unchanged)
        return out

    q, shape = _observing(name)
    ref = copy.deepcopy(q)
    with monkeypatch.context() as m:
        m.setattr(oq._ObserveFakeQuant, "forward", staticmethod(recording))
        got = [_observe_step(q, shape, seed) for seed in range(8)]
        steady = list(q.__dict__["_fused_steady"].values())
        assert steady and (steady[0].backward or all(skipped)), "the steady path never took over, forward and backward"
        direct_soon.clear()
        got.append(_observe_step(q, shape, 8))
    # one direct call each way (the forward alone where the backward was skipped), nothing between
    assert direct_soon == ["direct"] * (1 if skipped[-1] else 2)
    monkeypatch.setattr(tq, "steady_fused", lambda *args: None)  # the normal path
    want = [_observe_step(ref, shape, seed) for seed in range(9)]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), f"step {step}"
    assert not torch.equal(got[0][3], got[-1][3])  # the running statistics moved


def test_a_nan_batch_on_the_fused_steady_path_is_refused(direct_soon: list[str]) -> None:
    q, shape = _observing("per_tensor_asymmetric")
    for seed in range(6):
        _observe_step(q, shape, seed)
    assert any(isinstance(v, SteadyKernels) for v in q.__dict__["_fused_steady"].values())
    before = [q.observer.min_val.clone(), q.observer.max_val.clone(), q.scale.clone()]
    x = torch.randn(shape)
    x[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        q(x)
    after = [q.observer.min_val, q.observer.max_val, q.scale]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_copy_leaves_the_steady_kernels_behind(direct_soon: list[str]) -> None:
    q, shape = _observing("per_channel_weight")
    for seed in range(6):
        _observe_step(q, shape, seed)
    assert q.__dict__.get("_fused_steady")
    assert "_fused_steady" not in copy.deepcopy(q).__dict__


@pytest.mark.parametrize("name", list(SPECS))
def test_the_steady_paths_read_no_tensor_on_the_host(
    name: str, direct_soon: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a steady call checks is metadata (layouts, flags, global state): no tensor value is read on the host, with
    fixed qparams or observing (the engine's CUDA logic run on the CPU, ``tests/host_syncs.py``)."""
    from tests.host_syncs import HostSyncs, as_if_on_cuda

    with as_if_on_cuda(monkeypatch):
        fixed, shape = _quantizer(name)
        observing, _ = _observing(name)
        for seed in range(6):
            _step(fixed, shape, seed)
            _observe_step(observing, shape, seed)
        assert fixed.__dict__["_prepared_int"][4].steady
        assert any(isinstance(v, SteadyKernels) for v in observing.__dict__["_fused_steady"].values())
        direct_soon.clear()
        with HostSyncs() as probe:
            _step(fixed, shape, 7)
            _observe_step(observing, shape, 7)
    assert direct_soon == ["direct"] * 4
    assert not probe.found, dict(probe.found)


def test_steady_lookups_are_bounded_per_signature_and_in_signatures() -> None:
    """A signature is looked up in its first ``STEADY_LOOKUPS`` calls only; a caller counts at most
    ``MAX_STEADY_SIGNATURES`` signatures (inputs of ever new shapes stop being counted), and goes on counting those."""
    from quark.torch.quantization.formats.grouping import MAX_STEADY_SIGNATURES, STEADY_LOOKUPS, steady_lookup_due

    calls: dict[tuple[Any, ...], Any] = {}
    assert [steady_lookup_due(calls, ("a",)) for _ in range(STEADY_LOOKUPS + 2)] == [True] * STEADY_LOOKUPS + [
        False
    ] * 2
    for i in range(MAX_STEADY_SIGNATURES - 1):
        assert steady_lookup_due(calls, (i,))
    assert len(calls) == MAX_STEADY_SIGNATURES
    assert not steady_lookup_due(calls, ("new",)) and ("new",) not in calls
    assert steady_lookup_due(calls, (0,))  # a counted one goes on


# ----------------------------------------------------------------------------------------------- block formats
BLOCK_SPECS = {
    "mxfp4": {"dtype": "mx", "mx_element_dtype": "fp4", "qscheme": "per_group", "ch_axis": -1, "group_size": 32},
    "mxfp8": {"dtype": "mx", "mx_element_dtype": "fp8_e4m3", "qscheme": "per_group", "ch_axis": -1, "group_size": 32},
    "mx6": {"dtype": "mx6", "qscheme": "per_group", "ch_axis": -1, "group_size": 16},
    "bfp16": {"dtype": "bfp16", "qscheme": "per_group", "ch_axis": -1, "group_size": 8},
}


@pytest.mark.parametrize("name", list(BLOCK_SPECS))
def test_the_block_steady_path_gives_the_eager_bits(name: str, direct_soon: list[str]) -> None:
    """MX / MX6 / BFP16 (``PreparedBlock``): outputs and (straight-through) gradients against eager, the steady path
    taken, one direct kernel call a step."""
    from quark.torch.quantization.config.config import QuantizationConfig
    from quark.torch.quantization.tensor_quantize import NonScaledFakeQuantize

    spec = QuantizationConfig.from_dict({"weight": BLOCK_SPECS[name]}).weight
    q = NonScaledFakeQuantize(spec)
    q.disable_observer()
    shape = (64, 128)

    def step(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(shape, generator=g) * 3).requires_grad_(True)
        y = q(x)
        y.backward(torch.randn(shape, generator=g))
        return y.detach(), x.grad  # type: ignore[return-value]

    set_compile(False)
    eager = [step(seed) for seed in range(8)]
    set_compile(True)
    got = [step(seed) for seed in range(8)]
    assert q.__dict__["_block_prepared"][1].steady, "the steady path never took over"
    for (y, gx), (ye, gxe) in zip(got, eager, strict=True):
        assert torch.equal(y, ye) and torch.equal(gx, gxe)
    assert not torch.equal(eager[0][0], eager[1][0])
    direct_soon.clear()
    step(9)
    assert direct_soon == ["direct"]
    assert "_block_prepared" not in copy.deepcopy(q).__dict__


# -------------------------------------------------------------------------- MX observing: one pass for the maxima
def _mx_observing(name: str, dtype: torch.dtype = torch.float32) -> Any:
    from quark.torch.quantization.config.config import QuantizationConfig
    from quark.torch.quantization.tensor_quantize import NonScaledFakeQuantize

    spec = QuantizationConfig.from_dict({"weight": {**BLOCK_SPECS[name], "is_dynamic": False}}).weight
    return NonScaledFakeQuantize(spec).to(dtype)


def _two_pass(q: Any) -> Any:
    """A copy of ``q`` that observes, then quantizes (the path before the one-pass maxima)."""
    ref = copy.deepcopy(q)
    ref._observe_and_quantize = lambda x: None
    return ref


def _mx_step(q: Any, shape: tuple[int, int], seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 ** (seed % 5 - 2)).to(dtype).requires_grad_(True)
    y = q(x)
    y.backward(torch.randn(shape, generator=g).to(dtype))
    return [y.detach(), x.grad, q.observer.amax.clone()]  # type: ignore[list-item]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(
    ("name", "shape", "dtype"),
    [
        ("mxfp4", (64, 128), torch.float32),
        ("mxfp8", (64, 128), torch.float32),
        ("mxfp4", (48, 100), torch.float32),  # a ragged last block (no direct kernel: the guarded graph serves it)
        ("mxfp8", (64, 64), torch.bfloat16),  # (no direct kernel either)
    ],
)
def test_mx_observing_takes_the_maxima_from_the_quantizing_pass(
    name: str,
    shape: tuple[int, int],
    dtype: torch.dtype,
    compiled: bool,
    direct_soon: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MX with its observer on (QAT's warm-up): the block maxima come from the fake-quant kernel's own read of the
    input (``PreparedBlock.observe``). Outputs, straight-through gradients and the running maxima step by step are
    those of observing, then quantizing; compiled, its steady path takes over (one direct call a step)."""
    from quark.torch.quantization.formats import block

    set_compile(compiled)
    q = _mx_observing(name, dtype)
    ref = _two_pass(q)
    got = [_mx_step(q, shape, seed, dtype) for seed in range(8)]
    want = [_mx_step(ref, shape, seed, dtype) for seed in range(8)]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True)), f"step {step}"
    assert not torch.equal(got[0][2], got[-1][2])  # the running maxima moved
    if compiled and dtype == torch.float32 and shape[1] % 32 == 0:
        assert q.__dict__["_block_prepared"][1].observed_steady, "the steady path never took over"
        direct_soon.clear()
        _mx_step(q, shape, 9, dtype)
        assert direct_soon == ["direct"]
    import quark.torch.quantization.observer.block as observer_block

    seen: list[int] = []
    real = block.block_absmax
    monkeypatch.setattr(observer_block, "block_absmax", lambda *args: seen.append(1) or real(*args))
    _mx_step(q, shape, 10, dtype)
    assert not seen, "the observer read the input again"
    _mx_step(ref, shape, 10, dtype)
    assert seen, "(the spy sees the two-pass path's read)"


def test_a_nan_batch_observed_in_the_mx_pass_is_refused_and_leaves_the_maxima() -> None:
    q = _mx_observing("mxfp4")
    q(torch.randn(16, 64))
    before = q.observer.amax.clone()
    x = torch.randn(16, 64)
    x[3, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        q(x)
    assert torch.equal(q.observer.amax, before)


def test_block_formats_whose_observers_record_more_observe_then_quantize(monkeypatch: pytest.MonkeyPatch) -> None:
    """BFP16 (its observer also records block steps) and MX6 (no kernel that returns its maxima) take the two-pass
    path; with fake quant off an MX observer only observes (the input comes back as it was)."""
    from quark.torch.quantization.formats.block import PreparedBlock

    calls: list[str] = []
    monkeypatch.setattr(PreparedBlock, "observe", lambda self, x: calls.append("observe"))
    for name in ("bfp16", "mx6"):
        q = _mx_observing(name)
        q(torch.randn(16, 64))
    assert calls == []
    q = _mx_observing("mxfp4")
    q.disable_fake_quant()
    x = torch.randn(16, 64)
    assert q(x) is x and calls == [] and q.observer.amax.abs().sum() > 0


def test_mx_observing_inside_a_users_torch_compile_gives_the_eager_maxima_and_bits() -> None:
    q = _mx_observing("mxfp4")
    ref = _two_pass(q)
    compiled = torch.compile(q)
    for seed in range(3):
        x = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        assert torch.equal(compiled(x), ref(x))
        assert torch.equal(q.observer.amax, ref.observer.amax)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
def test_tqt_steady_path_gives_the_eager_bits_and_learns_the_same(per_channel: bool, direct_soon: list[str]) -> None:
    """A TQT quantizer (learned power-of-two thresholds) calls its direct kernels straight once served: outputs and
    input gradients are eager's bits, the thresholds' gradients eager's to float32 summation rounding, and a step
    runs one direct call each way. A deep copy starts without the original's direct kernels."""
    from quark.torch.quantization.config.config import TQTSpec
    from quark.torch.quantization.fake_quant.learnable import TQTFakeQuantize

    layout = (
        {"qscheme": QSchemeType.per_channel, "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}
        if per_channel
        else {"qscheme": QSchemeType.per_tensor, "observer_cls": "PerTensorMinMaxObserver"}
    )
    spec = QuantizationSpec(
        dtype=Dtype.int8,
        is_dynamic=False,
        symmetric=True,
        round_method=RoundType.half_even,
        scale_type=ScaleType.pof2,
        qat_spec=TQTSpec(),
        **layout,
    )
    q = TQTFakeQuantize(spec)
    shape = (64, 128)
    q(torch.randn(shape, generator=torch.Generator().manual_seed(1)))  # initialises the thresholds

    def step(seed: int) -> tuple[torch.Tensor, ...]:
        q.log_threshold.grad = None
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(shape, generator=g) * 3).requires_grad_(True)
        y = q(x)
        y.backward(torch.randn(shape, generator=g))
        return y.detach(), x.grad, q.log_threshold.grad.clone()  # type: ignore[union-attr]

    set_compile(False)
    eager = [step(seed) for seed in range(8)]
    set_compile(True)
    got = [step(seed) for seed in range(8)]
    kernels = q.__dict__["_steady"][0]
    assert kernels, "the steady path never took over"
    assert next(iter(kernels.values())).backward, "its backward kernel was never taken"
    for (y, gx, gt), (ye, gxe, gte) in zip(got, eager, strict=True):
        assert torch.equal(y, ye) and torch.equal(gx, gxe)
        torch.testing.assert_close(gt, gte, rtol=1e-5, atol=1e-6)
    direct_soon.clear()
    step(9)
    assert direct_soon == ["direct", "direct"]
    assert "_steady" not in copy.deepcopy(q).__dict__
