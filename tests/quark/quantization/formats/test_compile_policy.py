"""Auto mode's compile policy: eager until a warm-up of ``Backend.warmup_numel`` elements in calls on tensors of at
least ``min_numel``, small tensors never compiled, the first compile logged once; ``QUARK_COMPILE`` = 1 / 0 (always /
never) untouched by the warm-up."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType
from quark.torch.quantization.formats import (
    Backend,
    fake_quantize,
    fake_quantize_int,
    plan_run_end,
    plan_step_end,
    plan_step_start,
    set_compile,
)
from quark.torch.quantization.formats.block import BLOCK_GAIN
from quark.torch.quantization.formats.grouping import compilable, compile_warm, compiled_kernels_active, steady_key
from quark.torch.quantization.formats.integer import INT_MIN_NUMEL
from quark.torch.quantization.formats.kernel_store import store_root
from quark.torch.quantization.formats.minifloat import GRID_MIN_NUMEL

LOGGER = "quark.torch.quantization.formats.grouping"


@pytest.fixture
def policy(backend_state: type, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto mode with a fresh warm-up count and log flag, an empty kernel store of its own, and a run of unknown
    length warm as soon as its warm-up is (``payback_numel`` 0; the tests of the run plan set their own); everything
    restored afterwards (``backend_state``)."""
    monkeypatch.setenv("QUARK_KERNEL_CACHE", str(tmp_path / "store"))
    set_compile(None)
    Backend.seen_numel, Backend.compile_logged, Backend.payback_numel, Backend.warm = 0, False, 0, False
    Backend.loading = Backend.unstored = False


def _doubler() -> Callable[[torch.Tensor], torch.Tensor]:
    @compilable
    def double(t: torch.Tensor) -> torch.Tensor:
        return t * 2

    return double


def test_eager_during_the_warm_up_then_compiled(policy: None, compiles: list[str]) -> None:
    """Three calls of min_numel elements fill a warm-up of 3 * min_numel: they run eagerly, the fourth compiles."""
    n = Backend.min_numel
    Backend.warmup_numel = 3 * n
    double, x = _doubler(), torch.ones(n)
    for i in range(3):
        assert not compile_warm()
        assert torch.equal(double(x), x * 2)
        assert compiles == [] and Backend.seen_numel == (i + 1) * n
    assert compile_warm()
    double(x)
    double(x)
    assert compiles == ["compiled", "compiled"]
    assert Backend.seen_numel == 3 * n  # counting stops once warm


def test_small_tensors_never_compile_nor_count(policy: None, compiles: list[str]) -> None:
    """Below min_numel a kernel runs eagerly before and after the warm-up, and adds nothing to it."""
    Backend.warmup_numel = 0
    double, small = _doubler(), torch.ones(Backend.min_numel - 1)
    for _ in range(5):
        assert torch.equal(double(small), small * 2)
    assert compiles == [] and not compiled_kernels_active(small)
    Backend.warmup_numel = 1
    double(small)
    assert Backend.seen_numel == 0 and not compile_warm()


def test_a_kernels_own_threshold_counts(policy: None, compiles: list[str]) -> None:
    """A kernel with its own min_numel (``aminmax_along``'s style) stays eager below it even when the run is warm."""

    @compilable(min_numel=4 * Backend.min_numel)
    def triple(t: torch.Tensor) -> torch.Tensor:
        return t * 3

    Backend.warmup_numel = 0
    triple(torch.ones(Backend.min_numel))
    assert compiles == []
    triple(torch.ones(4 * Backend.min_numel))
    assert compiles == ["compiled"]


def test_a_kernels_gain_weights_its_count(policy: None, compiles: list[str]) -> None:
    """A kernel made with ``gain=g`` counts g elements per element of its input toward the warm-up and the run plan
    (the block formats' ``BLOCK_GAIN``: compiling saves more of their step); one with the default counts each once."""

    @compilable(gain=5)
    def weighted(t: torch.Tensor) -> torch.Tensor:
        return t * 5

    n = Backend.min_numel
    Backend.warmup_numel = 1 << 60
    x = torch.ones(n)
    _doubler()(x)
    assert Backend.seen_numel == n
    weighted(x)
    assert Backend.seen_numel == 6 * n and compiles == []


