"""The observers' NaN / Inf check (``observer.base.all_finite``: one ``aminmax``) against its peer, PyTorch's
``torch.isfinite(v).all()`` (five elementwise ops on the CPU), measured in the same run: per call on statistics of
32-65536 values, then inside observing QAT steps (the MLP of ``qat_overhead.py``, bare loop, observers on at every
step), two copies of one model alternated round by round, one checking with ours and one with the peer swapped in.

    python bench/finite_check.py
    python bench/finite_check.py --widths 256,512 --formats mx,fp8,int8 --rounds 21
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

from bench import as_a_long_run  # noqa: E402
from bench.qat_overhead import FP8_ON, FP32, MX, OURS_ON, build  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402
from quark.torch.quantization.observer import base  # noqa: E402

FORMATS = {"mx": MX, "fp8": FP8_ON, "int8": OURS_ON}
OURS = base.all_finite


def peer(v: torch.Tensor) -> bool:
    """The check as written with PyTorch's own op."""
    return bool(torch.isfinite(v).all())


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def with_check(step: Callable[[], None], check: Callable[[torch.Tensor], bool]) -> Callable[[], None]:
    """``step`` with the observers' check set to ``check`` (``check_finite`` looks it up at each call)."""

    def run() -> None:
        base.all_finite = check
        step()

    return run


def paired_steps(width: int, fmt: str, rounds: int, steps: int) -> tuple[float, float, float]:
    """Median ms of FP32's step, the peer's over FP32, ours over FP32, and ours over the peer paired per round."""
    contenders = {
        "fp32": build(FP32, batch=32, kind="mlp", width=width)[0],
        "peer": with_check(build(FORMATS[fmt], batch=32, kind="mlp", width=width)[0], peer),
        "ours": with_check(build(FORMATS[fmt], batch=32, kind="mlp", width=width)[0], OURS),
    }
    for step in contenders.values():
        for _ in range(40):
            step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders.items())
        for name, step in order if r % 2 else reversed(order):
            spans = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                spans.append(time.perf_counter() - t0)
            times[name].append(statistics.median(spans))
    base.all_finite = OURS

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    return ratio("peer", "fp32"), ratio("ours", "fp32"), ratio("ours", "peer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="256,512")
    parser.add_argument("--formats", default="mx,fp8,int8", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=10, help="steps per contender per round")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats: unknown {unknown}; allowed {', '.join(FORMATS)}")
    keep_freed_memory()
    as_a_long_run()
    print(f"# CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| values | torch.isfinite(v).all() us | all_finite us | ours / peer |")
    print("|---|---|---|---|")
    for numel in (32, 1024, 8192, 65536):
        v = torch.rand(numel)
        p, o = per_call_us(lambda v=v: peer(v)), per_call_us(lambda v=v: OURS(v))
        print(f"| {numel} | {p:.1f} | {o:.1f} | {o / p:.2f} |")
    print("\n| width | format | peer x FP32 | ours x FP32 | ours / peer (paired) |")
    print("|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        for fmt in formats:
            p, o, paired = paired_steps(width, fmt, args.rounds, args.steps)
            print(f"| {width} | {fmt} | {p:.3f} | {o:.3f} | {paired:.3f} |", flush=True)


if __name__ == "__main__":
    main()
