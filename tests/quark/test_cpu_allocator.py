"""keep_freed_memory: after it, a 64 MiB tensor comes from the heap, not from a fresh mmap (glibc's own accounting,
mallinfo2). Run in a child process: the setting is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quark.torch.cpu_allocator import _glibc

pytestmark = pytest.mark.integration  # a child process

CHILD = r"""
import ctypes, torch
from quark.torch.cpu_allocator import _glibc, keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = _glibc()
libc.mallinfo2.restype = MallInfo2

def grown_mmapped(numel):
    before = libc.mallinfo2().hblkhd
    t = torch.empty(numel)
    grown = libc.mallinfo2().hblkhd - before
    del t
    return grown

numel = (64 << 20) // 4
default = grown_mmapped(numel)
applied = keep_freed_memory()
kept = grown_mmapped(numel)
print(default, applied, kept, keep_freed_memory())
"""


@pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_tensors_stop_being_mmapped_after_keep_freed_memory() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout.split()
    default, applied, kept, again = int(out[0]), out[1], int(out[2]), out[3]
    assert default >= 64 << 20  # glibc's default: a fresh mapping per large tensor
    assert applied == "True" and again == "True"  # idempotent
    assert kept == 0  # now from the heap
