"""KernelCache: compiled format kernels keyed by call signature, called without dynamo's guard evaluation.

Each test checks the cached result against the eager kernel (bit for bit) in the situations where a graph without
guards could go wrong: another value of a non-tensor argument (aot_compile keeps no guard on it), another shape
(the dynamic graph reused only where its guards hold), size-1 dims, strided inputs, tensor subclasses.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.formats import kernel_cache
from quark.torch.quantization.formats.kernel_cache import KernelCache, call_signature


def _int_fq(x: torch.Tensor, s: torch.Tensor, qmin: int, qmax: int, method: RoundType) -> torch.Tensor:
    v = x * torch.reciprocal(s)
    if method == RoundType.floor:
        q = torch.floor(v)
    elif method == RoundType.round:
        r, t = torch.round(v), torch.trunc(v)
        q = torch.where((v - t).abs() == 0.5, t + torch.sign(v), r)
    else:
        q = torch.round(v)
    return q.clamp(qmin, qmax) * s


def _x(*shape: int) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(*shape) * 3
    x.view(-1)[:4] = torch.tensor([0.05, -0.05, 0.15, 2.5])  # exact ties of x / 0.1 for the half-away rounding
    return x


@pytest.fixture(autouse=True)
def _own_store(tmp_path, monkeypatch) -> None:
    """Each test its own empty graph store: nothing compiled by another test is loaded."""
    monkeypatch.setenv("QUARK_KERNEL_CACHE", str(tmp_path))


@pytest.fixture
def cache() -> KernelCache:
    return KernelCache(_int_fq)


def test_non_tensor_arguments_are_keyed_by_value(cache: KernelCache) -> None:
    x, s = _x(16, 64), torch.tensor(0.1)
    for method in (RoundType.half_even, RoundType.round, RoundType.floor):
        assert torch.equal(cache(x, s, -128, 127, method), _int_fq(x, s, -128, 127, method)), method
    assert torch.equal(cache(x, s, -8, 7, RoundType.half_even), _int_fq(x, s, -8, 7, RoundType.half_even))
    # every value a graph of its own: aot_compile's graphs keep no guard that would tell the rounding modes apart
    assert cache.compiles == 4 and cache.reuses == 0
    assert not torch.equal(_int_fq(x, s, -128, 127, RoundType.round), _int_fq(x, s, -128, 127, RoundType.half_even))


def test_a_new_shape_reuses_the_dynamic_graph_where_its_guards_hold(cache: KernelCache) -> None:
    s = torch.tensor(0.1)
    for shape in ((16, 64), (32, 64), (7, 300), (16, 64)):
        x = _x(*shape)
        assert torch.equal(cache(x, s, -128, 127, RoundType.half_even), _int_fq(x, s, -128, 127, RoundType.half_even))
    assert cache.compiles == 1 and cache.reuses == 2  # the repeated shape is a dictionary hit


def test_size_one_dims_and_strided_inputs_get_graphs_that_fit(cache: KernelCache) -> None:
    s = torch.tensor(0.1)
    cache(_x(16, 64), s, -128, 127, RoundType.half_even)
    for x in (_x(1, 64), _x(16, 1), _x(64, 16).t(), _x(16, 128)[:, ::2]):
        assert torch.equal(cache(x, s, -128, 127, RoundType.half_even), _int_fq(x, s, -128, 127, RoundType.half_even))
    assert cache.compiles >= 2  # the 0/1-specialised and stride guards of the first graph do not hold for all


def test_a_per_channel_scale_of_another_length(cache: KernelCache) -> None:
    for rows in (8, 24):
        x, s = _x(rows, 32), torch.linspace(0.05, 0.2, rows).reshape(rows, 1)
        assert torch.equal(cache(x, s, -128, 127, RoundType.half_even), _int_fq(x, s, -128, 127, RoundType.half_even))


def test_unkeyable_arguments_go_to_the_guarded_path(cache: KernelCache) -> None:
    x, s = _x(4, 8), torch.tensor(0.1)
    with pytest.raises(LookupError):
        cache(x, s, -128, 127, [RoundType.half_even, {}])  # a dict inside: not hashable
    assert call_signature((x, {"a": 1}), {}) is None
    assert cache.compiles == 0


def test_signature_parts() -> None:
    x = torch.zeros(2, 3)
    base = call_signature((x, 1.0), {})
    assert base == call_signature((torch.ones(2, 3), 1.0), {})  # values do not count, layout does
    assert base != call_signature((torch.zeros(3, 2), 1.0), {})
    assert base != call_signature((x.double(), 1.0), {})
    assert base != call_signature((x, 3.0), {})
    assert call_signature((x, 0.0), {}) != call_signature((x, -0.0), {})  # 0.0 and -0.0 apart
    assert call_signature((x, True), {}) != call_signature((x, 1), {})
    assert base != call_signature((x.requires_grad_(True), 1.0), {})
    with torch.no_grad():
        assert call_signature((torch.zeros(2, 3), 1.0), {}) != base  # grad mode counts
    loose = call_signature((torch.zeros(2, 3), 1.0), {}, exact=False)
    assert loose == call_signature((torch.zeros(5, 3), 1.0), {}, exact=False)


def test_global_state_is_part_of_the_signature() -> None:
    x = torch.zeros(2, 3)
    base = call_signature((x,), {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)  # the CPU kernels are generated for a thread count
    try:
        assert call_signature((x,), {}) != base
    finally:
        torch.set_num_threads(threads)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call_signature((x,), {}) != base
        bf16 = call_signature((x,), {})
    with torch.autocast("cpu", dtype=torch.float16):
        assert call_signature((x,), {}) != bf16  # autocast's dtype counts: a graph traced for bf16 casts to bf16
    with torch.inference_mode():
        assert call_signature((x,), {}) != base
    assert call_signature((x,), {}) == base


def test_graphs_are_stored_and_loaded_by_a_later_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("QUARK_KERNEL_CACHE", str(tmp_path))
    x, s = _x(16, 64), torch.tensor(0.1)
    first = KernelCache(_int_fq)
    first(x, s, -128, 127, RoundType.round)
    assert first.compiles == 1 and first.store.stored == 1
    (stored,) = tmp_path.rglob("*.graph")
    assert not stored.is_symlink() and not list(tmp_path.rglob("*.tmp"))
    later = KernelCache(_int_fq)  # a new process would start like this
    for shape in ((16, 64), (40, 64)):  # the stored dynamic graph serves another batch size after its guards hold
        xs = _x(*shape)
        assert torch.equal(later(xs, s, -128, 127, RoundType.round), _int_fq(xs, s, -128, 127, RoundType.round))
    assert later.compiles == 0 and later.store.loaded == 1
    later(x, s, -128, 127, RoundType.floor)  # another rounding: its own graph, compiled and stored beside
    assert later.compiles == 1 and len(list(tmp_path.rglob("*.graph"))) == 2


def test_an_unreadable_stored_graph_is_skipped_and_the_store_can_be_off(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("QUARK_KERNEL_CACHE", str(tmp_path))
    x, s = _x(8, 32), torch.tensor(0.1)
    KernelCache(_int_fq)(x, s, -128, 127, RoundType.half_even)
    (stored,) = tmp_path.rglob("*.graph")
    stored.write_bytes(stored.read_bytes()[:100])  # truncated
    cache = KernelCache(_int_fq)
    assert torch.equal(cache(x, s, -128, 127, RoundType.half_even), _int_fq(x, s, -128, 127, RoundType.half_even))
    assert cache.store.loaded == 0 and cache.compiles == 1
    monkeypatch.setenv("QUARK_KERNEL_CACHE", "0")
    off = KernelCache(_int_fq)
    off(x, s, -128, 127, RoundType.half_even)
    assert off.compiles == 1 and off.store.stored == 0 and len(list(tmp_path.rglob("*.graph"))) == 2


# --- direct kernels: a signature called often is served straight into inductor's generated code ---------------------


@pytest.fixture
def direct_after(monkeypatch) -> int:
    monkeypatch.setattr(kernel_cache, "DIRECT_AFTER_CALLS", 3)
    return 3


def _calls(cache: KernelCache, n: int, *args):
    return [cache(*args) for _ in range(n)]


def test_a_signature_called_often_is_served_directly_with_the_same_bits(direct_after: int) -> None:
    s = torch.tensor(0.1)
    for method in (RoundType.half_even, RoundType.round, RoundType.floor):
        cache = KernelCache(_int_fq)
        x = _x(16, 64)
        outs = _calls(cache, direct_after + 2, x, s, -128, 127, method)
        assert cache.directs == 1, method
        for out in outs:
            assert torch.equal(out.view(torch.int32), _int_fq(x, s, -128, 127, method).view(torch.int32)), method
        (entry,) = cache._by_signature.values()
        entry.graph = None  # from now on only the direct kernel can serve the signature
        y = _x(16, 64) * 2
        assert torch.equal(cache(y, s, -128, 127, method), _int_fq(y, s, -128, 127, method))
    # another signature (a shape, a value) counts its own calls and keeps its graph until then
    other = _x(8, 64)
    assert torch.equal(cache(other, s, -8, 7, RoundType.floor), _int_fq(other, s, -8, 7, RoundType.floor))
    assert cache.directs == 1


def _pair(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return torch.round(x / s) * s, {"amax": x.abs().amax(dim=-1)}


def test_a_kernel_returning_several_tensors_keeps_its_structure(direct_after: int) -> None:
    cache = KernelCache(_pair)
    x, s = _x(16, 64), torch.tensor(0.1)
    *_, (out, stats) = _calls(cache, direct_after + 1, x, s)
    assert cache.directs == 1
    ref_out, ref_stats = _pair(x, s)
    assert torch.equal(out, ref_out) and list(stats) == ["amax"] and torch.equal(stats["amax"], ref_stats["amax"])


def _writes_input(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    acc.add_(x.sum())
    return x * 2


def _returns_input(x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, x * s


def _random(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + torch.rand_like(x))


def test_kernels_that_are_not_pure_functions_of_their_tensors_keep_their_graph(direct_after: int, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="quark.torch.quantization.formats.direct_kernel")
    x = _x(16, 64)
    acc = torch.zeros(())
    cache = KernelCache(_writes_input)
    _calls(cache, direct_after + 2, x, acc)
    assert cache.directs == 0 and torch.allclose(acc, x.sum() * (direct_after + 2))  # every call wrote it
    cache = KernelCache(_returns_input)
    out, _ = _calls(cache, direct_after + 1, x, torch.tensor(0.5))[-1]
    assert cache.directs == 0 and out.data_ptr() == x.data_ptr()
    cache = KernelCache(_random)
    _calls(cache, direct_after + 1, x)
    assert cache.directs == 0
    reasons = [r.getMessage() for r in caplog.records]
    assert any("_writes_input" in r and "writes an input in place" in r for r in reasons), reasons
    assert any("_returns_input" in r and "shares an input's memory" in r for r in reasons), reasons
    assert any("_random" in r and "random numbers" in r for r in reasons), reasons


def test_a_graph_autograd_records_keeps_its_graph(direct_after: int) -> None:
    cache = KernelCache(_int_fq)
    x = _x(16, 64).requires_grad_()
    out = _calls(cache, direct_after + 1, x, torch.tensor(0.1), -128, 127, RoundType.half_even)[-1]
    assert cache.directs == 0 and out.requires_grad


def test_a_direct_kernel_whose_result_differs_is_not_used(direct_after: int, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="quark.torch.quantization.formats.direct_kernel")
    import torch._inductor.compile_fx as compile_fx

    real = compile_fx.compile_fx_inner

    def wrong(gm, inputs):
        compiled = real(gm, inputs)

        class Off:
            @staticmethod
            def current_callable(args):
                return [t + 1 for t in compiled.current_callable(args)]

        return Off

    monkeypatch.setattr(compile_fx, "compile_fx_inner", wrong)
    cache = KernelCache(_int_fq)
    x, s = _x(16, 64), torch.tensor(0.1)
    outs = _calls(cache, direct_after + 2, x, s, -128, 127, RoundType.half_even)
    assert cache.directs == 0 and any("differs" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(o, _int_fq(x, s, -128, 127, RoundType.half_even)) for o in outs)


def test_direct_kernels_follow_the_environment(monkeypatch) -> None:
    for setting, expected in (("", 200), ("1", 200), ("0", None), ("50", 50)):
        monkeypatch.setenv("QUARK_DIRECT_KERNELS", setting)
        assert kernel_cache._direct_after_from_env() == expected, setting
    monkeypatch.setenv("QUARK_DIRECT_KERNELS", "often")
    with pytest.raises(ValueError, match="QUARK_DIRECT_KERNELS='often'"):
        kernel_cache._direct_after_from_env()


def _twice_plus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * 2 + b


def test_one_tensor_passed_twice_is_another_signature() -> None:
    """dynamo traces ``f(x, x)`` with one input: a graph built for it and served to ``f(x, y)`` read ``x`` twice."""
    x, y = torch.ones(4, 8), torch.full((4, 8), 10.0)
    assert call_signature((x, x), {}) != call_signature((x, y), {})
    assert call_signature((x, y), {}) == call_signature((y, x), {})
    assert call_signature((x,), {"b": x}) != call_signature((x,), {"b": y})
    cache = KernelCache(_twice_plus)
    assert torch.equal(cache(x, x), _twice_plus(x, x))
    assert torch.equal(cache(x, y), _twice_plus(x, y)) and cache.compiles == 2


@dataclass(unsafe_hash=True)
class _MutableMode:
    mode: str


def _round_by(x: torch.Tensor, how: _MutableMode) -> torch.Tensor:
    return (torch.round(x * 8) if how.mode == "round" else torch.floor(x * 8)) / 8


def test_a_mutable_argument_changed_in_place_is_keyed_by_its_new_value() -> None:
    """Only a frozen argument's key is remembered by identity: an object hashed by its fields and changed in place is
    another signature, not the one its old value was compiled for."""
    cache = KernelCache(_round_by)
    x = torch.linspace(-1, 1, 64)
    how = _MutableMode("round")
    assert torch.equal(cache(x, how), _round_by(x, how))
    how.mode = "floor"
    assert torch.equal(cache(x, how), _round_by(x, how)) and cache.compiles == 2


class _MinMax(NamedTuple):
    lo: torch.Tensor
    hi: torch.Tensor


def _named(x: torch.Tensor) -> _MinMax:
    return _MinMax(x.amin() * 2, x.amax() * 2)


def _aminmax(x: torch.Tensor) -> torch.return_types.aminmax:
    return torch.aminmax(x * 3)


def test_a_direct_kernel_returns_named_tuples_as_their_type(direct_after: int) -> None:
    """A namedtuple compares equal to the plain tuple of its fields: the direct kernel still rebuilds its type."""
    x = _x(8, 16)
    named, aminmax = KernelCache(_named), KernelCache(_aminmax)
    pair = _calls(named, direct_after + 1, x)[-1]
    stats = _calls(aminmax, direct_after + 1, x)[-1]
    assert named.directs == 1 and aminmax.directs == 1
    assert type(pair) is _MinMax and torch.equal(pair.hi, x.amax() * 2)
    assert type(stats) is torch.return_types.aminmax and torch.equal(stats.max, (x * 3).amax())


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def test_a_graph_traced_under_one_autocast_dtype_does_not_serve_another(direct_after: int) -> None:
    a, b = _x(8, 16), _x(16, 4)
    cache = KernelCache(_mm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(out.dtype == torch.bfloat16 for out in _calls(cache, direct_after + 1, a, b))
    assert cache.directs == 1
    with torch.autocast("cpu", dtype=torch.float16):
        assert cache(a, b).dtype == torch.float16 == _mm(a, b).dtype


def test_a_refused_signature_is_not_built_again(direct_after: int, monkeypatch) -> None:
    """A thread that passed the refusal check while another thread's build was refusing waits for the lock, then
    keeps the graph instead of compiling the same refusal again."""
    from quark.torch.quantization.formats.direct_kernel import DirectKernel

    builds: list[str] = []
    monkeypatch.setattr(DirectKernel, "build", classmethod(lambda cls, fn, *rest: builds.append(fn.__name__)))
    cache = KernelCache(_int_fq)
    args = (_x(16, 64), torch.tensor(0.1), -128, 127, RoundType.half_even)
    _calls(cache, direct_after + 2, *args)
    assert builds == ["_int_fq"] and cache.directs == 0
    ((key, entry),) = cache._by_signature.items()
    assert torch.equal(cache._go_direct(key, entry, args, {}), _int_fq(*args))  # the late thread
    assert builds == ["_int_fq"]


def test_direct_kernels_off_serves_the_graph_again(direct_after: int, monkeypatch) -> None:
    cache = KernelCache(_int_fq)
    x, s = _x(16, 64), torch.tensor(0.1)
    _calls(cache, direct_after + 1, x, s, -128, 127, RoundType.half_even)
    (entry,) = cache._by_signature.values()
    assert entry.direct is not None

    def not_served(args):
        raise AssertionError("a direct kernel served the call with direct kernels off")

    entry.direct = not_served
    monkeypatch.setattr(kernel_cache, "DIRECT_AFTER_CALLS", None)
    assert torch.equal(cache(x, s, -128, 127, RoundType.half_even), _int_fq(x, s, -128, 127, RoundType.half_even))


def test_a_saved_activation_passed_to_a_kernel_compiles_without_torch_warning_about_grad(cache: KernelCache) -> None:
    """A backward kernel gets the saved input, a non-leaf that requires grad: building its graph must not warn the
    user about reading ``.grad`` (dynamo's guard serialization reads it for every example tensor)."""
    x = _x(16, 64).requires_grad_() * 2  # not a leaf
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cache(x, torch.tensor(0.1), -128, 127, RoundType.half_even)
    assert cache.compiles == 1
    assert not [w for w in caught if ".grad attribute" in str(w.message)]
    assert torch.equal(out, _int_fq(x.detach(), torch.tensor(0.1), -128, 127, RoundType.half_even))


def test_a_weights_graph_compiled_after_a_backward_is_loaded_by_a_later_cache(tmp_path) -> None:
    """A weight kernel compiled mid-training gets a Parameter that holds a ``.grad``: its stored graph must load in a
    later process and serve the weight there without a compile (dynamo's guard serialization stored the gradient as a
    placeholder that failed to load: every later run skipped the graph and compiled it again, and the store grew)."""
    w = torch.nn.Parameter(_x(32, 64))
    w.grad = torch.ones_like(w)
    s = torch.tensor(0.1)
    first = KernelCache(_int_fq)
    with torch.no_grad():
        expected = first(w, s, -128, 127, RoundType.half_even)
    assert first.compiles == 1 and first.store.stored == 1 and torch.equal(w.grad, torch.ones_like(w))
    later = KernelCache(_int_fq)  # a new process would start like this
    with torch.no_grad():
        out = later(w, s, -128, 127, RoundType.half_even)
    assert later.store.loaded == 1 and later.compiles == 0 and later.reuses == 1
    assert torch.equal(out, expected) and torch.equal(out, _int_fq(w.detach(), s, -128, 127, RoundType.half_even))
    assert len(list(tmp_path.rglob("*.graph"))) == 1


def test_a_direct_kernel_built_again_is_loaded_from_torchs_graph_cache(direct_after: int) -> None:
    """A later process builds each steady signature's direct kernel again: the build must reach torch's FX-graph cache
    (inductor skips it without a shape environment, and the MX kernels then took 1.5-4.4 s each to lower again in
    every warm run, against 0.14-0.35 s loaded)."""
    from torch._dynamo.utils import counters

    x, s = _x(16, 64), torch.tensor(0.1)
    expected = _int_fq(x, s, -128, 127, RoundType.half_even)
    counters["inductor"].clear()
    for _ in range(2):  # the second cache starts as a new process would; the first stored the compiled graph
        cache = KernelCache(_int_fq)
        outs = _calls(cache, direct_after + 1, x, s, -128, 127, RoundType.half_even)
        assert cache.directs == 1 and all(torch.equal(out, expected) for out in outs)
    assert counters["inductor"]["fxgraph_cache_bypass"] == 0
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1


# --- a cache that may not compile (auto mode loading the kernels an earlier run stored) -------------------------------


def test_a_cache_that_may_not_compile_serves_stored_graphs_and_runs_the_rest_eagerly(direct_after: int) -> None:
    """A stored signature is served by its graph; one nothing stored serves runs the eager kernel (``on_unstored``
    told), without a compile or a direct kernel, until compiling is allowed again. No direct kernel either for the
    stored one: the earlier run never built it, so torch's graph cache does not hold it (a build would lower it)."""
    x, s = _x(16, 64), torch.tensor(0.1)
    KernelCache(_int_fq)(x, s, -128, 127, RoundType.round)  # an earlier run, one call: no direct kernel built
    allowed, unstored = [False], []
    later = KernelCache(_int_fq, may_compile=lambda: allowed[0], on_unstored=lambda: unstored.append(1))
    for method in (RoundType.round, RoundType.floor):
        outs = _calls(later, direct_after + 2, x, s, -128, 127, method)
        assert all(torch.equal(out, _int_fq(x, s, -128, 127, method)) for out in outs), method
    assert later.store.loaded == 1 and later.reuses == 1 and later.compiles == 0 and later.directs == 0
    assert later.eager_calls == direct_after + 2 and len(unstored) == direct_after + 2  # the floor calls
    allowed[0] = True
    out = later(x, s, -128, 127, RoundType.floor)
    assert later.compiles == 1 and torch.equal(out, _int_fq(x, s, -128, 127, RoundType.floor))
    assert later.eager_calls == direct_after + 2


def test_a_cache_that_may_not_compile_builds_the_direct_kernels_an_earlier_run_built(direct_after: int) -> None:
    """The earlier run built the signature's direct kernel (and marked it in the store): a later cache that may not
    compile builds it too, from torch's graph cache (no lowering), with the same bits."""
    from torch._dynamo.utils import counters

    x, s = _x(16, 64), torch.tensor(0.1)
    expected = _int_fq(x, s, -128, 127, RoundType.half_even)
    earlier = KernelCache(_int_fq)
    _calls(earlier, direct_after + 1, x, s, -128, 127, RoundType.half_even)
    assert earlier.directs == 1
    counters["inductor"].clear()
    later = KernelCache(_int_fq, may_compile=lambda: False)
    outs = _calls(later, direct_after + 2, x, s, -128, 127, RoundType.half_even)
    assert all(torch.equal(out, expected) for out in outs)
    assert later.directs == 1 and later.compiles == 0 and later.eager_calls == 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0 and counters["inductor"]["fxgraph_cache_hit"] >= 1
