"""Error conditions computed on the device, read on the host without waiting for the device.

A check such as "the learned scale is finite and positive" runs on every training forward. Reading its result with
``bool(t)`` is a host sync on CUDA: the host waits until the GPU has run everything queued before it, and the GPU then
idles until the host queues more. ``LateFlag`` reads such a result late instead: on CUDA it copies the flag into pinned
host memory without blocking, records an event, and reads it on a later call, once the event has completed. The
check is almost always False; when it is True the error comes one or a few steps after the step that caused it, not
silently never. On the CPU there is no queue to wait for, so the flag is read at once.

Inside a ``torch.compile``d forward a read would be a graph break (the model split at every quantizer): there the
flags are folded into one tensor in the graph and read at the next eager call or ``wait``.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["LateFlag", "defers"]

#: how many flags may wait for the device at once; past this, ``LateFlag.raised`` waits for the oldest (the host has
#: run far ahead of the device: a bound on the memory the pending copies hold and on how late an error comes)
MAX_PENDING = 8


def defers(device: torch.device) -> bool:
    """Whether flags on ``device`` are read late (CUDA: a read would be a host sync; inside ``torch.compile``: a graph
    break), or at once (the CPU, eagerly)."""
    return device.type == "cuda" or torch.compiler.is_compiling()


class LateFlag:
    """A stream of device-side booleans (one per call of ``raised``), read on the host without a device sync where
    ``defers`` says the device has a queue. Not saved with the module: pending copies belong to this process."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Any]] = deque()
        #: the flags of compiled forwards, or-ed in their graphs (None: none since the last read)
        self._traced: torch.Tensor | None = None

    def raised(self, flag: torch.Tensor) -> bool:
        """Queue ``flag`` (a tensor holding one bool) and say whether any flag read so far was True: on the CPU that is
        ``flag`` itself; on CUDA those queued earlier whose copy has completed (``flag`` too, if the device is idle).
        Inside ``torch.compile``: False, ``flag`` folded into the traced flags, which the next eager call reads."""
        flag, traced = flag.reshape(()), self._traced
        if torch.compiler.is_compiling():
            self._traced = flag if traced is None else traced | flag
            return False
        if traced is not None:
            self._traced = None
            flag = flag | traced.to(flag.device)
        if not defers(flag.device):
            return bool(flag)
        host = self._host_copy(flag)
        self._pending.append((host, self._recorded_event(flag.device)))
        return self._drain()

    def failed(self, ok: torch.Tensor) -> bool:
        """``raised`` of a check that passes where ``ok`` (a tensor holding one bool) is True: on the CPU ``not
        bool(ok)`` (no op for the negation), on CUDA the negation queued."""
        if not defers(ok.device) and self._traced is None:
            return not bool(ok)
        return self.raised(~ok)

    def idle(self) -> bool:
        """Whether nothing waits to be read: no queued device copy, no compiled forward's flag."""
        return not self._pending and self._traced is None

    def read_traced(self) -> bool:
        """Whether a compiled forward's flag was True since the last read (read now, then cleared): eager callers that
        check a batch themselves ask this first."""
        traced, self._traced = self._traced, None
        return traced is not None and bool(traced)

    def _drain(self) -> bool:
        """Read the completed copies, oldest first (waiting for the oldest while more than ``MAX_PENDING`` wait)."""
        seen = False
        while self._pending:
            host, event = self._pending[0]
            if len(self._pending) <= MAX_PENDING and not event.query():
                break
            event.synchronize()  # a no-op once it has completed
            self._pending.popleft()
            seen = seen or bool(host)
        return seen

    def wait(self) -> bool:
        """Read every flag still queued, waiting for the device (where an exact answer is needed now: an export, the
        end of a fit). Whether any was True."""
        seen = self.read_traced()
        while self._pending:
            host, event = self._pending.popleft()
            event.synchronize()
            seen = seen or bool(host)
        return seen

    @staticmethod
    def _host_copy(flag: torch.Tensor) -> torch.Tensor:
        """A copy of ``flag`` in pinned host memory, made without blocking the host (complete once the next event
        recorded on the device's current stream is)."""
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        return host.copy_(flag.reshape(()), non_blocking=True)

    @staticmethod
    def _recorded_event(device: torch.device) -> Any:
        """An event recorded on ``device``'s current stream, where ``_host_copy`` queued the copy (``query`` /
        ``synchronize``). The stream is named: ``torch.Event(device=d).record()`` records on the current device's
        stream whichever device ``d`` is (the event keeps only the device type), so for a model on cuda:1 while cuda:0
        is current the event would complete with nothing of the copy's stream, and the flag be read unwritten."""
        event = torch.Event(device=device, enable_timing=False)
        event.record(torch.accelerator.current_stream(device))
        return event
