"""The integer GEMM of fake-quantized Linears (``quark.torch.quantization.integer_linear``), paired against the float
GEMM of the same fake-quantized tensors in the same process and rounds.

    python bench/integer_linear.py --widths 512,1024,4096
    python bench/integer_linear.py --widths 1024,4096 --formats uint8,tqt --no-products

Two tables:

1. **One Linear's forward product** (the kernels ``QuantLinear`` runs after its quantizers): ``F.linear`` of the
    fake-quantized input and weight against the integer path (the codes read back, ``torch._int_mm``, the scaling),
    at the shapes a batch of ``--rows`` rows meets; the ratio is where ``INTEGER_GEMM_MIN_WEIGHT_NUMEL`` comes from.
2. **QAT steps** of each ``--formats`` entry (``FORMATS``: int8 W8A8; uint8 asymmetric inputs with int8 weights;
    the w4a8_tqt preset's learned thresholds; LSQ's learned int8 scales), the MLP of ``qat_overhead.py`` (1024 -> width -> 1024 -> 10, batch 32,
    Adam) in a bare loop: observers on at every step (the warm-up half) and off (the steady half; TQT learns its
    thresholds either way, and LSQ its scales, so they have only this half), the integer GEMM on and off (``set_integer_gemm``), each over
    FP32 in the same round, and on / off paired. Contenders alternate every round (order reversed every other round)
    after ``--warmup`` steps each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import as_a_long_run  # noqa: E402
from bench.qat_overhead import MLP, W4A8_TQT, W8A8, alternate, median_step_time, paired_ratio, qat_step  # noqa: E402
from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402
from quark.torch.quantization import integer_linear  # noqa: E402
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT  # noqa: E402

UINT8_INPUTS = {
    "global_quant_config": {
        "weight": INT8_PER_CHANNEL_WEIGHT,
        "input_tensors": {**INT8_PER_TENSOR_ACT, "dtype": "uint8", "symmetric": False},
    }
}
_LSQ = {"qat_spec": {"method": "lsq"}}
LSQ_W8A8 = {
    "global_quant_config": {
        "weight": {**INT8_PER_CHANNEL_WEIGHT, **_LSQ},
        "input_tensors": {**INT8_PER_TENSOR_ACT, **_LSQ},
    }
}
#: name -> (config, whether its observers matter: TQT's and LSQ's learned scales do not follow them)
FORMATS = {"w8a8": (W8A8, True), "uint8": (UINT8_INPUTS, True), "tqt": (W4A8_TQT, False), "lsq": (LSQ_W8A8, False)}

#: (in_features, out_features) of the product table: below, at and above the threshold, transformer widths
SHAPES = ((256, 256), (256, 1024), (512, 512), (1024, 512), (1024, 1024), (1024, 4096), (4096, 1024))


def _median_us(fn: Callable[[], object], calls: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def product_table(rows: int, calls: int) -> None:
    """The forward product alone, float against integer, on an int8 W8A8 layer of each shape."""
    print(f"\n## One Linear's forward product, {rows} rows (median of {calls} calls, us)\n")
    print("| in x out | weight elements | F.linear | integer GEMM | integer / float |")
    print("|---|---|---|---|---|")
    for k, n in SHAPES:
        torch.manual_seed(0)
        layer = ModelQuantizer(W8A8).prepare(torch.nn.Sequential(torch.nn.Linear(k, n)))[0]
        x = torch.randn(rows, k)
        with torch.no_grad():
            layer(x)
            xq, (wq, b) = layer._input_quantizer(x), layer.quantized_weight_and_bias()
            scales = integer_linear.integer_scales(xq, wq, b, layer._input_quantizer, layer._weight_quantizer)
            if scales is None:  # below the threshold: time the integer path anyway, with the layer's scales
                sx = layer._input_quantizer.scale.reshape(())
                scales = (sx, layer._weight_quantizer.scale.reshape(-1, 1), 0)
            fl = _median_us(lambda: F.linear(xq, wq, b), calls, 200)  # noqa: B023
            it = _median_us(lambda: integer_linear._integer_linear(xq, wq, b, *scales), calls, 200)  # noqa: B023
        print(f"| {k} x {n} | {k * n} | {fl:.0f} | {it:.0f} | {it / fl:.2f} |", flush=True)


def _timed(step: Callable[[], None], integer: bool) -> Callable[[int], float]:
    """Times ``n`` steps of ``step`` with the integer GEMM switched on or off."""

    def run(n: int) -> float:
        integer_linear.set_integer_gemm(integer)
        return median_step_time(step, n)

    return run


def step_table(fmt: str, widths: list[int], rounds: int, steps: int, warmup: int) -> None:
    config, observed = FORMATS[fmt]
    halves = (True, False) if observed else (False,)
    print(f"\n## {fmt} QAT steps, bare loop ({rounds} rounds of {steps} steps; x FP32 in the same round)\n")
    names = {True: "observers on", False: "observers off" if observed else "learned scales"}
    head = " | ".join(f"{names[h]}: float / integer x FP32 | integer / float" for h in halves)
    print(f"| width | FP32 ms | {head} |")
    print("|---|---|" + "---|---|" * len(halves))
    for width in widths:
        torch.manual_seed(0)
        batch = (torch.randn(32, 1024), torch.randint(0, 10, (32,)))
        base = MLP(width)
        contenders = {"fp32": (None, False, False)}
        for observe in halves:
            for integer in (False, True):
                contenders[f"{observe} {integer}"] = (config, observe, integer)
        runs = {name: _timed(qat_step(base, cfg, batch, obs), it) for name, (cfg, obs, it) in contenders.items()}
        times = alternate(runs, rounds, steps, warmup)
        integer_linear.set_integer_gemm(None)

        cells = [f"{statistics.median(times['fp32']) * 1e3:.2f}"]
        for observe in halves:
            f, i = f"{observe} False", f"{observe} True"
            cells += [
                f"{paired_ratio(times, f, 'fp32'):.3f} / {paired_ratio(times, i, 'fp32'):.3f}",
                f"{paired_ratio(times, i, f):.3f}",
            ]
        print(f"| {width} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="512,1024,4096")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--calls", type=int, default=100, help="timed calls per product")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per contender per round")
    parser.add_argument("--warmup", type=int, default=250, help="untimed steps per contender first")
    parser.add_argument("--formats", default="w8a8", help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--no-products", action="store_true", help="the QAT steps only")
    args = parser.parse_args()
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats: unknown {unknown}; allowed: {sorted(FORMATS)}")
    warnings.filterwarnings("ignore")
    keep_freed_memory()
    as_a_long_run()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.no_products:
        product_table(args.rows, args.calls)
    for fmt in formats:
        step_table(fmt, [int(w) for w in args.widths.split(",")], args.rounds, args.steps, args.warmup)


if __name__ == "__main__":
    main()
