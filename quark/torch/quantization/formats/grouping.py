"""Shape plumbing shared by every format: blocks along an axis (padded when ragged), 2-D tiles of a matrix (per_block),
channel broadcasting, rounding."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from quark.torch.compat import dynamo_recompile_limit, make_fx_tracing
from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.formats import kernel_cache
from quark.torch.quantization.formats.kernel_cache import KernelCache
from quark.torch.quantization.formats.kernel_store import store_root

F_ = TypeVar("F_", bound=Callable[..., Any])

_log = logging.getLogger(__name__)


def _compile_from_env() -> bool | None:
    """``QUARK_COMPILE``: unset or ``auto`` -> None (compile where it pays, fall back when it fails), ``1`` -> True
    (always compile, raise on failure), ``0`` -> False (eager)."""
    value = os.environ.get("QUARK_COMPILE", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"QUARK_COMPILE={value!r}: allowed values are auto (default), 1 (always compile) and 0 (eager)")


class Backend:
    """How the elementwise format kernels run, process-wide (like ``torch.backends`` flags).

    ``compile``: None (the default, "auto"): the kernels run eagerly until the run has shown it quantizes more than a
    short demo does: once ``warmup_numel`` elements have gone through kernel calls on tensors of at least ``min_numel``
    elements, each kernel is ``torch.compile``d on its next such call, which fuses its chain of elementwise passes into
    one loop (bit-identical results; cached on disk by inductor across processes; the first compile of a process is
    logged once). A compile costs 1 to 8 s on 2 CPU cores with an empty cache, 0.3 s from torch's disk cache, and saves
    0.4 to 5 ns per element (``bench/compile_thresholds.py``): a run that quantizes a few million elements
    (``python train.py``'s PTQ: 3.9 million) is faster eager. Past the warm-up a run compiles only where that pays:
    where its front end told its length, while ``payback_numel`` elements are still to come; where it did not, once it
    has counted ``payback_numel`` (``compile_warm``). A run that reaches only ``stored_payback_numel`` instead loads the
    kernels an earlier run stored and compiles none (``loading``). Smaller tensors always run eagerly: there a
    compiled call's fixed cost (guards) outweighs the fusion. If compiling fails (no C++ compiler, an unsupported
    platform) a warning says why and every kernel runs eagerly from then on. True: always compile, from the first
    call, and raise on failure. False: always eager. Set with ``set_compile`` or the environment variable
    ``QUARK_COMPILE`` (auto, 1, 0).
    """

    compile: bool | None = _compile_from_env()
    #: in auto mode, smaller tensors run eagerly: there a compiled call's fixed cost outweighs the fusion (through the
    #: kernel cache, about 15 us on 2 idle cores; int8 forward + backward at 32768 elements: 35 against 51 us eager,
    #: at 16384 elements even)
    min_numel: int = 1 << 15
    #: in auto mode, the elements of kernel calls on tensors of at least ``min_numel`` that run eagerly before the
    #: kernels compile (counted per decision, ``compiled_kernels_active``); 0 compiles on the first such call. 2^24:
    #: 4x what ``python train.py`` (PTQ of the digits CNN) counts; a QAT step of an MLP of width 1024 counts 4 million
    warmup_numel: int = 1 << 24
    #: elements counted toward ``warmup_numel`` so far in this process
    seen_numel: int = 0
    #: whether auto mode's warm-up has ended in this process (``compile_warm``): the kernels compile from then on, to
    #: its end, whatever a later run tells
    warm: bool = False
    #: whether auto mode runs the compiled kernels an earlier run stored, compiling nothing (``compile_warm``: a run
    #: long enough to pay a load back, not a compile); latched like ``warm``, and like it counting nothing (every
    #: kernel it runs is stored: there is nothing a longer run would compile). The first call of a kernel nothing
    #: stored serves ends it (``unstored``)
    loading: bool = False
    #: whether a kernel nothing stored serves was called while ``loading``: the process then runs the eager paths
    #: again, counting, until it reaches the payback (the compiled paths' kernels run eagerly are slower: int8 1.16x)
    unstored: bool = False
    #: why auto mode gave up compiling (None while it has not)
    failure: str | None = None
    #: whether this process has logged its first compile (once, whichever kernel it is)
    compile_logged: bool = False
    #: in auto mode, a run whose front end says how long it is (``plan_step_end``) ends its warm-up only with at least
    #: this many elements still to count, and one that says nothing once it has counted this many. Whole QAT fits of an
    #: MLP (``bench/compile_payback.py``, 2 cores) paid a compile back only after thousands of steps: it cost 20-40 s
    #: with empty caches (4-20 s loading from them then, 2-3 s since the seventeenth round), and saved 2.8 ms of a
    #: 12.7 ms int8 step at width 1024 (6.6 million elements counted a step). int8 broke even at about 2^34 elements
    #: with the kernels cached and 2^36-2^37 with empty caches, at widths 1024 and 4096; a run at 2^36 takes at most
    #: about 1.3x the better choice, cold or warm (docs/performance.md, sixteenth round)
    payback_numel: int = 1 << 36
    #: as ``payback_numel``, for loading the kernels stored by an earlier run (``loading``): 1.7-2.6 s a process, which
    #: whole fits at width 1024 paid back from about 1,000-1,200 int8 steps and 600 MX steps, about 2^33 counted
    #: elements (docs/performance.md, seventeenth round)
    stored_payback_numel: int = 1 << 33
    #: the elements the front end's current run still expects to count (``plan_step_end``); None: no length told (a
    #: training loop of the user's own, a fit of unknown length)
    remaining_numel: int | None = None
    #: ``seen_numel`` at the start of the told run's current step (``plan_step_start``)
    step_mark: int | None = None
    #: ``seen_numel`` before the told run's first step: what a run that ends too short to compile gives back
    run_mark: int | None = None


def set_compile(enabled: bool | None) -> None:
    """Run the format kernels through ``torch.compile`` (True), eagerly (False) or where it pays (None, the default);
    resets a previous auto-mode failure, so None tries compiling again (the warm-up count is kept)."""
    Backend.compile = None if enabled is None else bool(enabled)
    Backend.failure = None


def compile_warm() -> bool:
    """Whether auto mode runs the compiled kernels: its warm-up is over (``Backend.warmup_numel`` elements counted),
    and a run that told its length still has at least ``Backend.payback_numel`` elements to go, or one that did not
    has counted that many (``Backend.warm``: compile what is not stored); or the same holds for
    ``Backend.stored_payback_numel`` (``Backend.loading``: the kernels stored by an earlier run, no compile).

    The rule for a run of unknown length is rent or buy: eager until what it would have saved by compiling is what a
    compile costs (the payback), then compile. Such a run then takes at most about twice the better choice, whatever
    its length; compiling after the warm-up alone made a short loop wait up to 9x its eager time
    (docs/performance.md, seventeenth round)."""
    if Backend.warm or Backend.loading:
        return True
    if Backend.seen_numel < Backend.warmup_numel:
        return False
    told = Backend.remaining_numel is not None
    to_go = Backend.remaining_numel if told else Backend.seen_numel
    if to_go >= Backend.payback_numel:
        Backend.warm = True
    elif to_go >= Backend.stored_payback_numel and not Backend.unstored:
        if not _store_holds_kernels():  # nothing to load on this machine (checked once: not on every call)
            Backend.unstored = True
            return False
        Backend.loading = True
        _log.info(
            "quark: running the format kernels an earlier run compiled and stored (%s), compiling none: %s, enough "
            "for loading them to pay back, not for a compile; a kernel not stored sends the run back to the eager "
            "kernels. QUARK_COMPILE=0 runs every kernel eagerly (same results).",
            _store_folder(),
            f"about {to_go:,} elements still to quantize in this run" if told else f"{to_go:,} elements quantized",
        )
    return Backend.warm or Backend.loading


def _store_holds_kernels() -> bool:
    """Whether the kernel store is on and holds anything at all (a fresh machine's does not: no run tries loading)."""
    root = store_root()
    try:
        return root is not None and root.is_dir() and next(root.iterdir(), None) is not None
    except OSError:
        return False


def may_compile() -> bool:
    """Whether a kernel that no stored graph serves may be compiled now (not while only ``Backend.loading``)."""
    return Backend.compile is True or Backend.warm


def stop_loading() -> None:
    """A kernel nothing stored serves was called while ``Backend.loading``: back to the eager paths for good (until
    the payback), since the compiled paths' kernels run eagerly take longer than the eager paths (int8 QAT steps of a
    1024-wide MLP: 1.16x; docs/performance.md, eighteenth round). That call itself runs eagerly."""
    if Backend.loading:
        Backend.loading, Backend.unstored = False, True
        _log.info(
            "quark: a format kernel this run calls is not among the stored ones: running the kernels eagerly from "
            "here (same results). A short fit of the same model and formats under QUARK_COMPILE=1 "
            "QUARK_DIRECT_KERNELS=2 stores them all for the next run."
        )


def plan_step_start() -> None:
    """A front end that knows its run's length (``QuantCallback`` in QAT), at the start of each training step: mark
    the count, so that ``plan_step_end`` measures what one step counts. Until the first step is measured the run
    counts as too short to compile in."""
    if compile_warm():  # compiling, or running the stored kernels (counting stopped): nothing to measure
        Backend.remaining_numel = Backend.step_mark = None
        if Backend.warm:
            Backend.run_mark = None
        return
    Backend.step_mark = Backend.seen_numel
    if Backend.run_mark is None:
        Backend.run_mark = Backend.seen_numel
    if Backend.remaining_numel is None:
        Backend.remaining_numel = 0


def plan_step_end(steps_left: int | None) -> None:
    """At the end of a training step: ``steps_left`` more steps like it follow (None: the run's length is not
    known). The run's remaining elements are the step's count times that; once the warm-up ends with enough of them
    to pay a compile back (``compile_warm``), the plan is dropped and the kernels stay compiled to the end."""
    if Backend.step_mark is None:
        return
    if steps_left is None or compile_warm():
        # unknown length; or the warm-up ended inside this step, whose count then stopped short: not a measurement
        Backend.remaining_numel = Backend.step_mark = None
        return
    Backend.remaining_numel = (Backend.seen_numel - Backend.step_mark) * max(int(steps_left), 0)
    if compile_warm():
        Backend.remaining_numel = Backend.step_mark = None


def plan_run_end() -> None:
    """The told run is over. If its warm-up did not end (too short for a compile to pay back), its own count is
    dropped: what follows (a test pass, another short fit) counts on from what was counted before the run (nothing, as
    in a new process, unless a loop that told nothing counted first: its count toward the payback is kept)."""
    if Backend.remaining_numel is not None and not compile_warm():
        Backend.seen_numel = Backend.run_mark or 0
    Backend.remaining_numel = Backend.step_mark = Backend.run_mark = None


def compiled_kernels_active(x: torch.Tensor, min_numel: int | None = None, count: bool = True, gain: int = 1) -> bool:
    """Whether a ``compilable`` kernel called on ``x`` now would run compiled (``min_numel``: auto mode's threshold
    for this kernel, by default ``Backend.min_numel``). In auto mode, a call on a tensor at or above the threshold
    made before the warm-up is over counts its elements toward ``Backend.warmup_numel`` and the run plan, times
    ``gain`` (the block formats': ``BLOCK_GAIN``, for what compiling saves on them), and answers False (``count``: a
    question about a call already made counts nothing)."""
    if Backend.compile is False or torch.compiler.is_compiling():
        return False  # inside a caller's torch.compile the eager body is traced into the caller's graph
    if torch.jit.is_tracing():
        return False  # a TorchScript trace (ONNX export) records the eager ops; its sizes are traced values
    if make_fx_tracing():
        return False  # make_fx records the eager ops (FX cannot trace a compiled function)
    if Backend.compile is True:
        return True
    threshold = Backend.min_numel if min_numel is None else min_numel
    if Backend.failure is not None or x.numel() < threshold:
        return False
    if compile_warm():
        return True
    if count:
        Backend.seen_numel += x.numel() * gain
    return False


def steady_key(x: torch.Tensor) -> tuple[Any, ...] | None:
    """The part of a kernel call's signature a steady path (a caller that keeps the direct kernels of its calls and
    calls them itself: ``PreparedInt``, the quantizers' fused observe pass) checks per call: ``x``'s layout and flags
    and the global state the kernels were built under (``kernel_cache.call_signature`` has the rest, fixed for such a
    caller). None where no steady path may run: traced (``torch.compile``, TorchScript, ``make_fx``), the compiled
    kernels switched off or failed, auto mode running eagerly (a run back from loading stored kernels), or direct
    kernels off."""
    if (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or make_fx_tracing()
        or Backend.compile is False
        or Backend.failure
        or kernel_cache.DIRECT_AFTER_CALLS is None
        or (Backend.compile is None and not (Backend.warm or Backend.loading))
    ):
        return None
    return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.is_inference(), kernel_cache.global_state())


