"""Compiled format kernels called without dynamo's per-call guard evaluation.

A ``torch.compile``d function checks its guards on every call: for the format kernels (a plan object with nested
fields, several variants per kernel) that took 50-70 us per call on 2 CPU cores, more than the kernel itself on an
activation of 32x1024 elements (7 us), and a QAT step makes one call per quantizer forward and one per backward.

``KernelCache`` compiles a kernel ahead of time (``aot_compile``, one graph, dynamic shapes) and keeps the result by
the call's exact signature: each tensor's type, dtype, device, shape, strides and ``requires_grad`` (and which
arguments are one tensor passed twice), every other argument by value, and the grad / inference mode. A signature seen before runs the compiled graph directly (a
dictionary lookup, a few microseconds). A new signature is matched once against the guards of the graphs already
built for the kernel (a new batch size reuses the dynamic-shape graph when its guards hold) and only then compiled,
so every call runs a graph whose guards held for exactly that signature: the same results as ``torch.compile``, and
bit-identical to the eager kernel as before (the format tests check that).

Graphs are stored on disk (``kernel_store``) and loaded by later processes instead of compiled again. A cache whose
``may_compile`` says no (auto mode in a run long enough to pay a load back but not a compile) serves a signature
from a stored graph where one fits, and runs the eager kernel where none does (telling ``on_unstored``). A signature
called ``DIRECT_AFTER_CALLS`` times (a quantizer in a training loop) is compiled once more at its exact shapes and
then called straight into inductor's generated code (``direct_kernel``), without the graph's wrapper layers.

Anything the cache cannot key (a tensor subclass such as DTensor or a fake tensor, an unhashable argument) or a
kernel ``aot_compile`` refuses takes the caller's ``torch.compile`` path as before, with its guards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from enum import Enum
from typing import Any

import torch

from quark.torch.quantization.formats.direct_kernel import DirectKernel
from quark.torch.quantization.formats.kernel_store import KernelStore

__all__ = ["KernelCache", "call_signature"]

#: keyed signatures per kernel before the cache stops adding (a model feeding ever new shapes): the guards'
#: answers stay correct beyond it, they are just no longer remembered
MAX_SIGNATURES = 512


def _direct_after_from_env(default: int = 200) -> int | None:
    """``QUARK_DIRECT_KERNELS``: unset or ``1``, the default threshold; ``0``, never; a number ``n`` > 1, after ``n``
    calls. Anything else is refused, naming the variable."""
    setting = os.environ.get("QUARK_DIRECT_KERNELS", "").strip()
    if setting in ("", "1"):
        return default
    if setting == "0":
        return None
    if setting.isdigit():
        return int(setting)
    raise ValueError(f"QUARK_DIRECT_KERNELS={setting!r}: allowed 0 (never), 1 (after {default} calls) or a call count")


#: calls of one signature after which it is compiled at its exact shapes and served directly (None: none built or
#: served; ``QUARK_DIRECT_KERNELS``). A build costs 0.1-0.7 s for int8 and 1.5-5.8 s for MX (0.03-0.12 and 0.14-0.35 s
#: from torch's FX-graph cache) and saves 5 us a call on 2 idle cores, more inside a training step, so a signature
#: seen this often is one of a loop that will run on long enough to pay the build back
DIRECT_AFTER_CALLS: int | None = _direct_after_from_env()

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


#: argument types keyed by value as they are (hashable, and equal exactly when equal for a graph)
_BY_VALUE = (int, bool, str, type(None))


def _key(value: Any, exact: bool) -> Hashable | None:
    """One argument's part of the signature (None: not keyable). A tensor gives its type, dtype, device, rank,
    grad and inference flags and, with ``exact``, its shape and strides (without them: what graphs are reused
    across, as no guard of a graph checks them reliably); anything else its value. Runs on every kernel call: the
    common types are tested first, by exact type."""
    cls = type(value)
    if cls in _PLAIN_TENSORS:
        if exact:  # (torch.Size is a tuple: hashed and compared as one)
            return (
                cls,
                value.dtype,
                value.device,
                value.requires_grad,
                value.is_inference(),
                value.shape,
                value.stride(),
            )
        return (cls, value.dtype, value.device, value.ndim, value.requires_grad, value.is_inference())
    if cls in _BY_VALUE:
        return (cls, value)
    if isinstance(value, torch.Tensor):
        return None  # DTensor, FakeTensor, FunctionalTensor...: torch.compile's own path
    if cls is float:
        return (float, value.hex())  # -0.0 and 0.0 apart, NaN equal to itself
    if isinstance(value, Enum):
        return (cls, value._name_)  # (an Enum hashes in Python code: a call's key is hashed on every lookup)
    if isinstance(value, tuple | list):
        parts = tuple(_key(v, exact) for v in value)
        return None if any(p is None for p in parts) else (cls, parts)
    known = _HASHED.get(id(value))
    if known is not None and known.value[1] is value:
        return known
    try:
        key = _Hashed((cls, value))
    except TypeError:
        return None
    # only a value that cannot change keeps its key by identity: a mutable object that hashes its fields (a dataclass
    # with unsafe_hash) changed in place is another signature, which a remembered key (its old hash) would hide
    if len(_HASHED) < MAX_HASHED and _frozen(cls):
        _HASHED[id(value)] = key  # (it holds ``value``: the id is not reused while it is here)
    return key


def _frozen(cls: type) -> bool:
    """Whether instances of ``cls`` are frozen dataclasses (the plans and formats kernels take): their hash cannot
    change, so their key may be remembered by identity."""
    frozen = _FROZEN.get(cls)
    if frozen is None:
        params = getattr(cls, "__dataclass_params__", None)
        frozen = _FROZEN[cls] = bool(params is not None and params.frozen)
    return frozen


_FROZEN: dict[type, bool] = {}


#: keys of the frozen plans and formats kernels take, by the argument's identity (bounded: see ``_key``)
MAX_HASHED = 4096
_HASHED: dict[int, _Hashed] = {}


class _Hashed:
    """``(type, value)`` as a key whose hash is computed once: a frozen dataclass hashes all its fields (enums in
    Python code) on every hash, and a signature is hashed on every kernel call. Equal, and printed (the kernel
    store names folders by the key's repr), as the tuple it wraps."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple[type, Any]) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is _Hashed and self._hash == other._hash and self.value == other.value  # type: ignore[attr-defined]
        )

    def __repr__(self) -> str:
        return repr(self.value)


