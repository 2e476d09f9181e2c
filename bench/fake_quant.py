"""Forward and forward+backward time of every format on one float32 matrix, as ratios to peers in the same run.

Peers: a memory copy into a preallocated tensor (read + write: the memory-bound limit every ratio is taken
against), ``clone`` (the same plus an allocation), torch's fused fake_quantize kernels (int8 per-tensor /
per-channel) and the float8 cast round trip (``x.to(float8).float()``). Format kernels as a user gets them (``auto``:
compiled where they work) unless ``--backend`` says otherwise.

    python bench/fake_quant.py               # 4096 x 4096, median of 7 interleaved rounds
    python bench/fake_quant.py --size 1024 --repeats 5
    python bench/fake_quant.py --backend eager   # the eager kernels (what runs where torch.compile cannot)
    python bench/fake_quant.py --dtype bfloat16  # a bfloat16 tensor (the copy peer copies bfloat16 too)
    python bench/fake_quant.py --device cuda     # on a GPU: every span synchronised, the copy's GB/s reported
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import as_a_long_run
from bench.device import CPU, copy_bandwidth, describe, parse_device, sync
from quark.torch.cpu_allocator import keep_freed_memory
from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    fake_cast,
    fake_quantize_bfp16,
    fake_quantize_int,
    fake_quantize_minifloat,
    fake_quantize_mx,
    fake_quantize_mx6,
    fake_quantize_mx9,
    set_compile,
)
from quark.torch.quantization.formats.table import TORCH_FLOAT8


def _ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return 1e3 * (time.perf_counter() - t0)


def _cases(x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    rows = x.shape[0]
    xs = x.detach().float()  # float32 scales, whatever x's dtype
    s_t = (xs.abs().max() / 127.5).reshape(())
    z_t = torch.zeros((), dtype=torch.int32, device=x.device)
    s_c = xs.abs().amax(dim=1) / 127.5
    z_c = torch.zeros(rows, dtype=torch.int32, device=x.device)
    s_g = xs.reshape(rows, -1, 32).abs().amax(dim=-1) / 7.5
    z_g = torch.zeros_like(s_g, dtype=torch.int32)
    s_f8 = (xs.abs().max() / 448).reshape(())

    def minifloat(dtype: Dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        fmt = FLOAT_FORMATS[dtype]
        s = (xs.abs().max() / fmt.max_normal).reshape(())
        return lambda t: fake_quantize_minifloat(t, fmt, s, torch_dtype=TORCH_FLOAT8.get(dtype))

    out = torch.empty_like(x)
    return {
        "peer: copy": lambda t: out.copy_(t),  # read + write of the tensor: the memory-bound limit
        "peer: clone": lambda t: t.clone(),
        # torch's kernels take float32 only: a half-precision tensor is cast there and back, as a user would
        "peer: torch int8 per-tensor": lambda t: torch.fake_quantize_per_tensor_affine(
            t.float(), s_t, z_t, -128, 127
        ).to(t.dtype),
        "peer: torch int8 per-channel": lambda t: torch.fake_quantize_per_channel_affine(
            t.float(), s_c, z_c, 0, -128, 127
        ).to(t.dtype),
        "peer: fp8 e4m3 cast round trip": lambda t: t.to(torch.float8_e4m3fn).to(t.dtype),
        "int8 per-tensor": lambda t: fake_quantize_int(t, s_t, z_t, -128, 127),
        "int8 per-channel": lambda t: fake_quantize_int(
            t, s_c, z_c, -128, 127, qscheme=QSchemeType.per_channel, axis=0
        ),
        "int8 per-tensor, round half away": lambda t: fake_quantize_int(
            t, s_t, z_t, -128, 127, round_method=RoundType.round
        ),
        "int4 per-group g32": lambda t: fake_quantize_int(
            t, s_g, z_g, -8, 7, qscheme=QSchemeType.per_group, axis=1, group_size=32
        ),
        "fp8_e4m3 per-tensor": lambda t: fake_quantize_minifloat(
            t, FLOAT_FORMATS[Dtype.fp8_e4m3], s_f8, torch_dtype=torch.float8_e4m3fn
        ),
        "fp8_e5m2 per-tensor": minifloat(Dtype.fp8_e5m2),
        "fp6_e3m2 per-tensor": minifloat(Dtype.fp6_e3m2),
        "fp6_e2m3 per-tensor": minifloat(Dtype.fp6_e2m3),
        "fp4 per-tensor": minifloat(Dtype.fp4),
        "mxfp8 (e4m3)": lambda t: fake_quantize_mx(t, Dtype.fp8_e4m3),
        "mxfp6 (e3m2)": lambda t: fake_quantize_mx(t, Dtype.fp6_e3m2),
        "mxfp4": lambda t: fake_quantize_mx(t, Dtype.fp4),
        "mxint8": lambda t: fake_quantize_mx(t, Dtype.int8),
        "mx6": fake_quantize_mx6,
        "mx9": fake_quantize_mx9,
        "bfp16": fake_quantize_bfp16,
        "bfloat16 cast": lambda t: fake_cast(t, torch.bfloat16),
    }


def run(
    size: int = 4096,
    repeats: int = 7,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> dict[str, tuple[float, float, float]]:
    """{name: (forward ms, forward+backward ms, forward / copy)}: medians over ``repeats`` rounds, each of which
    times every case once after two warm-up calls per case (the first compile the kernels); the copy ratio is the
    median of per-round ratios, so a slow stretch of a shared machine hits both sides of it alike."""
    torch.manual_seed(seed)
    x = torch.randn(size, size).to(device, dtype)
    grad = torch.randn(size, size).to(device, dtype)
    xg = x.clone().requires_grad_(True)
    fwd_fns, both_fns = {}, {}
    for name, fn in _cases(x).items():
        fwd_fns[name] = torch.no_grad()(lambda fn=fn: fn(x))
        if not name.startswith(("peer: copy", "peer: clone")):

            def step(fn=fn) -> None:
                fn(xg).backward(grad)
                xg.grad = None

            both_fns[name] = step
    for fn in (*fwd_fns.values(), *both_fns.values()):
        fn()
        fn()
    fwd: dict[str, list[float]] = {name: [] for name in fwd_fns}
    both: dict[str, list[float]] = {name: [] for name in both_fns}
    for _ in range(repeats):
        for name, fn in fwd_fns.items():
            fwd[name].append(_ms(fn, device))
        for name, fn in both_fns.items():
            both[name].append(_ms(fn, device))
    copy = fwd["peer: copy"]
    return {
        name: (
            statistics.median(ts),
            statistics.median(both[name]) if name in both else float("nan"),
            statistics.median(t / c for t, c in zip(ts, copy, strict=True)),
        )
        for name, ts in fwd.items()
    }


#: the issue's goals, as forward time over a memory copy of the tensor
COPY_GOALS = {"int8 per-tensor": 1.5, "int8 per-channel": 1.5, "fp8": 2.0, "fp6": 2.0, "fp4": 2.0, "mx": 2.5}


def _copy_goal(name: str) -> float | None:
    return next((g for prefix, g in COPY_GOALS.items() if name.startswith(prefix)), None)


def _report(
    results: dict[str, tuple[float, float, float]],
    size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> None:
    ref = {
        "int8 per-tensor": "peer: torch int8 per-tensor",
        "int8 per-channel": "peer: torch int8 per-channel",
        "fp8_e4m3 per-tensor": "peer: fp8 e4m3 cast round trip",
        "fp8_e5m2 per-tensor": "peer: fp8 e4m3 cast round trip",
    }
    copy_ms = results["peer: copy"][0]
    moved = 2 * size * size * torch.empty((), dtype=dtype).element_size()  # the copy peer reads and writes it once
    print(f"# fake quantization of a {size}x{size} {str(dtype).removeprefix('torch.')} tensor on {describe(device)}")
    print(
        f"# memory bandwidth: the copy peer moves {moved / 1e6:.0f} MB in {copy_ms:.3f} ms ({moved / copy_ms / 1e6:.0f}"
        f" GB/s); a 256 MiB device copy: {copy_bandwidth(device):.0f} GB/s"
    )
    print(f"| {'format':34s} | fwd ms | fwd+bwd ms | fwd / copy | fwd / peer | peer | goal (fwd / copy) |")
    print("|" + "---|" * 7)
    for name, (fwd, both, to_copy) in results.items():
        peer_name = ref.get(name, "").removeprefix("peer: ")
        ratio = f"{fwd / results[ref[name]][0]:.2f}" if name in ref else ""
        limit = None if name.startswith("peer") else _copy_goal(name)
        goal = f"<= {limit}x: {'met' if to_copy <= limit else 'MISSED'}" if limit else ""
        print(f"| {name:34s} | {fwd:6.1f} | {both:10.1f} | {to_copy:10.2f} | {ratio:>10s} | {peer_name} | {goal} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave glibc's allocator as it is (default: keep_freed_memory(), as train.py does)",
    )
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--backend",
        choices=("auto", "compile", "eager"),
        default="auto",
        help="auto: the default a user gets (compiled kernels where they work); compile: always; eager: never",
    )
    args = parser.parse_args()
    kept = not args.system_allocator and keep_freed_memory()
    print(f"# CPU allocator: {'freed memory kept (keep_freed_memory)' if kept else 'system default'}")
    set_compile({"auto": None, "compile": True, "eager": False}[args.backend])
    as_a_long_run()
    print(f"# format kernels: {args.backend}")
    dtype = getattr(torch, args.dtype)
    device = parse_device(args.device)
    _report(run(args.size, args.repeats, dtype=dtype, device=device), args.size, dtype, device)


if __name__ == "__main__":
    main()