#: compiled calls of one signature in which a steady path looks for its direct kernel (built after
#: ``kernel_cache.DIRECT_AFTER_CALLS`` of them; a refused one never comes), and the signatures one caller counts
STEADY_LOOKUPS = 2 * (kernel_cache.DIRECT_AFTER_CALLS or 0) + 16
MAX_STEADY_SIGNATURES = 256


def steady_lookup_due(calls: dict[tuple[Any, ...], Any], key: tuple[Any, ...]) -> bool:
    """Count a compiled call of signature ``key`` in a steady path's ``calls`` and say whether to look for its direct
    kernel now: in its first ``STEADY_LOOKUPS`` calls (a lookup computes the full signature), for at most
    ``MAX_STEADY_SIGNATURES`` signatures per caller (inputs of ever new shapes, e.g. every sequence length, stop
    being counted)."""
    seen = calls.get(key)
    if seen is None and len(calls) >= MAX_STEADY_SIGNATURES:
        return False
    seen = (seen or 0) + 1
    calls[key] = seen
    return seen <= STEADY_LOOKUPS


def look_for_steady(
    steady: dict[tuple[Any, ...], SteadyKernels],
    calls: dict[tuple[Any, ...], int],
    key: tuple[Any, ...],
    kernel: Any,
    args: tuple[Any, ...],
) -> None:
    """After a call of ``kernel`` (a ``compilable`` kernel) on ``args`` whose steady signature is ``key``: keep its
    direct kernel in ``steady`` once the kernel cache serves the signature directly, looking as ``steady_lookup_due``
    says (counting in ``calls``). The lookup runs without grad, as inside the autograd Function's forward where the
    kernel cache saw the call."""
    if not steady_lookup_due(calls, key):
        return
    with torch.no_grad():
        found = kernel.kernel_cache.direct_for(args)
    if found is not None:
        steady[key] = SteadyKernels(found)