def global_state() -> tuple[Hashable, ...]:
    """The global state a graph is built under and its guards would check (grad and inference mode, autocast and
    the dtype it casts to, the default dtype, determinism, torch's thread count, which the CPU kernels are generated
    for)."""
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),  # (False, or the dtype: bf16 != fp16)
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_num_threads(),
    )


def call_signature(args: tuple[Any, ...], kwargs: dict[str, Any], exact: bool = True) -> tuple[Hashable, ...] | None:
    """What a compiled kernel's result depends on besides the tensors' values, as a hashable key (``exact=False``:
    without the tensors' shapes and strides, the part graphs are reused across); None when some argument cannot be
    keyed (then the call takes the guarded path). Non-tensor arguments count by value: a graph built by
    ``aot_compile`` keeps guards on tensors and global state only, none on a plan object or an enum argument."""
    parts: list[Hashable] = [global_state()]
    tensors: list[int] = []  # ids of the tensor arguments: one tensor passed twice is traced as one input
    for value in args:
        if type(value) in _PLAIN_TENSORS:
            tensors.append(id(value))
        key = _key(value, exact)
        if key is None:
            return None
        parts.append(key)
    for name, value in sorted(kwargs.items()) if kwargs else ():
        if type(value) in _PLAIN_TENSORS:
            tensors.append(id(value))
        key = _key(value, exact)
        if key is None:
            return None
        parts.append((name, key))
    if len(tensors) > 1 and len(set(tensors)) < len(tensors):
        # dynamo and AOTAutograd trace a tensor passed twice as one input (the graph then reads one of the two
        # arguments for both): which arguments are the same tensor is part of the signature
        parts.append(("same tensors", tuple(tensors.index(t) for t in tensors)))
    return tuple(parts)


