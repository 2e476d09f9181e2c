"""Where compiling a format kernel pays: eager against compiled time per call by size, and the compile's own cost.

python bench/compile_thresholds.py [--sizes 12,14,16,18,20,22] [--kernels int_forward,_int_grad,...]

For each ``compilable`` kernel the default ``python train.py`` and the QAT presets hit (``int_forward`` and
``_int_grad`` per channel, ``grid_forward`` for fp8, ``_fake_mx`` for MXFP4, ``aminmax_along``), on [rows, 1024]
float32 tensors of 2^k elements: the median eager and compiled time per call (the ratio is eager / compiled, measured
in the same loop), the compile time of the kernel's first call with an empty inductor cache (a new temporary
``TORCHINDUCTOR_CACHE_DIR``, set before torch is imported) and the calls at each size that pay the compile back
(compile time / (eager - compiled)). Machine: 2 shared CPU cores; ``uptime``'s load is printed beside the figures
(on a loaded machine run it with ``OMP_NUM_THREADS=1``: two OpenMP threads that wait on a descheduled peer turn
every parallel op into a scheduler tick, 4 or 8 ms).
Used to set ``Backend.min_numel`` and ``Backend.warmup_numel`` (quark/torch/quantization/formats/grouping.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

_CACHE = tempfile.TemporaryDirectory(prefix="compile_thresholds_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE.name  # before torch is imported: an empty cache, a cold compile

import torch  # noqa: E402

from quark.torch.quantization.config.type import Dtype, RoundType  # noqa: E402
from quark.torch.quantization.formats import block, grouping, integer, minifloat  # noqa: E402
from quark.torch.quantization.formats.table import FP8_E4M3  # noqa: E402


def cases(x: torch.Tensor) -> dict[str, tuple[Callable[..., torch.Tensor], tuple]]:
    """Each kernel with its arguments for ``x`` [rows, 1024]: the eager body is ``kernel.__wrapped__``."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    zp = torch.zeros_like(scale, dtype=torch.int32)
    grad = torch.randn_like(x)
    return {
        "int_forward": (integer.int_forward, (x, scale, zp, -128, 127, RoundType.half_even)),
        "_int_grad": (integer._int_grad, (grad, x, scale, zp, -128, 127, RoundType.half_even)),
        "grid_forward": (minifloat.grid_forward, (x, scale / 448 * 127, FP8_E4M3)),
        "_fake_mx": (block._fake_mx, (x, Dtype.fp4, 32, -1)),
        "aminmax_along": (grouping.aminmax_along, (x, 1)),
    }


def per_call_ms(fn: Callable[..., torch.Tensor], args: tuple, reps: int) -> float:
    """Median wall time of one call, in ms."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="12,14,16,18,20,22", help="log2 of the element counts")
    parser.add_argument("--kernels", default="int_forward,_int_grad,grid_forward,_fake_mx,aminmax_along")
    args = parser.parse_args()
    torch.manual_seed(0)
    grouping.set_compile(True)  # the compiled side is called through the compilable wrapper, as the engine does
    sizes = [1 << int(k) for k in args.sizes.split(",")]
    kernels = args.kernels.split(",")
    print(f"machine: 2 shared CPU cores, {torch.get_num_threads()} torch threads; load {os.getloadavg()}")
    print("| kernel | elements | eager ms | compiled ms | eager / compiled | calls to pay the compile back |")
    print("|---|---|---|---|---|---|")
    for name in kernels:
        first = True
        for n in sizes:
            x = torch.randn(max(n // 1024, 1), min(n, 1024))
            kernel, kargs = cases(x)[name]
            if first:  # the first compiled call compiles (dynamic=True: one kernel for every size)
                t0 = time.perf_counter()
                kernel(*kargs)
                compile_s = time.perf_counter() - t0
                print(f"| {name} | compile (empty cache) | | {1e3 * compile_s:.0f} | | |")
                first = False
            reps = max(5, min(200, (1 << 24) // n))
            kernel(*kargs)  # a warm call at this size (a new size may add a guard check, never a recompile)
            eager, compiled = [], []
            for _ in range(3):  # interleaved rounds
                eager.append(per_call_ms(kernel.__wrapped__, kargs, reps))
                compiled.append(per_call_ms(kernel, kargs, reps))
            e, c = statistics.median(eager), statistics.median(compiled)
            payback = f"{compile_s * 1e3 / (e - c):.0f}" if e > c else "never"
            print(f"| {name} | 2^{n.bit_length() - 1} | {e:.3f} | {c:.3f} | {e / c:.2f} | {payback} |")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