class SteadyKernels:
    """The direct kernels a steady path serves one input signature with: the forward's, and the backward's per
    gradient layout and global state (``backward_key``; filled by the first backward of each)."""

    __slots__ = ("forward", "backward")

    def __init__(self, forward: Any) -> None:
        self.forward = forward
        self.backward: dict[tuple[Any, ...], Any] = {}

    @staticmethod
    def backward_key(grad: torch.Tensor) -> tuple[Any, ...]:
        return (grad.shape, grad.stride(), grad.dtype, kernel_cache.global_state())

    def backward_call(self, kernel: Any, args: tuple[Any, ...]) -> torch.Tensor:
        """``kernel(*args)`` for a backward (a ``compilable`` kernel), through its direct kernel once that is served
        and kept here, through ``kernel`` until then."""
        key = self.backward_key(args[0])
        direct = self.backward.get(key)
        if direct is not None:
            return direct(args)
        out = kernel(*args)
        found = kernel.kernel_cache.direct_for(args)
        if found is not None:
            self.backward[key] = found
        return out


#: variants one kernel may be compiled for (each format, qscheme layout and round mode is one): dynamo's default of
#: 8 is reached by a model mixing a few formats, after which it would silently run the kernel eagerly
RECOMPILE_LIMIT = 64


#: the largest int ``static_int`` pins (block and group sizes, mantissa widths); larger ones stay symbolic
STATIC_INT_MAX = 4096