def _as_leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a graph is built from: each tensor that is not a leaf (a saved activation given to a backward
    kernel) as a leaf view of it with the same grad flag, and each Parameter holding a ``.grad`` (a weight after
    its first backward) as a Parameter alias of it without one; one alias per tensor (a tensor passed twice stays
    one). dynamo's guard serialization reads ``.grad`` of every example tensor: for a non-leaf that makes torch warn
    the user about a ``.grad`` nobody asked for, and a Parameter's gradient is stored as a placeholder that fails to
    load, so the stored graph of every weight kernel compiled mid-training was skipped, and compiled again, by every
    later run (an MX QAT fit: 10 s a run). No guard depends on leafness or on ``.grad``."""
    views: dict[int, torch.Tensor] = {}

    def leaf(value: Any) -> Any:
        if type(value) is torch.Tensor and not value.is_leaf:
            if id(value) not in views:
                views[id(value)] = value.detach().requires_grad_(value.requires_grad)
            return views[id(value)]
        if isinstance(value, torch.nn.Parameter) and value.grad is not None:
            if id(value) not in views:
                views[id(value)] = type(value)(value.detach(), requires_grad=value.requires_grad)
            return views[id(value)]
        return value

    return tuple(leaf(a) for a in args), {k: leaf(v) for k, v in kwargs.items()}


class _Entry:
    """What serves one signature: its ``aot_compile`` graph (False: refused; None: the eager kernel, as nothing
    stored serves it and compiling was not allowed), whether its direct kernel was built by an earlier run (torch's
    FX-graph cache holds it), the calls it served, and its direct kernel once it has one."""

    __slots__ = ("graph", "direct_stored", "calls", "direct", "refused")

    def __init__(self, graph: Any, direct_stored: bool) -> None:
        self.graph = graph
        self.direct_stored = direct_stored
        self.calls = 0
        self.direct: DirectKernel | None = None
        self.refused = False  # a direct kernel was tried and cannot serve this signature


class KernelCache:
    """``fn`` compiled per call signature and called without guard evaluation (module docstring).

    ``options`` are inductor's, as for ``torch.compile``. ``may_compile`` (checked at each new signature; default:
    always) says whether a signature no stored graph serves may be compiled; where it may not, the eager ``fn`` serves
    it (``on_unstored`` is called), and a direct kernel is built only where an earlier run built it, until it may.
    Calling returns the kernel's result, or raises ``LookupError`` when this signature cannot be served here (the
    caller then runs its guarded compiled function).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        options: dict[str, Any] | None = None,
        on_compile: Callable[[], None] | None = None,
        may_compile: Callable[[], bool] | None = None,
        on_unstored: Callable[[], None] | None = None,
    ) -> None:
        self.fn = fn
        self.options = options
        self.on_compile = on_compile  # called before each compile (the first-compile log line)
        self.may_compile = may_compile or (lambda: True)
        self.on_unstored = on_unstored
        self.store = KernelStore(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}")
        self._by_signature: dict[tuple[Hashable, ...], _Entry] = {}
        #: graphs built per signature without shapes and strides: what a new shape is checked against
        self._by_family: dict[tuple[Hashable, ...], list[Any]] = {}
        self._lock = threading.Lock()
        #: graphs built (compiles), signatures that reused a graph after its guards held, signatures served by a
        #: direct kernel, and calls the eager kernel served (nothing stored fit, compiling not allowed), for tests and
        #: logs
        self.compiles = 0
        self.reuses = 0
        self.directs = 0
        self.eager_calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = call_signature(args, kwargs)
        if key is None:
            raise LookupError("unkeyable arguments")
        entry = self._by_signature.get(key)
        if entry is None or (entry.graph is None and self.may_compile()):
            entry = self._graph_for(key, args, kwargs)
        if entry.direct is not None and DIRECT_AFTER_CALLS is not None:
            return entry.direct(args)
        if entry.graph is None:  # nothing stored serves it and compiling is not allowed (yet)
            self.eager_calls += 1
            if self.on_unstored is not None:
                self.on_unstored()
            return self.fn(*args, **kwargs)
        if entry.graph is False:
            raise LookupError("aot_compile refused this kernel")
        entry.calls += 1
        if (
            DIRECT_AFTER_CALLS is not None
            and entry.calls >= DIRECT_AFTER_CALLS
            and not entry.refused
            and (entry.direct_stored or self.may_compile())  # (a stored one: a load from torch's graph cache)
        ):
            return self._go_direct(key, entry, args, kwargs)
        return entry.graph.fn(*args, **kwargs)

    def direct_for(self, args: tuple[Any, ...]) -> DirectKernel | None:
        """The direct kernel serving these (positional) arguments now, None where none does yet: for a caller that
        keeps it and calls it itself while the signature stays the same (``PreparedInt``'s steady path)."""
        if DIRECT_AFTER_CALLS is None:
            return None
        key = call_signature(args, {})
        entry = self._by_signature.get(key) if key is not None else None
        return entry.direct if entry is not None else None

    def _go_direct(
        self, key: tuple[Hashable, ...], entry: _Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """This call through the graph, and from now on the signature's direct kernel where one serves it exactly
        (recorded in the store, so a later run that may only load builds it from torch's graph cache)."""
        out = entry.graph.fn(*args, **kwargs)
        with self._lock:
            if entry.direct is None and not entry.refused:  # (another thread may have built or refused it meanwhile)
                if self.on_compile is not None and not entry.direct_stored:  # (a stored one loads: no compile)
                    self.on_compile()
                entry.direct = DirectKernel.build(self.fn, args, kwargs, out, self.options)
                entry.refused = entry.direct is None
                if entry.direct is not None:
                    self.directs += 1
                    if not entry.direct_stored:
                        self.store.mark_direct(call_signature(args, kwargs, exact=False), key)  # type: ignore[arg-type]
        return out

    def _graph_for(self, key: tuple[Hashable, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Entry:
        """The graph serving a new signature: one built for the same arguments but other shapes whose guards (on the
        tensors' shapes and strides, and the global state) hold for these, else a new one (False where
        ``aot_compile`` fails: that signature keeps the guarded path; None where ``may_compile`` says no: the eager
        kernel serves it)."""
        family = call_signature(args, kwargs, exact=False)
        with self._lock:
            graphs = self._by_family.get(family)  # type: ignore[arg-type]
            if graphs is None:  # first sight in this process: what earlier runs stored
                graphs = self._by_family[family] = self.store.load(family)  # type: ignore[index,arg-type]
            for graph in graphs:
                if graph.guard_check(*args, **kwargs):
                    self.reuses += 1
                    return self._remember(key, graph, self.store.has_direct(family, key))  # type: ignore[arg-type]
            if not self.may_compile():
                return self._remember(key, None, False)
            if self.on_compile is not None:
                self.on_compile()
            try:
                graph = self._compile(args, kwargs)
            except Exception:  # noqa: BLE001 - any refusal (graph break, unsupported op): the guarded path serves it
                return self._remember(key, False, False)
            self.compiles += 1
            graphs.append(graph)
            self.store.save(family, graph)  # type: ignore[arg-type]
            return self._remember(key, graph, False)

    def _remember(self, key: tuple[Hashable, ...], graph: Any, direct_stored: bool) -> _Entry:
        entry = _Entry(graph, direct_stored)
        if key in self._by_signature or len(self._by_signature) < MAX_SIGNATURES:
            self._by_signature[key] = entry
        return entry

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One graph for these arguments: dynamic shapes without duck sizing (equal example sizes are not assumed
        equal forever), Python floats as constants (they are part of the signature)."""
        from torch.fx.experimental import _config as fx_config

        # a Parameter (a weight) keeps its shape for good: a graph for its static shape is faster (4096x1024 int8 per
        # channel from DRAM: 3.0 against 3.4 ms); activations get dynamic shapes (a new batch size reuses the graph)
        dynamic = not isinstance(args[0], torch.nn.Parameter) if args else True
        with torch._dynamo.config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False):
            compiled = torch.compile(self.fn, dynamic=dynamic, fullgraph=True, options=self.options)
            graph = compiled.aot_compile(_as_leaves(args, kwargs))
        graph.disable_guard_check()
        return graph
