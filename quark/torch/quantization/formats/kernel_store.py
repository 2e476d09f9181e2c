"""On-disk store of the format kernels ``KernelCache`` compiles, so a later run loads them instead of compiling.

A graph from ``aot_compile`` does not land in torch's own AOTAutograd disk cache, so without this every new process
would compile each kernel variant again (about 1 s each on 2 CPU cores, with inductor's code cache warm); loading a
stored graph takes about 30 ms. Graphs live under ``<torch's inductor cache dir>/quark_kernels/<fingerprint>/``
(``TORCHINDUCTOR_CACHE_DIR`` moves it with torch's caches; ``QUARK_KERNEL_CACHE`` names another folder, or ``0``
turns the store off). The fingerprint covers torch's and Python's versions, the CPU capability inductor generates
code for, and the source of the quantization package, so a change to any kernel's code starts a fresh folder.

A direct kernel (``direct_kernel``: a graph compiled again at its exact shapes, kept in torch's FX-graph cache) leaves
an empty marker file named by its signature and torch's cache folder, so that a run that may only load knows which
ones it can build from that cache rather than by lowering them again.

Each graph is one file, written under a new unique name (a temporary file renamed into place: nothing existing is
overwritten or removed, and two processes storing at once both keep theirs). A file that cannot be read back (another
torch, a truncated write) is skipped and the kernel compiles as if it were not there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import uuid
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

__all__ = ["KernelStore", "store_root"]

_PACKAGE = Path(__file__).resolve().parents[1]  # quark/torch/quantization: what the kernels trace


@functools.cache
def _fingerprint() -> str:
    """What a stored graph is valid for: torch, Python, the CPU capability and the quantization package's source."""
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability()):
        digest.update(part.encode() + b"\0")
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:20]


def store_root() -> Path | None:
    """The folder graphs are stored in for this fingerprint, or None when ``QUARK_KERNEL_CACHE=0`` turns it off."""
    setting = os.environ.get("QUARK_KERNEL_CACHE", "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if setting:
        base = Path(setting)
    else:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        base = Path(cache_dir()) / "quark_kernels"
    return base / _fingerprint()


class KernelStore:
    """The stored graphs of one kernel, by family (its signature without shapes, ``kernel_cache.call_signature``)."""

    def __init__(self, kernel_name: str) -> None:
        self.kernel_name = kernel_name
        #: graphs loaded from disk and stored there by this process, for tests and logs
        self.loaded = 0
        self.stored = 0

    def _folder(self, family: tuple[Hashable, ...]) -> Path | None:
        root = store_root()
        if root is None:
            return None
        key = hashlib.sha256(repr(family).encode()).hexdigest()[:24]
        return root / f"{self.kernel_name.replace('<', '').replace('>', '')}-{key}"

    def load(self, family: tuple[Hashable, ...]) -> list[Any]:
        """The graphs stored for ``family`` that load in this process (guard checks off, as compiled ones)."""
        folder = self._folder(family)
        if folder is None or not folder.is_dir():
            return []
        from torch._dynamo.aot_compile import AOTCompiledFunction

        graphs = []
        for path in sorted(folder.glob("*.graph")):
            try:
                graph = AOTCompiledFunction.deserialize(path.read_bytes())
            except Exception:  # noqa: BLE001 - another torch, a partial file: compile instead
                continue
            graph.disable_guard_check()
            graphs.append(graph)
            self.loaded += 1
        return graphs

    def save(self, family: tuple[Hashable, ...], graph: Any) -> None:
        """Store ``graph`` for ``family`` under a new unique name (no error reaches the caller: a store that cannot be
        written only means the next run compiles again)."""
        folder = self._folder(family)
        if folder is None:
            return
        from torch._dynamo.aot_compile import AOTCompiledFunction

        try:
            data = AOTCompiledFunction.serialize(graph).serialized_data
            folder.mkdir(parents=True, exist_ok=True)
            name = uuid.uuid4().hex
            tmp = folder / f".{name}.tmp"
            with open(tmp, "xb") as f:  # "x": a fresh file, never one that exists (or a link planted there)
                f.write(data)
            try:
                os.replace(tmp, folder / f"{name}.graph")
            except OSError:
                tmp.unlink(missing_ok=True)  # our own temporary file, just written
                raise
            self.stored += 1
        except Exception:  # noqa: BLE001 - a read-only disk, a graph that does not serialize: compile next time
            return

    def _direct_marker(self, family: tuple[Hashable, ...], key: tuple[Hashable, ...]) -> Path | None:
        folder = self._folder(family)
        if folder is None:
            return None
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        tag = hashlib.sha256(f"{key!r}\0{cache_dir()}".encode()).hexdigest()[:24]
        return folder / f"{tag}.direct"

    def mark_direct(self, family: tuple[Hashable, ...], key: tuple[Hashable, ...]) -> None:
        """Record that the direct kernel of signature ``key`` was built (so torch's FX-graph cache holds it)."""
        marker = self._direct_marker(family, key)
        if marker is None:
            return
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            with open(marker, "x"):  # a fresh empty file; one that exists (or a link planted there) is left as it is
                pass
        except OSError:
            return

    def has_direct(self, family: tuple[Hashable, ...], key: tuple[Hashable, ...]) -> bool:
        """Whether the direct kernel of signature ``key`` was built before with this torch cache folder."""
        marker = self._direct_marker(family, key)
        return marker is not None and marker.is_file()