def static_int(n: int) -> int:
    """``n`` as a constant of the graph ``torch.compile`` traces (eagerly: ``n``). With ``dynamic=True`` an int argument
    is symbolic, and an index built from a symbolic block size (a pair's partner) costs an integer division per element;
    a bisection of comparisons with constants guards on its value instead (12 guards), so each value gets its own
    kernel, built once. Values outside [0, ``STATIC_INT_MAX``] are returned as they are (correct, slower)."""
    if not torch.compiler.is_compiling() or not 0 <= n <= STATIC_INT_MAX:
        return n
    low, high = 0, STATIC_INT_MAX
    while low < high:
        mid = (low + high) // 2
        if n <= mid:
            high = mid
        else:
            low = mid + 1
    return low


def _call_compiled(compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a compiled kernel with dynamo's recompile limit raised to ``RECOMPILE_LIMIT`` for this call only."""
    before = dynamo_recompile_limit(max(RECOMPILE_LIMIT, dynamo_recompile_limit()))
    try:
        return compiled(*args, **kwargs)
    finally:
        dynamo_recompile_limit(before)


def _store_folder() -> str:
    """Where the compiled kernels are kept, for the log lines."""
    root = store_root()
    return str(root.parent) if root is not None else "not kept: QUARK_KERNEL_CACHE=0"


def _log_first_compile(name: str) -> None:
    """Say once per process that a kernel compiles, why, where torch keeps it and how to turn it off."""
    if Backend.compile_logged:
        return
    Backend.compile_logged = True
    cache = _store_folder()
    why = (
        "QUARK_COMPILE=1"
        if Backend.compile is True
        else f"auto mode: {Backend.seen_numel:,} elements quantized in tensors of >= {Backend.min_numel:,}"
        + ("" if Backend.remaining_numel is None else f" and about {Backend.remaining_numel:,} more to go in this run")
        + ", enough for the compile to pay back"
    )
    _log.info(
        "quark: compiling the format kernel %s with torch.compile (%s); this takes seconds once per kernel variant, "
        "and the compiled kernels are kept on disk (%s), so later runs load them in a fraction of that. "
        "QUARK_COMPILE=0 runs every kernel eagerly (same results).",
        name,
        why,
        cache,
    )


def compilable(
    fn: F_ | None = None, *, min_numel: int | None = None, options: dict[str, Any] | None = None, gain: int = 1
) -> Any:
    """Run ``fn`` compiled (``torch.compile(dynamic=True)``, built once) or eagerly, as ``Backend`` says for its
    first argument (``min_numel``: this kernel's own auto-mode threshold; ``options``: inductor's, for this kernel;
    ``gain``: how much its elements count toward the warm-up, ``compiled_kernels_active``).
    In auto mode a compile failure falls back to eager with a warning that names the reason; an error the eager
    kernel raises as well (bad input) is raised as is. Use as ``@compilable`` or ``@compilable(min_numel=...)``."""
    if fn is None:
        return functools.partial(compilable, min_numel=min_numel, options=options, gain=gain)
    compiled: list[Callable[..., Any]] = []
    cache = KernelCache(
        fn,
        options,
        on_compile=lambda: _log_first_compile(fn.__qualname__),
        may_compile=may_compile,
        on_unstored=stop_loading,
    )

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not compiled_kernels_active(x, min_numel, gain=gain):
            return fn(x, *args, **kwargs)
        try:
            return cache(x, *args, **kwargs)  # compiled (or loaded from disk) before: no guard evaluation
        except LookupError:
            pass  # not keyable, or aot_compile refused it: torch.compile with its guards
        if not may_compile():  # loading stored kernels only: this one is not among them
            stop_loading()
            return fn(x, *args, **kwargs)
        if not compiled:
            _log_first_compile(fn.__qualname__)
            compiled.append(torch.compile(fn, dynamic=True, options=options))
        if Backend.compile is True:
            return _call_compiled(compiled[0], x, *args, **kwargs)
        try:
            return _call_compiled(compiled[0], x, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - any compiler failure: fall back below
            out = fn(x, *args, **kwargs)  # raises for bad input, as eager mode would
            reason = (str(err).strip().splitlines() or [""])[0][:300]
            Backend.failure = f"{type(err).__name__}: {reason}"
            warnings.warn(
                f"quark: torch.compile of the format kernel {fn.__qualname__} failed ({Backend.failure}); every "
                "format kernel runs eagerly from now on (same results, slower). QUARK_COMPILE=0 skips the attempt, "
                "QUARK_COMPILE=1 raises instead.",
                RuntimeWarning,
                stacklevel=2,
            )
            return out

    run.kernel_cache = cache  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


#: ``aminmax_along``'s auto-mode threshold: torch's own ``amin`` / ``amax`` along a dim beat the compiled pass below it
#: (torch 2.13, 2 cores: [4096, 1024] along rows 0.22 against 0.34 ms; [4096, 32, 32] along -1 0.67 against 0.52 ms)
AMINMAX_MIN_NUMEL = 1 << 22


@compilable(min_numel=AMINMAX_MIN_NUMEL)
def aminmax_along(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.aminmax(x, dim=dim)`` as (min, max): observers' per-channel / per-group statistics. Compiled it is
    one vectorized pass; it pays only for large tensors of short groups (``AMINMAX_MIN_NUMEL``)."""
    return x.amin(dim=dim), x.amax(dim=dim)


@dataclass(frozen=True)
class BlockLayout:
    """How ``to_blocks`` reshaped a tensor, so ``from_blocks`` can undo it."""

    axis: int  # non-negative axis the blocks run along
    length: int  # size of that axis before padding
    block: int

    @property
    def n_blocks(self) -> int:
        return -(-self.length // self.block)

    @property
    def pad(self) -> int:
        return self.n_blocks * self.block - self.length


def normalize_axis(axis: int, ndim: int) -> int:
    """``axis`` as a non-negative index into ``ndim`` dimensions, with a clear error when out of range."""
    if not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"ch_axis={axis} is out of range for a tensor of {ndim} dimensions")
    return axis % max(ndim, 1)


def to_blocks(x: torch.Tensor, axis: int, block: int, whole_axis: bool = False) -> tuple[torch.Tensor, BlockLayout]:
    """Split ``axis`` into blocks of ``block``: x [..., C (at axis), ...] -> [..., n_blocks, block] (axis moved last).

    A ragged last block is zero-padded; zeros never raise a block's maximum, so padding changes no scale. With
    ``whole_axis`` (integer per-group qparams), a block at least as long as the axis is the whole axis, unpadded: one
    group per slice, e.g. per token for activations with ``ch_axis=-1`` and a ``group_size`` at least the widest input
    (``quant/spec/int4_per_token_dynamic.yaml``; padding there would cost memory and move an asymmetric group's
    minimum or maximum to 0). MX blocks keep their size (their element count is the format's).
    """
    if x.ndim == 0:
        x = x.reshape(1)
    block = min(block, x.shape[axis]) if whole_axis else block
    layout = BlockLayout(normalize_axis(axis, x.ndim), x.shape[axis], block)
    moved = x.movedim(layout.axis, -1)  # [..., C]
    if layout.pad:
        moved = F.pad(moved, (0, layout.pad))
    return moved.reshape(*moved.shape[:-1], layout.n_blocks, block), layout


def from_blocks(xb: torch.Tensor, layout: BlockLayout, shape: torch.Size) -> torch.Tensor:
    """Undo ``to_blocks``: [..., n_blocks, block] -> the original ``shape``."""
    moved = xb.reshape(*xb.shape[:-2], layout.n_blocks * layout.block)
    if layout.pad:
        moved = moved[..., : layout.length]
    return moved.movedim(-1, layout.axis).reshape(shape)


@dataclass(frozen=True)
class TileLayout:
    """How ``to_tiles`` cut a 2-D tensor [R, C] into tiles of ``block`` = (rows, cols), so ``from_tiles`` can undo it."""

    shape: tuple[int, int]
    block: tuple[int, int]

    @property
    def n_tiles(self) -> tuple[int, int]:
        """The tile grid, ``[ceil(R / rows), ceil(C / cols)]``: the shape of per-block qparams."""
        return (-(-self.shape[0] // self.block[0]), -(-self.shape[1] // self.block[1]))

    @property
    def pad(self) -> tuple[int, int]:
        return (self.n_tiles[0] * self.block[0] - self.shape[0], self.n_tiles[1] * self.block[1] - self.shape[1])


def tile_layout(shape: Sequence[int], block_size: Sequence[int] | None) -> TileLayout:
    """The tiling of a 2-D ``shape`` by ``block_size`` = [rows, cols], with a clear error for anything else."""
    if (
        block_size is None
        or len(block_size) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block_size)
    ):
        raise ValueError(f"qscheme=per_block needs block_size=[rows, cols] of two positive ints, got {block_size!r}")
    if len(shape) != 2:
        raise ValueError(f"qscheme=per_block quantizes 2-D tensors [rows, cols] only, got one of shape {tuple(shape)}")
    return TileLayout((int(shape[0]), int(shape[1])), (int(block_size[0]), int(block_size[1])))


def to_tiles(x: torch.Tensor, block_size: Sequence[int] | None) -> tuple[torch.Tensor, TileLayout]:
    """Cut a 2-D ``x`` [R, C] into tiles: -> [n_rows, rows, n_cols, cols], so that per-tile qparams of shape
    [n_rows, n_cols] broadcast over it as ``tile_view(param)``. Ragged edge tiles are zero-padded (zeros never raise
    a tile's maximum); ``from_tiles`` cuts the padding off again."""
    layout = tile_layout(x.shape, block_size)
    (pr, pc), (br, bc), (nr, nc) = layout.pad, layout.block, layout.n_tiles
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.reshape(nr, br, nc, bc), layout


def from_tiles(xt: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Undo ``to_tiles``: [n_rows, rows, n_cols, cols] -> [R, C]."""
    (nr, nc), (br, bc) = layout.n_tiles, layout.block
    out = xt.reshape(nr * br, nc * bc)
    if any(layout.pad):
        out = out[: layout.shape[0], : layout.shape[1]]
    return out


def tile_view(param: torch.Tensor, layout: TileLayout) -> torch.Tensor:
    """Per-tile qparams [n_rows, n_cols] shaped [n_rows, 1, n_cols, 1], to broadcast over ``to_tiles``' output."""
    nr, nc = layout.n_tiles
    if param.numel() != nr * nc:
        raise ValueError(
            f"per_block qparams of shape {tuple(param.shape)} do not fit a tensor of shape {layout.shape} in tiles of "
            f"{list(layout.block)}: expected {nr * nc} values ([{nr}, {nc}])"
        )
    return param.reshape(nr, 1, nc, 1)


def channel_view(param: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    """Reshape a per-channel parameter [C] so it broadcasts along ``axis`` of an ``ndim`` tensor."""
    shape = [1] * ndim
    shape[normalize_axis(axis, ndim)] = -1
    return param.reshape(shape)


def round_to_int(v: torch.Tensor, method: RoundType) -> torch.Tensor:
    """Round to integers: half_even (as torch.round / nearbyint), round (half away from zero) or floor."""
    if method == RoundType.half_even:
        return torch.round(v)
    if method == RoundType.floor:
        return torch.floor(v)
    if method == RoundType.round:
        # Half away from zero without the floor(|v| + 0.5) trap (0.49999997 + 0.5 rounds up to 1.0 in float32):
        # take half-even, then move exact ties whose even neighbour is toward zero.
        r = torch.round(v)
        trunc = torch.trunc(v)
        tie = (v - trunc).abs() == 0.5
        return torch.where(tie, trunc + torch.sign(v), r)
    raise ValueError(f"round_method={method!r} is not one of {RoundType.choices()}")


def fast_apply(fn: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``fn.apply`` without ``autograd.Function.apply``'s Python layer where that layer does nothing for ``fn``.

    For a Function without ``setup_context`` (nothing to bind), outside functorch transforms and tracing, the layer
    only unwraps tensors left over from finished functorch transforms, which no quantizer is given; it costs a dozen
    Python calls per quantizer call (int8 QAT of the width-512 MLP: 1.38 -> 1.34x FP32 without it, same process).
    Under a transform or a trace, or where this torch lacks the C entry point, ``fn.apply`` itself runs.
    """
    base = getattr(torch._C, "_FunctionBase", None)
    raw = vars(base).get("apply") if base is not None else None
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if raw is None or transforms_active is None or "setup_context" in vars(fn):
        return fn.apply
    bound = raw.__get__(None, fn)

    def apply(*args: Any) -> Any:
        if torch.compiler.is_compiling() or transforms_active():  # (a trace sees the first: the rest is not traced)
            return fn.apply(*args)
        return bound(*args)

    return apply


class _SaturateSTE(torch.autograd.Function):
    """``clamp(x, -limit, limit)`` with the identity as gradient (the clamp only trims the overshoot of a rounding).
    Out of place: the Function that produced ``x`` may have saved it for its backward (LSQ does)."""

    @staticmethod
    def forward(ctx, x, limit):  # type: ignore[override]
        return x.clamp(-limit, limit)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def saturate_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``x`` in ``dtype``, past that dtype's largest finite value saturated to it (``cast_saturating``'s rule)
    without autograd: for use inside the kernels, whose own backward is straight-through, so a bfloat16 or float16
    input is read and written in its dtype within one compiled pass instead of two extra casts around it."""
    if x.dtype == dtype:
        return x
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


def cast_saturating(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (a float32 result the caller owns) in the caller's ``dtype``, where that dtype's range is narrower:
    magnitudes past its largest finite value become that value instead of inf (fp16 data at 65504 rounded onto a grid
    whose nearest point is 65520 or more would otherwise come back as inf). NaN stays NaN; the gradient is
    straight-through. Without autograd ``x`` is clamped in place, a fraction of the cost of the cast that follows."""
    if x.dtype == dtype:
        return x
    if dtype.is_floating_point and x.is_floating_point() and torch.finfo(dtype).max < torch.finfo(x.dtype).max:
        limit = torch.finfo(dtype).max
        x = _SaturateSTE.apply(x, limit) if x.requires_grad and torch.is_grad_enabled() else x.clamp_(-limit, limit)
    return x.to(dtype)
