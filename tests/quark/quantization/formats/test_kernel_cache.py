"""KernelCache: compiled format kernels keyed by call signature, called without dynamo's guard evaluation.

Each test checks the cached result against the eager kernel (bit for bit) in the situations where a graph without
guards could go wrong: another value of a non-tensor argument (aot_compile keeps no guard on it), another shape
(the dynamic graph reused only where its guards hold), size-1 dims, strided inputs, tensor subclasses.
"""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import RoundType
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
