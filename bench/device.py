"""The device a bench runs on: synchronised timing and the device's measured memory bandwidth (a copy's).

On CUDA, kernels run asynchronously: a host clock read right after a call measures the launch, not the work, so every
timed span starts and ends with ``sync``. The physical limit of a memory-bound kernel is the device's memory
bandwidth; ``copy_bandwidth`` measures it the way the kernels use it (a device-to-device copy of a large tensor,
read + write), in the same run as the contenders.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["CPU", "copy_bandwidth", "describe", "parse_device", "sync"]

CPU = torch.device("cpu")


def parse_device(name: str) -> torch.device:
    """``--device`` as a torch device, refused with the reason where this machine has no such device."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch {torch.__version__} sees no CUDA device here")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {name}: allowed cpu, cuda, cuda:N")
    return device


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """The device in a report line: the GPU's name and memory, or the CPU's thread count."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def copy_bandwidth(device: torch.device, mib: int = 256, repeats: int = 9) -> float:
    """GB/s of a copy of a ``mib`` MiB float32 tensor into another on ``device`` (bytes read + written over the
    median time): the memory-bound limit the benches report against."""
    src = torch.empty(mib * 2**18, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9
