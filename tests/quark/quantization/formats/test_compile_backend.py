"""The compiled format kernels (the default, "auto" backend) give the same bits as eager, forward and backward; auto
mode compiles only where it pays and falls back to eager, with a warning that says why, when compiling fails."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    Backend,
    fake_quantize_bfp16,
    fake_quantize_int,
    fake_quantize_minifloat,
    fake_quantize_mx,
    fake_quantize_mx6,
    fake_quantize_mx9,
    set_compile,
)
from quark.torch.quantization.formats.bits import frexp32, ldexp32
from quark.torch.quantization.formats.grouping import compilable, compiled_kernels_active, saturate_to
from quark.torch.quantization.formats.table import TORCH_FLOAT8

ROWS, COLS = 256, 256  # 65536 elements: the smallest size auto mode compiles


@pytest.fixture(autouse=True)
def no_warmup(backend_state: type) -> None:
    """Auto mode compiles from the first call at or above ``Backend.min_numel`` here (these tests compare compiled and
    eager bits; the warm-up before the first compile is tested in test_compile_policy.py)."""
    # (an untold run compiles once it has counted ``payback_numel``; backend_state: everything restored after)
    Backend.warmup_numel = Backend.payback_numel = 0


@pytest.fixture
def auto_mode() -> Iterator[None]:
    before = Backend.compile  # the suite's setting (tests/conftest.py: eager unless QUARK_COMPILE says otherwise)
    set_compile(None)
    try:
        yield
    finally:
        set_compile(before)


def _cases() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    s = torch.tensor(0.02)
    z = torch.tensor(3, dtype=torch.int32)
    s_c = torch.linspace(0.01, 0.05, ROWS)
    z_c = torch.zeros(ROWS, dtype=torch.int32)
    s_g, z_g = (
        torch.full((ROWS, COLS // 16), 0.1),
        torch.zeros(ROWS, COLS // 16, dtype=torch.int32),
    )  # built here: on the device
    return {
        "int8 per-tensor": lambda t: fake_quantize_int(t, s, z, -128, 127),
        "int8 per-channel": lambda t: fake_quantize_int(
            t, s_c, z_c, -128, 127, qscheme=QSchemeType.per_channel, axis=0
        ),
        "int8 round half away": lambda t: fake_quantize_int(t, s, z, -128, 127, round_method=RoundType.round),
        "int4 floor per-group": lambda t: fake_quantize_int(
            t,
            s_g,
            z_g,
            -8,
            7,
            round_method=RoundType.floor,
            qscheme=QSchemeType.per_group,
            axis=1,
            group_size=16,
        ),
        "fp8_e4m3": lambda t: fake_quantize_minifloat(
            t, FLOAT_FORMATS[Dtype.fp8_e4m3], s, torch_dtype=TORCH_FLOAT8[Dtype.fp8_e4m3]
        ),
        "fp4 per-channel": lambda t: fake_quantize_minifloat(
            t, FLOAT_FORMATS[Dtype.fp4], s_c, qscheme=QSchemeType.per_channel, axis=0
        ),
        "mxfp4": lambda t: fake_quantize_mx(t, Dtype.fp4, 32, -1),
        "mxfp8 even": lambda t: fake_quantize_mx(t, Dtype.fp8_e4m3, 32, -1, "even"),
        "bfp16": lambda t: fake_quantize_bfp16(t, 8, -1),
        "bfp16 blocks of 16 along rows": lambda t: fake_quantize_bfp16(t, 16, 0),
        "mx6": lambda t: fake_quantize_mx6(t, 16, -1),
        "mx9": lambda t: fake_quantize_mx9(t, 16, -1),
        "mx6 blocks of 32 along rows": lambda t: fake_quantize_mx6(t, 32, 0),
    }


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(ROWS, COLS) * 3
    # zeros, a subnormal, clipped values (not beyond int64: torch's fused kernel wraps around there), a grid point
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-30, 1e6, -7.0, 448.0, 0.01])
    x[1] = 0.0  # an all-zero block / channel
    return x


@pytest.mark.parametrize("name", list(_cases()))
def test_compiled_equals_eager(name: str, compiler: None) -> None:
    fn, x = _cases()[name], _input()
    grad = torch.randn(ROWS, COLS)
    outs, before = [], Backend.compile
    for mode in (False, None):
        set_compile(mode)
        try:
            assert compiled_kernels_active(x) is (mode is None)
            xg = x.clone().requires_grad_(True)
            y = fn(xg)
            y.backward(grad)
            outs.append((y.detach(), xg.grad))
            assert Backend.failure is None, Backend.failure
        finally:
            set_compile(before)
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert not torch.equal(outs[0][0], x)  # it did quantize


@pytest.mark.parametrize(
    "name", ["bfp16", "bfp16 blocks of 16 along rows", "mx6", "mx9", "mx6 blocks of 32 along rows"]
)
def test_block_kernels_compiled_equal_eager_at_the_ends_of_float32(name: str, compiler: None) -> None:
    """The compiled block kernels build their powers of two per block and scale in two factors: blocks of float32
    subnormals (MX6 steps down to 2^-134), tiny normals and values near float32's max give eager's bits."""
    g = torch.Generator().manual_seed(1)
    scales = torch.tensor([1e-45, 1e-42, 1e-39, 3e-38, 1e-3, 1.0, 1e30, 1.7e38]).repeat_interleave(ROWS * COLS // 8)
    x = ((torch.rand(scales.numel(), generator=g) * 2 - 1) * scales).reshape(ROWS, COLS)
    x[:, ::7] = 0.0
    fn, before = _cases()[name], Backend.compile
    outs = []
    for mode in (False, True):
        set_compile(mode)
        try:
            outs.append(fn(x))
        finally:
            set_compile(before)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32))
    assert (
        torch.isfinite(outs[1]).all()
        and (outs[1] != 0).any()
        and (outs[1].abs() < 1e-38).logical_and(outs[1] != 0).any()
    )


def test_bit_helpers_match_torch_when_compiled(compiler: None) -> None:
    """frexp32 / ldexp32 traced by torch.compile (their integer-bit forms) against torch.frexp / torch.ldexp on
    random bit patterns (every exponent, subnormals, inf, NaN) and exponents over the whole supported range."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=g)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38, float("inf")])
    a = torch.cat([bits.view(torch.float32), special, -special])
    mantissa, exponent = torch.compile(frexp32, dynamic=True)(a)
    ref_m, ref_e = torch.frexp(a)
    finite = ~a.isnan()
    assert torch.equal(exponent[finite], ref_e[finite])
    assert torch.equal(mantissa.view(torch.int32)[finite], ref_m.view(torch.int32)[finite])
    assert mantissa[~finite].isnan().all()
    k = torch.randint(-252, 255, a.shape, dtype=torch.int32, generator=g)
    out = torch.compile(ldexp32, dynamic=True)(a, k)
    assert torch.equal(out.view(torch.int32)[finite], torch.ldexp(a, k).view(torch.int32)[finite])


