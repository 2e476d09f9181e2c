"""Keep freed CPU memory in the process (glibc): large tensors are then reused instead of being page-faulted in anew.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and returns it to the
system on ``free``. Eager fake quantization allocates several full-size temporaries per call, so on a 4096x4096
float32 tensor each one costs ~15 ms of page faults, as much as a whole copy (measured: fp4 fake quantization
106 -> 55 ms, torch's own per-channel int8 kernel 72 -> 53 ms; README, *Performance*). ``keep_freed_memory()``
switches glibc to heap-only allocation without trimming, which is what PyTorch's tuning guides get from jemalloc or
tcmalloc via ``LD_PRELOAD``. The resident size then stays at its high-water mark: call it in training and benchmark
processes, not in a library import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["keep_freed_memory", "release_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied = False


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap (no per-tensor ``mmap``) and never trim it. Returns whether it applies
    (glibc on Linux; elsewhere the system allocator is left as it is). Idempotent."""
    global _applied
    if _applied:
        return True
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


def release_freed_memory() -> bool:
    """Give the memory glibc holds freed back to the system now (``malloc_trim(0)``: free pages anywhere in the heap,
    not only at its top), so that a long run whose working set moves (one decoder layer after another) does not keep
    each step's freed temporaries resident. Returns whether it applies (glibc on Linux)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True
