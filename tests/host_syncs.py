"""A probe for host syncs, and the switch that runs the CUDA paths' logic on the CPU (not collected: no ``test_``).

On CUDA, reading a tensor's value on the host (``bool(t)``, ``t.item()``, ``nonzero``, indexing with a mask) waits for
the GPU to finish all it was given. There is no GPU here, so ``HostSyncs`` records every op that would be such a read
wherever the tensor lives, and ``as_if_on_cuda`` makes the engine treat CPU tensors as it treats CUDA ones: its flags
through their memo (``FakeQuantizeBase.flag``), its late checks through a non-blocking copy and an event
(``LateFlag``), with CPU stand-ins for the pinned copy and the event that the test controls.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quark.torch.quantization import late_flag
from quark.torch.quantization.fake_quant.base import FakeQuantizeBase

#: ops whose result is a value on the host (or has a data-dependent shape): a device sync on CUDA
_READS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.repeat_interleave.Tensor",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
    "aten.equal.default",
    "aten.allclose.default",
    "aten.bincount.default",
    "aten.histc.default",
}
#: ops indexed by a tensor argument: a bool mask there makes the output's shape (or the write) data-dependent
_MASKED = {"aten.index.Tensor": 1, "aten.index_put_.default": 1, "aten.index_put.default": 1}


def _is_host_read(func: Any, args: tuple[Any, ...]) -> bool:
    name = str(func)
    if name == "aten._local_scalar_dense.default" and getattr(args[0], "_pinned_stand_in", False):
        return False  # the late check's copy in (what stands for) pinned host memory: no device to wait for
    if name in _MASKED:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[_MASKED[name]])
    if name == "aten.fake_quantize_per_channel_affine_cachemask.default":
        return not args[2].is_floating_point()  # checks its integer zero points with two .item() inside the op
    return name in _READS


class HostSyncs(TorchDispatchMode):
    """Records, while active, each op that reads a tensor on the host: (op, the innermost frame of the project).
    ``Tensor.tolist`` dispatches nothing on the CPU: it is wrapped while the probe is active."""

    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[str] = collections.Counter()

    def _record(self, what: str) -> None:
        ours = [f for f in traceback.extract_stack() if "/quark/" in f.filename or "/callbacks/" in f.filename]
        where = f"{ours[-1].filename}:{ours[-1].lineno} {ours[-1].line}" if ours else "outside the project"
        self.found[f"{what} at {where}"] += 1

    def __enter__(self) -> HostSyncs:
        tolist = self._tolist = torch.Tensor.tolist
        probe = self

        def recorded_tolist(t: torch.Tensor) -> Any:
            probe._record("Tensor.tolist")
            return tolist(t)

        torch.Tensor.tolist = recorded_tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if _is_host_read(func, args):
            self._record(str(func))
        return func(*args, **(kwargs or {}))


class StandInEvent:
    """A CUDA event's stand-in: complete once the test says so (``StandInEvent.done``, shared by all)."""

    done = True
    recorded = 0
    waited = 0

    def record(self) -> None:
        StandInEvent.recorded += 1
        self.complete = StandInEvent.done

    def query(self) -> bool:
        return self.complete or StandInEvent.done

    def synchronize(self) -> None:
        StandInEvent.waited += 1
        self.complete = True


def _stand_in_copy(flag: torch.Tensor) -> torch.Tensor:
    host = flag.detach().reshape(()).clone()
    host._pinned_stand_in = True  # type: ignore[attr-defined]
    return host


def _recorded_stand_in(device: torch.device) -> StandInEvent:
    event = StandInEvent()
    event.record()
    return event


@contextmanager
def as_if_on_cuda(monkeypatch: pytest.MonkeyPatch, events_complete: bool = True) -> Iterator[type[StandInEvent]]:
    """Run the engine's CUDA paths on CPU tensors: flags read through their memo, late checks deferred to events
    (``StandInEvent``; ``events_complete`` False: not complete until the test sets ``StandInEvent.done``)."""
    monkeypatch.setattr(FakeQuantizeBase, "_read_cpu_flags", False)
    monkeypatch.setattr(late_flag, "defers", lambda device: True)
    monkeypatch.setattr(late_flag.LateFlag, "_host_copy", staticmethod(_stand_in_copy))
    monkeypatch.setattr(late_flag.LateFlag, "_recorded_event", staticmethod(_recorded_stand_in))
    monkeypatch.setattr(StandInEvent, "done", events_complete)
    monkeypatch.setattr(StandInEvent, "recorded", 0)
    monkeypatch.setattr(StandInEvent, "waited", 0)
    yield StandInEvent