def test_auto_mode_leaves_small_tensors_eager(auto_mode: None) -> None:
    assert not compiled_kernels_active(torch.ones(Backend.min_numel - 1))
    assert compiled_kernels_active(torch.ones(Backend.min_numel))


def test_auto_mode_falls_back_with_a_reason(auto_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose compile fails: the call returns the eager result, warns once with the reason, and every later
    call runs eagerly; forcing compile (True) raises instead."""

    def broken_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202 - torch.compile's signature
        def run(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    calls: list[str] = []

    @compilable
    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append("eager")
        return t * 2

    x = torch.ones(Backend.min_numel)
    with pytest.warns(RuntimeWarning, match=r"double failed \(RuntimeError: InvalidCxxCompiler.*runs eagerly"):
        assert torch.equal(double(x), x * 2)
    assert Backend.failure is not None and not compiled_kernels_active(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(double(x), x * 2)  # eager, silently
    assert calls == ["eager", "eager"]

    set_compile(True)
    with pytest.raises(RuntimeError, match="InvalidCxxCompiler"):
        double(x)


def test_bad_input_raises_as_in_eager(auto_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error the eager kernel raises too is the input's fault: it propagates and auto mode keeps compiling."""

    def failing_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return fn  # "compiled" = eager: fails the same way on bad input

    monkeypatch.setattr(torch, "compile", failing_compile)

    @compilable
    def needs_matching(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return t + other

    with pytest.raises(RuntimeError, match="size of tensor"):
        needs_matching(torch.ones(Backend.min_numel), torch.ones(3))
    assert Backend.failure is None


def test_env_values() -> None:
    from quark.torch.quantization.formats.grouping import _compile_from_env

    for value, expected in (("auto", None), ("", None), ("1", True), ("on", True), ("0", False), ("no", False)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("QUARK_COMPILE", value)
            assert _compile_from_env() is expected
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUARK_COMPILE", "fast")
        with pytest.raises(ValueError, match=r"QUARK_COMPILE='fast'.*auto \(default\), 1 .* 0"):
            _compile_from_env()


def test_compiled_calls_raise_the_recompile_limit(auto_mode: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each format / layout / round mode is a variant of one kernel: compiled calls run with dynamo's recompile limit
    raised (dynamo's default of 8 would silently send a model mixing formats back to eager), and only during the
    call."""
    from quark.torch.quantization.formats.grouping import RECOMPILE_LIMIT

    seen: list[int] = []

    def recording_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        def run(*args, **kw):  # noqa: ANN002, ANN003, ANN202
            seen.append(torch._dynamo.config.recompile_limit)
            return fn(*args, **kw)

        return run

    monkeypatch.setattr(torch, "compile", recording_compile)
    before = torch._dynamo.config.recompile_limit

    @compilable
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    double(torch.ones(Backend.min_numel))
    assert seen == [max(RECOMPILE_LIMIT, before)] and RECOMPILE_LIMIT > 8
    assert torch._dynamo.config.recompile_limit == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(_cases()))
def test_every_format_runs_on_cuda(name: str) -> None:
    """Each format forward and backward on a CUDA tensor, eager and auto (compiled through triton where it works):
    the same bits as each other and as the CPU's eager kernels (all of them are IEEE-exact elementwise arithmetic)."""
    x, grad = _input(), torch.randn(ROWS, COLS)
    results, before = {}, Backend.compile
    for device, mode in (("cpu", False), ("cuda", False), ("cuda", None)):
        fn = _cases_on(device)[name]
        set_compile(mode)
        try:
            xg = x.detach().to(device, copy=True).requires_grad_(True)  # a leaf on every device
            y = fn(xg)
            y.backward(grad.to(device))
            results[(device, mode)] = (y.detach().cpu(), xg.grad.cpu())
        finally:
            set_compile(before)
    ref = results[("cpu", False)]
    for key, (y, g) in results.items():
        assert torch.equal(y, ref[0]) and torch.equal(g, ref[1]), key


def _cases_on(device: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """``_cases`` with every qparam on ``device`` (the cases build theirs on the CPU)."""
    with torch.device(device):
        return _cases()


def test_block_sizes_beyond_the_pinned_range_compile_without_falling_back(auto_mode: None, compiler: None) -> None:
    """``static_int`` pins block sizes up to STATIC_INT_MAX; a larger one stays symbolic: still compiled, the same bits,
    and no process-wide fallback to eager."""
    x = torch.randn(16, 8192, generator=torch.Generator().manual_seed(0))
    out = fake_quantize_bfp16(x, 8192, -1)
    assert Backend.failure is None
    set_compile(False)
    assert torch.equal(out, fake_quantize_bfp16(x, 8192, -1))


@pytest.mark.parametrize("name", ["mx6 blocks of 32 along rows", "bfp16", "mxfp4"])
def test_block_formats_inside_a_users_torch_compile_give_eager_bits(name: str, compiler: None) -> None:
    """Inside the user's own ``torch.compile`` the kernels' traced forms (per-block integer work, float work per
    element) are part of the user's graph, on small tensors too: the same bits as the eager forms."""
    fn = _cases()[name]
    x = _input()[:64, :64].contiguous() * 5
    before = Backend.compile
    set_compile(False)
    try:
        expected = fn(x)
        torch._dynamo.reset()
        got = torch.compile(fn, dynamic=True)(x)
    finally:
        set_compile(before)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["int8 per-channel", "fp8_e4m3", "mxfp4", "mx6", "bfp16"])
def test_half_precision_inputs_are_read_and_written_in_their_dtype(
    name: str, dtype: torch.dtype, compiler: None
) -> None:
    """A bfloat16 / float16 tensor goes into the kernel as it is (computed in float32 inside, saturated on the way
    out): the same bits as quantizing its float32 copy and casting back with saturation, compiled and eager, and the
    straight-through gradient in the input's dtype."""
    fn = _cases()[name]
    x32 = _input() * 40  # float16 saturates past 65504: large values reach the grid's ends
    x32[2, :4] = torch.tensor([65504.0, -65504.0, 60000.0, 1e-3])
    x = x32.to(dtype)
    expected = saturate_to(fn(x.float()), dtype)
    grad = torch.randn(x.shape).to(dtype)
    before = Backend.compile
    for mode in (False, None):
        set_compile(mode)
        try:
            xg = x.clone().requires_grad_(True)
            out = fn(xg)
            out.backward(grad)
        finally:
            set_compile(before)
        assert out.dtype == dtype and torch.equal(out.detach(), expected), mode
        assert xg.grad is not None and xg.grad.dtype == dtype
        assert torch.equal(xg.grad, torch.where(xg.grad == 0, torch.zeros_like(grad), grad))  # grad or 0 per element


@pytest.mark.parametrize(
    "bits,axis,round_method",
    [
        (8, None, RoundType.half_even),
        (4, None, RoundType.round),
        (4, 0, RoundType.half_even),
        (8, 1, RoundType.round),
    ],
    ids=["int8 per tensor", "int4 half away", "int4 per channel", "int8 per channel of a 4-D tensor"],
)
def test_tqt_compiled_equals_eager_and_the_closed_form(
    bits: int, axis: int | None, round_method: RoundType, compiler: None
) -> None:
    """TQT's compiled forward and backward (one pass each) against eager (torch's fused learnable backward per
    tensor with half-even rounding, else the eager terms): the same forward and input-gradient bits, and the
    threshold's gradient the paper's, computed in float64, to float32 summation rounding."""
    from quark.torch.quantization.fake_quant.learnable_grad import TQTFunction

    torch.manual_seed(1)
    x = torch.randn(ROWS, COLS) * 0.3 if axis != 1 else torch.randn(4, 8, 64, 32) * 0.3
    x.view(-1)[:4] = torch.tensor([9.0, -9.0, 0.0, 1e-40])  # clipped both ways, a zero, a subnormal
    channels = 1 if axis is None else x.shape[axis]
    log_t = torch.linspace(-1.3, 0.4, channels)
    grad = torch.randn_like(x)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    outs, before = [], Backend.compile
    for mode in (False, True):  # (True: compiled at every size, below Backend.min_numel too)
        set_compile(mode)
        try:
            assert compiled_kernels_active(x) is mode
            xg, tg = x.clone().requires_grad_(True), log_t.clone().requires_grad_(True)
            y = TQTFunction.apply(xg, tg, qmin, qmax, float(bits - 1), round_method, axis)
            y.backward(grad)
            outs.append((y.detach(), xg.grad, tg.grad))
            assert Backend.failure is None, Backend.failure
        finally:
            set_compile(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    s = torch.exp2(torch.ceil(log_t.double()) - (bits - 1))
    sv = s if axis is None else s.reshape([-1 if d == axis else 1 for d in range(x.ndim)])
    v = x.double() / sv
    r = torch.round(v) if round_method == RoundType.half_even else torch.sign(v) * torch.floor(v.abs() + 0.5)
    inside = (r >= qmin) & (r <= qmax)
    assert (~inside).any() and inside.any()
    assert torch.equal(outs[1][0].double(), r.clamp(qmin, qmax) * sv)
    assert torch.equal(outs[1][1], torch.where(inside, grad, torch.zeros_like(grad)))
    local = torch.where(inside, r - v, r.clamp(qmin, qmax))
    terms = grad.double() * local
    dims = None if axis is None else [d for d in range(x.ndim) if d != axis]
    expected = (terms.sum() if dims is None else terms.sum(dim=dims)) * s * math.log(2.0)
    for got in (outs[0][2], outs[1][2]):
        torch.testing.assert_close(got.double(), expected.reshape(got.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [None, 0], ids=["per tensor", "per channel"])
def test_lsq_compiled_equals_eager_and_the_closed_form(axis: int | None, compiler: None) -> None:
    """LSQ's compiled forward and backward (one pass each, the codes recomputed from the input) against eager (the
    codes kept): the same forward and input-gradient bits, and the scale's gradient torch's learnable estimator,
    computed in float64, to float32 summation rounding."""
    from quark.torch.quantization.fake_quant.learnable_grad import LSQFunction

    torch.manual_seed(2)
    x = torch.randn(ROWS, COLS)
    x[0, :3] = torch.tensor([40.0, -40.0, 0.0])  # clipped both ways, a zero
    channels = 1 if axis is None else ROWS
    scale = torch.linspace(0.011, 0.03, channels)
    zp = torch.zeros(channels, dtype=torch.int32)
    grad = torch.randn_like(x)
    factor = 1.0 / math.sqrt(x.numel() / channels * 127)
    outs, before = [], Backend.compile
    for mode in (False, True):  # (True: compiled at every size, below Backend.min_numel too)
        set_compile(mode)
        try:
            assert compiled_kernels_active(x) is mode
            xg, sg = x.clone().requires_grad_(True), scale.clone().requires_grad_(True)
            y = LSQFunction.apply(xg, sg, zp, -128, 127, factor, axis, RoundType.half_even)
            y.backward(grad)
            outs.append((y.detach(), xg.grad, sg.grad))
            assert Backend.failure is None, Backend.failure
        finally:
            set_compile(before)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    sf = scale if axis is None else scale[:, None]
    s = sf.double()
    q = torch.round(x * torch.reciprocal(sf)).double()  # torch's fake-quant arithmetic: x * (1 / s) in float32
    inside = (q >= -128) & (q <= 127)
    assert (~inside).any()
    torch.testing.assert_close(outs[1][0].double(), q.clamp(-128, 127) * s, rtol=2**-24, atol=0)  # one rounding
    local = torch.where(q < -128, -128.0, torch.where(q > 127, 127.0, q.clamp(-128, 127) - x.double() / s))
    terms = grad.double() * local * factor
    expected = terms.sum().reshape(1) if axis is None else terms.sum(dim=1)
    for got in (outs[0][2], outs[1][2]):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["tqt per channel", "lsq"])
def test_learned_second_order_gradients_are_the_eager_ones(method: str, compiler: None) -> None:
    """A gradient built with ``create_graph`` through TQT / LSQ while their compiled kernels run, differentiated twice
    (``retain_graph``): the backward's terms run as eager ops there (a compiled kernel's graph cannot be
    differentiated twice), so both second-order gradients are eager mode's, in the input and the learned value."""
    from quark.torch.quantization.fake_quant.learnable_grad import LSQFunction, TQTFunction

    torch.manual_seed(3)
    x = torch.randn(ROWS, COLS)
    x[0, :2] = torch.tensor([50.0, -50.0])
    w, v = torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)
    if method == "lsq":
        learned = torch.tensor([0.02])
        fn = lambda t, p: LSQFunction.apply(  # noqa: E731
            t, p, torch.zeros(1, dtype=torch.int32), -128, 127, 0.01, None, RoundType.half_even
        )
    else:
        learned = torch.linspace(-1.0, 1.0, ROWS)
        fn = lambda t, p: TQTFunction.apply(t, p, -128, 127, 7.0, RoundType.half_even, 0)  # noqa: E731
    results, before = [], Backend.compile
    for mode in (False, True):  # (True: compiled at every size, below Backend.min_numel too)
        set_compile(mode)
        try:
            assert compiled_kernels_active(x) is mode
            xg, pg = x.clone().requires_grad_(True), learned.clone().requires_grad_(True)
            first = torch.autograd.grad((fn(xg, pg) * w).sum(), (xg, pg), create_graph=True)
            h = (first[0] * v).sum() + first[1].sum()
            once = torch.autograd.grad(h, (xg, pg), retain_graph=True, allow_unused=True)
            twice = torch.autograd.grad(h, (xg, pg), allow_unused=True)
            results.append([g for g in (*first, *once, *twice)])
            assert Backend.failure is None, Backend.failure
        finally:
            set_compile(before)
    for eager, compiled in zip(*results, strict=True):
        if eager is None:
            assert compiled is None
        else:
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert results[0][2] is not None and bool(results[0][2].abs().sum() > 0)  # a nonzero second order in x


def test_make_fx_records_the_eager_ops(compiler: None) -> None:
    """Under ``make_fx`` the kernels run eagerly even where they would be compiled: FX cannot trace a compiled
    function (it raised under ``QUARK_COMPILE=1`` before), and the graph is to hold the ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    fn, x = _cases()["int8 per-tensor"], _input()
    before = Backend.compile
    set_compile(True)
    try:
        assert compiled_kernels_active(x)
        graph = make_fx(fn)(x)
        assert torch.equal(graph(x), fn(x))
        assert "round" in str(graph.graph)  # the eager body, op by op
    finally:
        set_compile(before)