def test_mx_kernels_count_with_the_block_gain(policy: None, compiles: list[str]) -> None:
    """An MXFP4 fake quantization (eager, before the warm-up ends) counts its elements times ``BLOCK_GAIN``; an int8
    one of the same tensor counts them at face value, once per kernel call."""
    n = Backend.min_numel
    Backend.warmup_numel = 1 << 60
    x = torch.randn(n // 32, 32)
    out = fake_quantize(x, Dtype.mx, None, None, axis=-1, group_size=32, mx_element_dtype=Dtype.fp4)
    assert Backend.seen_numel == n * BLOCK_GAIN > n and compiles == []
    Backend.seen_numel = 0
    fake_quantize_int(x, torch.tensor(0.1), torch.tensor(0, dtype=torch.int32), -128, 127)
    assert Backend.seen_numel % n == 0 and Backend.seen_numel // n < BLOCK_GAIN
    assert torch.isfinite(out).all() and out.shape == x.shape


def test_first_compile_is_logged_once(policy: None, compiles: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line for the first compile of the process (which kernel, torch's disk cache, QUARK_COMPILE=0); the
    next kernels compile silently."""
    Backend.warmup_numel = 0
    x = torch.ones(Backend.min_numel)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _doubler()(x)
        _doubler()(x)  # a second kernel
        _doubler()(x)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and len(compiles) == 3
    message = records[0].getMessage()
    assert "double" in message and "kept on disk" in message and "QUARK_COMPILE=0" in message


def test_no_log_while_eager(policy: None, compiles: list[str], caplog: pytest.LogCaptureFixture) -> None:
    Backend.warmup_numel = 1 << 40
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _doubler()(torch.ones(Backend.min_numel))
    assert compiles == [] and not [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("mode", [True, False])
def test_quark_compile_1_and_0_ignore_the_warm_up(policy: None, compiles: list[str], mode: bool) -> None:
    """QUARK_COMPILE=1 (True) compiles from the first call, small tensors too; 0 (False) never compiles, warm or not;
    neither counts toward the warm-up."""
    set_compile(mode)
    Backend.warmup_numel = 1 << 40
    double = _doubler()
    double(torch.ones(4))
    double(torch.ones(Backend.min_numel))
    Backend.warmup_numel = 0
    double(torch.ones(Backend.min_numel))
    assert compiles == (["compiled"] * 3 if mode else [])
    assert Backend.seen_numel == 0


def test_calls_after_the_warm_up_give_the_eager_bits(policy: None, compiler: None, served: list[str]) -> None:
    """The real int8 per-channel kernel (forward and straight-through backward) with torch.compile: the eager calls of
    the warm-up and the compiled calls after it give the same bits, and the compiled kernels did run."""
    rows, cols = 256, 256  # 65536 elements: min_numel
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * 3
    grad = torch.randn(rows, cols, generator=g)
    scale = torch.linspace(0.01, 0.05, rows)
    zp = torch.zeros(rows, dtype=torch.int32)
    Backend.warmup_numel = 2 * x.numel()  # the calls before the switch run eagerly
    outs = []
    for _ in range(4):
        warm = compile_warm()  # before the call: False for the first, True for the last (2+ decisions counted)
        xg = x.clone().requires_grad_(True)
        y = fake_quantize_int(xg, scale, zp, -128, 127, qscheme=QSchemeType.per_channel, axis=0)
        y.backward(grad)
        outs.append((y.detach(), xg.grad, warm))
    assert Backend.failure is None, Backend.failure
    assert not outs[0][2] and outs[-1][2]  # eager first, compiled at the end
    assert served, "no compiled kernel ran after the warm-up"
    for y, gx, _ in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(gx, outs[0][1])
    assert not torch.equal(outs[0][0], x)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_small_quantizer_tensors_compile_from_4096_elements_once_warm(
    policy: None, compiler: None, served: list[str], kind: str
) -> None:
    """A QAT layer's small tensors (a 32x512 activation, below ``Backend.min_numel``) take the compiled integer /
    fp8 kernels, forward and straight-through backward, once the run is warm: inside a training step their eager
    chains run with cold caches (docs/performance.md, seventh round). Below 4096 elements they stay eager; the bits
    are the eager path's."""

    def run(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(shape, generator=g) * 3).requires_grad_(True)
        if kind == "int8":
            y = fake_quantize_int(x, torch.tensor(0.02), torch.tensor(0, dtype=torch.int32), -128, 127)
        else:
            y = fake_quantize(x, Dtype.fp8_e4m3, torch.tensor(0.004), None)
        y.backward(torch.randn(shape, generator=g))
        return y.detach(), x.grad  # type: ignore[return-value]

    assert INT_MIN_NUMEL == GRID_MIN_NUMEL == 4096 < Backend.min_numel
    set_compile(False)
    eager = run((32, 512))
    set_compile(None)
    Backend.warmup_numel = 0  # warm: a training run past its first steps
    run((32, 512))  # (the first call may build or load the graphs)
    served.clear()
    compiled = run((32, 512))
    assert len(served) == 2, served  # forward and backward, compiled
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    served.clear()
    run((32, 127))  # 4064 elements: eager
    assert served == []


def _planned_step(kernel: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int, left: int) -> None:
    """One step of a run whose front end tells its length: ``calls`` kernel calls on ``x``, ``left`` steps to go."""
    plan_step_start()
    for _ in range(calls):
        kernel(x)
    plan_step_end(left)


def test_a_run_too_short_to_pay_back_stays_eager(policy: None, compiles: list[str]) -> None:
    """The warm-up is over after the first step, but the run has 4 steps of 2n elements left, fewer than the payback:
    every call runs eagerly, and the run's count is dropped at its end (a test pass after it starts afresh)."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, 9 * n
    double, x = _doubler(), torch.ones(n)
    for left in (4, 3, 2, 1, 0):
        _planned_step(double, x, 2, left)
        assert not compile_warm() and Backend.remaining_numel == 2 * n * left
    assert compiles == []
    plan_run_end()
    assert Backend.seen_numel == 0 and Backend.remaining_numel is None and not compile_warm()


def test_a_long_enough_run_compiles_and_stays_compiled(policy: None, compiles: list[str]) -> None:
    """The first step runs eagerly (its count not measured yet); from its end the run has 5 steps of 2n elements to
    go, at least the payback: the kernels compile, and stay compiled to the end, past the point where less is left,
    and after the run."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, 10 * n
    double, x = _doubler(), torch.ones(n)
    _planned_step(double, x, 2, 5)
    assert compiles == [] and compile_warm() and Backend.remaining_numel is None  # the plan is dropped: warm
    for left in (4, 3, 2, 1, 0):
        _planned_step(double, x, 2, left)
        assert compile_warm()
    assert compiles == ["compiled"] * 10
    plan_run_end()
    assert compile_warm()
    double(x)
    assert len(compiles) == 11


def test_the_warm_up_ends_inside_a_long_enough_step(policy: None, compiles: list[str]) -> None:
    """With enough measured to go, the warm-up ends where its count is reached, in the middle of a step, and the
    kernels stay compiled in the steps after it (that step's count, cut short when the warm-up ended, measures
    nothing: read as 1n x 98 steps, it would fall under the payback)."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = 3 * n, 150 * n
    double, x = _doubler(), torch.ones(n)
    _planned_step(double, x, 2, 100)  # 2n counted, 200n to go: not warm yet (the count is short)
    assert compiles == [] and not compile_warm() and Backend.remaining_numel == 200 * n
    _planned_step(double, x, 3, 99)  # the first call ends the warm-up: the next two compile
    assert compiles == ["compiled", "compiled"] and Backend.remaining_numel is None
    _planned_step(double, x, 3, 98)
    assert compiles == ["compiled"] * 5 and compile_warm()


def test_a_run_of_unknown_length_compiles_once_it_has_counted_the_payback(policy: None, compiles: list[str]) -> None:
    """``plan_step_end(None)`` (an unbounded fit), as a loop that tells nothing: past the warm-up it stays eager until
    it has counted ``payback_numel`` elements (what compiling would have saved is then what a compile costs), and
    compiles from the next step to the end."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, 5 * n
    double, x = _doubler(), torch.ones(n)
    for _ in range(2):
        _planned_step(double, x, 2, None)  # type: ignore[arg-type]
        assert Backend.remaining_numel is None and not compile_warm()
    assert compiles == [] and Backend.seen_numel == 4 * n
    _planned_step(double, x, 2, None)  # type: ignore[arg-type]  # reaches 6n: warm from the next step
    assert compiles == [] and compile_warm()
    _planned_step(double, x, 2, None)  # type: ignore[arg-type]
    for _ in range(3):  # an untold loop after it: compiled too
        double(x)
    assert compiles == ["compiled"] * 5 and Backend.seen_numel == 6 * n


def test_a_loop_that_tells_nothing_stays_eager_below_the_payback(policy: None, compiles: list[str]) -> None:
    """A training loop of the user's own that calls no plan function: eager however far past the warm-up, while it
    has counted fewer than ``payback_numel`` elements (before, it compiled right after the warm-up)."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, 1000 * n
    double, x = _doubler(), torch.ones(n)
    for _ in range(999):
        double(x)
    assert compiles == [] and not compile_warm() and Backend.seen_numel == 999 * n
    double(x)
    double(x)
    assert compiles == ["compiled"]


def test_a_plan_changes_nothing_once_compiling(policy: None, compiles: list[str]) -> None:
    """Warm before the told run starts (an earlier loop that told nothing ended the warm-up): its steps stay
    compiled however short it is."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, n
    double, x = _doubler(), torch.ones(n)
    double(x)
    assert compile_warm() and compiles == []
    Backend.payback_numel = 1 << 60  # the told run below is far too short to pay a compile back
    _planned_step(double, x, 2, 1)
    assert compiles == ["compiled"] * 2 and Backend.remaining_numel is None
    plan_run_end()
    assert compile_warm()


def test_a_short_told_run_keeps_what_a_loop_that_told_nothing_counted(policy: None, compiles: list[str]) -> None:
    """A told run too short to compile drops only its own count: what an untold loop counted toward the payback
    before it is kept, so that loop still compiles where its count reaches the payback."""
    n = Backend.min_numel
    Backend.warmup_numel, Backend.payback_numel = n, 10 * n
    double, x = _doubler(), torch.ones(n)
    for _ in range(9):
        double(x)
    _planned_step(double, x, 3, 0)  # a one-step told run: too short
    plan_run_end()
    assert Backend.seen_numel == 9 * n and not compile_warm() and compiles == []
    double(x)  # the untold loop's tenth call reaches the payback
    double(x)
    assert compiles == ["compiled"]


# --- runs long enough to load the kernels an earlier run stored, not to compile them ---------------------------------


def _store_holds_another_kernel() -> None:
    """The kernel store (the policy fixture's) holds another kernel's graphs, as on a machine that compiled before."""
    root = store_root()
    assert root is not None
    (root / "another-kernel").mkdir(parents=True)


def test_a_run_that_pays_back_a_load_but_finds_nothing_stored_runs_eagerly(policy: None, compiles: list[str]) -> None:
    """After its first step the told run has 4 steps of 2n to go: the stored payback (8n), not the payback (100n), so
    the compiled paths run (``Backend.loading``), counting nothing. Its first kernel call finds nothing stored: it
    runs eagerly, and so does the rest of the run (``Backend.unstored``), counting again for the plan: nothing is
    compiled."""
    _store_holds_another_kernel()
    n = Backend.min_numel
    Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, 8 * n, 100 * n
    double, x = _doubler(), torch.arange(n, dtype=torch.float32)
    _planned_step(double, x, 2, 4)
    assert compile_warm() and Backend.loading and not Backend.warm and Backend.seen_numel == 2 * n
    plan_step_start()  # loading: nothing to measure
    assert Backend.step_mark is None and Backend.remaining_numel is None
    assert torch.equal(double(x), x * 2) and Backend.unstored and not Backend.loading  # found nothing stored
    assert torch.equal(double(x), x * 2) and Backend.seen_numel == 3 * n  # eager again: counted
    plan_step_end(2)
    assert Backend.remaining_numel is None  # that step measured nothing
    for left in (1, 0):
        _planned_step(double, x, 2, left)
        assert Backend.remaining_numel == 2 * n * left and not compile_warm()
    cache = double.kernel_cache  # type: ignore[attr-defined]
    assert compiles == [] and cache.compiles == 0 and cache.eager_calls == 1  # the call that found nothing stored
    plan_run_end()
    assert Backend.seen_numel == 0 and not compile_warm()  # a run too short to compile gives its count back


def test_an_empty_or_switched_off_store_is_never_loaded_from(
    policy: None, compiles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing stored on this machine (or ``QUARK_KERNEL_CACHE=0``): a run that pays back a load does not try one,
    and asks the disk once, not on every call."""
    n = Backend.min_numel
    for setting in (None, "0"):
        if setting is not None:
            monkeypatch.setenv("QUARK_KERNEL_CACHE", setting)
        Backend.seen_numel, Backend.unstored = 0, False
        Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, 2 * n, 100 * n
        double, x = _doubler(), torch.ones(n)
        for _ in range(5):
            double(x)
        assert not Backend.loading and Backend.unstored and Backend.seen_numel == 5 * n, setting
        assert double.kernel_cache.eager_calls == 0  # type: ignore[attr-defined]
    assert compiles == []


def test_a_run_below_the_stored_payback_neither_loads_nor_compiles(policy: None, compiles: list[str]) -> None:
    _store_holds_another_kernel()
    n = Backend.min_numel
    Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, 9 * n, 100 * n
    double, x = _doubler(), torch.ones(n)
    for left in (4, 3, 2, 1, 0):
        _planned_step(double, x, 2, left)
        assert not compile_warm() and not Backend.loading
    assert compiles == [] and double.kernel_cache.eager_calls == 0  # type: ignore[attr-defined]


def test_a_loop_that_found_nothing_stored_still_compiles_at_the_payback(policy: None, compiles: list[str]) -> None:
    """A loop that tells nothing tries loading once it has counted the stored payback (3n), finds nothing stored,
    runs eagerly again, and compiles once it has counted the payback (6n): rent or buy, as without a store."""
    _store_holds_another_kernel()
    n = Backend.min_numel
    Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, 3 * n, 6 * n
    double, x = _doubler(), torch.ones(n)
    for _ in range(4):
        double(x)
    assert Backend.unstored and not compile_warm() and Backend.seen_numel == 3 * n  # the 4th call found nothing
    for _ in range(3):
        double(x)
    assert compiles == [] and Backend.seen_numel == 6 * n and not Backend.warm
    double(x)
    assert Backend.warm and compiles == ["compiled"]


def test_the_steady_paths_stop_with_the_compiled_kernels(policy: None) -> None:
    """A quantizer's steady path (direct kernels called straight) runs only while the compiled kernels do: after a
    run finds a kernel not stored it would serve compiled kernels and count nothing toward the payback."""
    x = torch.ones(8)
    assert steady_key(x) is None  # eager, warming up
    Backend.loading = True
    assert steady_key(x) is not None
    Backend.loading, Backend.unstored = False, True
    assert steady_key(x) is None
    Backend.warm = True
    assert steady_key(x) is not None


def _tripled(t: torch.Tensor) -> torch.Tensor:
    return t * 3


def test_a_run_that_pays_back_a_load_serves_the_kernels_an_earlier_run_stored(policy: None, compiler: None) -> None:
    """Really compiled: an earlier run (``QUARK_COMPILE=1``) stored the kernel's graph; a later run of the same
    kernel (nothing in memory) long enough to pay a load back serves its calls from that graph, bit for bit, and
    compiles and counts nothing. A signature nothing stored serves (float64) ends the loading: the calls after it run
    eagerly, counting, until the run has counted the payback and compiles."""
    n = Backend.min_numel
    x = torch.linspace(-5, 5, n)
    set_compile(True)
    earlier = compilable(_tripled)
    earlier(x)
    assert earlier.kernel_cache.compiles == 1 and earlier.kernel_cache.store.stored == 1
    set_compile(None)
    Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, 2 * n, 6 * n
    later = compilable(_tripled)  # a new process would start like this: the same kernel, nothing in memory
    cache = later.kernel_cache
    later(x)
    later(x)  # the warm-up, eager: 2n counted
    assert cache.store.loaded == 0
    for _ in range(2):
        assert torch.equal(later(x), x * 3)
    assert Backend.loading and not Backend.warm and Backend.seen_numel == 2 * n
    assert cache.store.loaded == 1 and cache.reuses == 1 and cache.compiles == 0 and cache.eager_calls == 0
    y = x.double()
    assert torch.equal(later(y), y * 3) and cache.eager_calls == 1 and cache.compiles == 0
    assert not Backend.loading and Backend.unstored and not compile_warm()
    for _ in range(4):
        later(x)  # eager: 6n counted
    assert cache.eager_calls == 1 and Backend.seen_numel == 6 * n
    assert torch.equal(later(y), y * 3) and Backend.warm and cache.compiles == 1


def test_loading_and_its_end_are_logged_once(
    policy: None, compiles: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    _store_holds_another_kernel()
    n = Backend.min_numel
    Backend.warmup_numel, Backend.stored_payback_numel, Backend.payback_numel = n, n, 100 * n
    double, x = _doubler(), torch.ones(n)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(4):
            double(x)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("QUARK_COMPILE" in line for line in lines)
    assert "enough for loading them to pay back" in lines[0] and "elements quantized" in lines[0]
    assert "not among the stored ones" in lines[1] and "QUARK_DIRECT_KERNELS=2" in lines[1]
