"""The fused observing pass's skipped backward, paired: a QAT step with the observers on, where the fused
observe-and-quantize pass returns the incoming gradient unchanged when the whole input lies inside the format's range
(the default on CPU), against the same kernels with the masked backward always run, in the same process and rounds.

    python bench/observing_backward.py --widths 512,1024,4096

The MLP of ``qat_overhead.py`` (1024 -> width -> 1024 -> 10, batch 32, Adam) in a bare loop, every quantizer
observing at every step (the protocol's first half). Contenders alternate every round (order reversed every other
round) after ``--warmup`` steps each (compiles, direct kernels); x FP32 is the median over rounds of per-round
ratios, and "skip / always" the median of the paired per-round ratios. "always" keeps the input and runs the mask
recomputation for every call, as before the skip existed (the kernel is the same: it reports whether the gradient
passes, and "always" ignores that).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quark.torch.quantization.observe_quantize as observe_quantize  # noqa: E402
from bench import as_a_long_run  # noqa: E402
from bench.qat_overhead import FP8_W8A8, MLP, W8A8, alternate, median_step_time, paired_ratio, qat_step  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402

SKIPPING = observe_quantize._ObserveFakeQuant.forward


def _always_backward(ctx, x, min_val, max_val, plan, steady):  # type: ignore[no-untyped-def]
    """The Function's forward with the skip undone: the input is kept and the backward runs its mask."""
    out = SKIPPING(ctx, x, min_val, max_val, plan, steady)
    if ctx.unchanged:
        ctx.unchanged = False
        ctx.save_for_backward(x, out[1], out[2])
    return out


MODES = {"skip": staticmethod(SKIPPING), "always": staticmethod(_always_backward)}


def _timed(step: Callable[[], None], mode: str) -> Callable[[int], float]:
    """Times ``n`` steps of ``step`` with the Function's forward of ``mode`` in place."""

    def run(n: int) -> float:
        observe_quantize._ObserveFakeQuant.forward = MODES[mode]
        return median_step_time(step, n)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="512,1024,4096")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=250, help="untimed steps per contender first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    keep_freed_memory()
    as_a_long_run()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; observers on at every step")
    print(
        "| width | FP32 ms | int8 W8A8 always / skip x FP32 | int8 skip / always | fp8 W8A8 always / skip x FP32 "
        "| fp8 skip / always |"
    )
    print("|---|---|---|---|---|---|")
    for width in (int(w) for w in args.widths.split(",")):
        torch.manual_seed(0)
        batch = (torch.randn(32, 1024), torch.randint(0, 10, (32,)))
        base = MLP(width)
        contenders = {
            "fp32": ("skip", None),
            "int8 always": ("always", W8A8),
            "int8 skip": ("skip", W8A8),
            "fp8 always": ("always", FP8_W8A8),
            "fp8 skip": ("skip", FP8_W8A8),
        }
        runs = {name: _timed(qat_step(base, cfg, batch, True), mode) for name, (mode, cfg) in contenders.items()}
        times = alternate(runs, args.rounds, args.steps, args.warmup)
        observe_quantize._ObserveFakeQuant.forward = MODES["skip"]

        cells = [f"{statistics.median(times['fp32']) * 1e3:.2f}"]
        for f in ("int8", "fp8"):
            cells += [
                f"{paired_ratio(times, f + ' always', 'fp32'):.3f} / {paired_ratio(times, f + ' skip', 'fp32'):.3f}",
                f"{paired_ratio(times, f + ' skip', f + ' always'):.3f}",
            ]
        print(f"| {width} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
