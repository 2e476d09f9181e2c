"""QAT step time when the user compiles the model: ``torch.compile(model)`` around the quantized MLP of
``qat_overhead.py`` (1024 -> width -> 1024 -> 10, batch 32, Adam), against the same model eager and against FP32
eager and compiled, paired in every round; and the graph breaks dynamo counted while compiling each.

Before the quantizers' switches were host values a compiled graph specializes on (``FakeQuantizeBase.flag``) and
their NaN / Inf checks were folded in the graph (``late_flag``), every quantizer split the user's graph in two: at
width 512, QAT under ``torch.compile`` took 1.86x (observers off) and 2.58x (on) the compiled FP32 step.

    python bench/qat_compiled.py                      # widths 512, 1024; int8, fp8 and MX
    python bench/qat_compiled.py --widths 512 --formats int8 --rounds 5
    python bench/qat_compiled.py --widths 512,1024 --formats tqt   # TQT (learned thresholds)
    python bench/qat_compiled.py --widths 1024 --bounds   # + the floor and torch clamp (qat_overhead.BOUND_LAYERS)

Each contender is built, warmed up (``--warmup`` steps, its compile included) and then timed ``--steps`` steps per
round, contenders interleaved (order reversed every other round); x FP32 is the median over rounds of per-round
ratios. "on" / "off": observers on / off for every step (the QAT protocol's two halves).
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import as_a_long_run  # noqa: E402
from bench.qat_overhead import BOUND_LAYERS, FP8_W8A8, MLP, MX_W4A8, W4A8_TQT, W8A8, bounded  # noqa: E402
from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.compat import dynamo_recompile_limit  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase  # noqa: E402

#: TQT: int4 weights / int8 inputs with learned power-of-two thresholds (``--formats tqt``: not in the default set)
FORMATS = {"int8": W8A8, "fp8": FP8_W8A8, "mx": MX_W4A8, "tqt": W4A8_TQT}


def _contender(
    base: nn.Module,
    config: dict | str | None,
    observe: bool,
    compiled: bool,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> tuple[Callable[[], None], int]:
    """A training step of a copy of ``base`` (quantized with ``config`` unless None, observers ``observe``; a
    ``BOUND_LAYERS`` name: float with that bound's layers), under ``torch.compile`` if ``compiled``; and the graph
    breaks its compile counted."""
    x, y = batch
    model = copy.deepcopy(base).train()
    if isinstance(config, str):
        model = bounded(model, config)
    elif config is not None:
        model = ModelQuantizer(config).prepare(model)
        with torch.no_grad():
            model(x)  # calibrated: every quantizer has qparams
        for q in model.modules():
            if isinstance(q, FakeQuantizeBase):
                q.enable_observer(observe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    run = torch.compile(model) if compiled else model

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(run(x), y).backward()
        opt.step()

    before = sum(torch._dynamo.utils.counters["graph_break"].values())
    step()
    return step, sum(torch._dynamo.utils.counters["graph_break"].values()) - before


def _ratio(times: dict[str, list[float]], key: str, ref: str) -> float:
    """The median over rounds of ``key``'s step over ``ref``'s in the same round."""
    return statistics.median(a / b for a, b in zip(times[key], times[ref], strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="512,1024")
    parser.add_argument("--formats", default="int8,fp8,mx", help=f"comma-separated, of {sorted(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps per contender first")
    parser.add_argument(
        "--bounds", action="store_true", help=f"also the bounds {', '.join(BOUND_LAYERS)} (qat_overhead.BOUND_LAYERS)"
    )
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats: {unknown} unknown; allowed: {sorted(FORMATS)}")
    warnings.filterwarnings("ignore")
    keep_freed_memory()
    as_a_long_run()
    # every contender is a model of its own with the same forward: dynamo keeps one entry per model, and past its
    # per-frame limit (8) a model would run eagerly, uncompiled
    dynamo_recompile_limit(64)
    torch.manual_seed(0)
    batch = (torch.randn(32, 1024), torch.randint(0, 10, (32,)))
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; MLP 1024 -> width -> 1024 -> 10, batch 32")
    for width in (int(w) for w in args.widths.split(",")):
        base = MLP(width)
        steps: dict[str, Callable[[], None]] = {}
        breaks: dict[str, int] = {}
        names: list[tuple[str, dict | str | None, bool]] = [("fp32", None, False)]
        names += [(f"{f} {o}", FORMATS[f], o == "on") for f in formats for o in ("on", "off")]
        if args.bounds:
            names += [(bound, bound, False) for bound in BOUND_LAYERS]
        for compiled in (False, True):
            for name, config, observe in names:
                key = f"{name}{' compiled' if compiled else ''}"
                steps[key], breaks[key] = _contender(base, config, observe, compiled, batch)
                for _ in range(args.warmup):
                    steps[key]()
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(args.rounds):
            for key in list(steps) if r % 2 == 0 else reversed(list(steps)):
                spans = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    steps[key]()
                    spans.append(time.perf_counter() - t0)
                times[key].append(statistics.median(spans))

        print(f"\nwidth {width}: FP32 eager {statistics.median(times['fp32']) * 1e3:.2f} ms a step")
        print("| contender | eager x FP32 eager | compiled x FP32 compiled | compiled x FP32 eager | graph breaks |")
        print("|---|---|---|---|---|")
        for name, _, _ in names:
            print(
                f"| {name} | {_ratio(times, name, 'fp32'):.3f} | {_ratio(times, name + ' compiled', 'fp32 compiled'):.3f} | "
                f"{_ratio(times, name + ' compiled', 'fp32'):.3f} | {breaks[name + ' compiled']} |"
            )


if __name__ == "__main__":
    main()
