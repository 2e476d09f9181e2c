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
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import quark.torch.quantization.observe_quantize as observe_quantize  # noqa: E402
from bench.qat_overhead import FP8_W8A8, MLP, W8A8  # noqa: E402
from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase  # noqa: E402

SKIPPING = observe_quantize._ObserveFakeQuant.forward


def _always_backward(ctx, x, min_val, max_val, plan, steady):  # type: ignore[no-untyped-def]
    """The Function's forward with the skip undone: the input is kept and the backward runs its mask."""
    out = SKIPPING(ctx, x, min_val, max_val, plan, steady)
    if ctx.unchanged:
        ctx.unchanged = False
        ctx.save_for_backward(x, out[1], out[2])
    return out


MODES = {"skip": staticmethod(SKIPPING), "always": staticmethod(_always_backward)}


def _contender(base: torch.nn.Module, config: dict | None, batch: tuple[torch.Tensor, torch.Tensor]) -> Callable:
    """A training step of a copy of ``base``, quantized with ``config`` (None: FP32) and observing every step."""
    x, y = batch
    model = copy.deepcopy(base).train()
    if config is not None:
        model = ModelQuantizer(config).prepare(model)
        with torch.no_grad():
            model(x)
        for q in model.modules():
            if isinstance(q, FakeQuantizeBase):
                q.enable_observer(True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _time(step: Callable, mode: str, steps: int) -> float:
    observe_quantize._ObserveFakeQuant.forward = MODES[mode]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of contender ``a``'s step over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="512,1024,4096")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=250, help="untimed steps per contender first")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    keep_freed_memory()
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
        steps = {name: _contender(base, config, batch) for name, (_, config) in contenders.items()}
        for name, (mode, _) in contenders.items():
            _time(steps[name], mode, args.warmup)
        times: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                times[name].append(_time(steps[name], contenders[name][0], args.steps))
        observe_quantize._ObserveFakeQuant.forward = MODES["skip"]

        cells = [f"{statistics.median(times['fp32']) * 1e3:.2f}"]
        for f in ("int8", "fp8"):
            cells += [
                f"{_ratio(times, f + ' always', 'fp32'):.3f} / {_ratio(times, f + ' skip', 'fp32'):.3f}",
                f"{_ratio(times, f + ' skip', f + ' always'):.3f}",
            ]
        print(f"| {width} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
