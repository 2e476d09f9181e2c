"""A format kernel compiled for one exact call signature and called straight into inductor's generated code.

A graph from ``aot_compile`` (``kernel_cache``) is reached through dynamo's bytecode and AOTAutograd's runtime
wrappers: about a hundred Python calls per kernel call (14 us on 2 idle cores for an int8 fake quantization of
32x1024 elements, against 4 us for the generated code alone), and more inside a training step, whose streams of
weights and optimizer state evict the interpreter's objects from the cache. A signature called often (a quantizer in
a training loop: the same shapes every step) is therefore traced once more at its exact shapes
(``aot_export_joint_simple``: functional, with inductor's decompositions, on fake tensors) and compiled by
``compile_fx_inner``; the call is then a list of tensors into the generated ``call``. torch's FX-graph cache keeps the
compiled code on disk (looked up under a tracing context of its own), so a later process builds one in 0.03-0.12 s
for int8 and 0.14-0.35 s for MX instead of 0.1-0.7 s and 1.5-4.4 s (2 cores).

Only kernels that are pure functions of their tensors are served so: no input written in place, no output sharing
an input's memory, no random numbers, and no graph that autograd records (grad mode on with an input that requires
grad). The first direct call is checked against the graph that served the signature before (the same values, NaN
included); anything else (a refusal, a compile error, another value) keeps that graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["DirectKernel"]

_log = logging.getLogger(__name__)


def _storages(tensors: Sequence[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape, strides and values, NaN where the other has NaN (the sign of a zero may differ: the graph
    and the direct kernel decompose some ops differently, e.g. -0.0 from ``(q - zp) * s`` in one and 0.0 in the
    other, which no later op tells apart but a division by it)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _random_op(gm: torch.fx.GraphModule) -> str | None:
    """The first op of the traced graph that draws random numbers (None: none does). Writes to an input and outputs
    sharing an input's memory are refused before: the export refuses the first, the reference result shows the
    second."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return str(node.target)
    return None


class DirectKernel:
    """``fn(*args, **kwargs)`` for one exact signature as inductor's generated code, called with the tensors only
    (every other argument is a constant of the graph, as it is part of the signature)."""

    __slots__ = ("_call", "_positions", "_spec", "_shape")

    def __init__(self, call: Callable[[list[torch.Tensor]], Any], positions: tuple[int, ...], spec: Any) -> None:
        self._call = call
        self._positions = positions
        self._spec = spec
        # the result's structure: one tensor, a flat tuple of them, or anything else (pytree; some us a call)
        numbered = pytree.tree_unflatten(list(range(spec.num_leaves)), spec)
        # (a namedtuple, torch.return_types included, compares equal to the plain tuple but is rebuilt as its type)
        plain = type(numbered) is tuple and numbered == tuple(range(spec.num_leaves))
        self._shape = "one" if numbered == 0 else "tuple" if plain else "tree"

    def __call__(self, args: Sequence[Any]) -> Any:
        out = self._call([args[i] for i in self._positions])  # (the generated code empties the list it gets)
        if self._shape == "one":
            return out[0]
        if self._shape == "tuple":
            return tuple(out)
        return pytree.tree_unflatten(list(out), self._spec)

    @classmethod
    def build(
        cls,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reference: Any,
        options: dict[str, Any] | None = None,
    ) -> DirectKernel | None:
        """The direct kernel of ``fn`` at these arguments, or None where it cannot serve them exactly as the graph
        that returned ``reference`` for them did (the reason logged at DEBUG)."""
        try:
            kernel, why = cls._build(fn, args, kwargs, reference, options)
        except Exception as err:  # noqa: BLE001 - any tracing or compile failure: the graph keeps serving
            kernel, why = None, f"{type(err).__name__}: {str(err).strip()[:200]}"
        if kernel is None:
            _log.debug("quark: %s keeps its aot_compile graph (%s)", getattr(fn, "__qualname__", fn), why)
        return kernel

    @classmethod
    def _build(
        cls,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reference: Any,
        options: dict[str, Any] | None,
    ) -> tuple[DirectKernel | None, str]:
        from torch._functorch.aot_autograd import aot_export_joint_simple
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        tensors = [args[i] for i in positions]
        if any(t.device.type != "cpu" for t in tensors):
            return None, "not a CPU kernel"
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None, "autograd records it"
        ref_leaves, spec = pytree.tree_flatten(reference)
        if not ref_leaves or not all(type(t) is torch.Tensor for t in ref_leaves):
            return None, "returns something other than tensors"
        if _storages(ref_leaves) & _storages(tensors):
            return None, "an output shares an input's memory"

        def flat(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(args)
            for i, t in zip(positions, ts, strict=True):
                full[i] = t
            return tuple(pytree.tree_leaves(fn(*full, **kwargs)))

        compiling = getattr(torch.compiler, "_compile_session_context", None)
        if compiling is None:
            return None, "this torch has no compile-session flag to trace the kernels' compiled form under"
        try:
            # functional, decomposed, no side effect while tracing (fake tensors); under the flag
            # torch.compiler.is_compiling() reads, so the kernels take the form they take under torch.compile (and
            # nested format kernels trace their ops instead of calling their own compiled graphs)
            with torch.no_grad(), compiling():
                gm = aot_export_joint_simple(
                    flat, tuple(tensors), trace_joint=False, decompositions=select_decomp_table()
                )
        except RuntimeError as err:
            if "input mutations" in str(err):
                return None, "writes an input in place"
            raise
        random_op = _random_op(gm)
        if random_op is not None:
            return None, f"random numbers ({random_op})"
        # inductor looks its FX-graph cache up only under a tracing context whose fake mode has a shape environment
        # (without one it bypasses the cache, and every process lowered the graph again: 1.5-4.4 s per MX kernel)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]
        with inductor_config.patch(options or {}), tracing(TracingContext(fake_mode)):
            call = compile_fx_inner(gm, fakes).current_callable
        kernel = cls(call, positions, spec)
        out = pytree.tree_leaves(kernel(args))
        if len(out) != len(ref_leaves):
            return None, f"it returns {len(out)} tensors, the graph {len(ref_leaves)}"
        bad = [i for i, (a, b) in enumerate(zip(out, ref_leaves, strict=True)) if not _same_values(a, b)]
        if bad:
            return None, f"its result differs from the graph's (outputs {bad})"
        return kernel, ""
