"""QAT training-step overhead on the digits CNN: time and peak memory of a step, as ratios to FP32 and to torch.ao.

A step: ``zero_grad`` -> forward -> cross-entropy -> backward -> ``optimizer.step`` (Adam by default) on one batch
of random 1x8x8 images (256 by default, 10 classes) through ``tasks.digits.DigitsCNN``. Contenders, each on its own
copy of the same initial model with its own optimizer:

- ``fp32``: the plain model.
- ``ours W8A8, observers on``: ``ModelQuantizer(config).prepare(model)`` with int8 per-channel symmetric weights and
  int8 per-tensor static activations (min-max), observers on as during QAT warm-up (statistics and qparams follow
  every step).
- ``ours W8A8, observers off``: the same after warm-up steps with observers on, then every quantizer's observer off
  (the steady state: fixed qparams, fake quantization only).
- ``ours W4A8 TQT``: int4 per-tensor pof2 weights and int8 per-tensor pof2 activations, both TQT (learned log2
  thresholds, initialised by ``_3SD`` on the first batch).
- ``torch.ao, observers on`` / ``observers off``: ``torch.ao.quantization.prepare_qat`` with
  ``get_default_qat_qconfig("x86")`` (fused moving-average observer + fake-quant kernels; per-channel int8 weights,
  uint8 activations) on the model wrapped in QuantStub/DeQuantStub; "off" after ``apply(disable_observer)``.
  Eager torch.ao fake-quantizes each layer's output (plus the QuantStub), ours each layer's input: 5 against 4
  activation quantizers, 4 weight quantizers each.

Time: every round runs every contender ``--steps`` steps (in an order rotated each round) after ``--warmup`` steps
each; ``x FP32`` is the median over ``--rounds`` rounds of the contender's time over FP32's in the same round (with
the quartiles), so drift of a shared machine hits both sides of a ratio alike. ``torch.get_num_threads()`` is left
at its default.

Peak memory: CPU torch has no peak-memory counter, so each contender runs in a fresh subprocess (this script with
``--memory-child``). It builds model, data and optimizer, runs one no_grad forward that initialises the qparams /
TQT thresholds as a calibration batch would (the "observers off" contenders switch their observers off right after
it, with no training step before the baseline), then measures:

- ``peak MB`` (the goal's metric): the peak of live tensor bytes during ``--memory-steps`` steady-state steps, over
  the tensor bytes live before them, from the CPU allocator's allocation/free events (``torch.profiler`` with
  ``profile_memory=True``, replayed in time order). Exact and deterministic: activations and tensors saved for
  backward, gradients, temporaries of fake quantization and the optimizer; it does not see the allocator's caching,
  code pages or Python objects.
- ``RSS MB`` (a cross-check): ``VmHWM`` minus ``VmRSS`` from /proc/self/status, the RSS measured before the first
  step, over the first ``--memory-steps`` steps, so it also holds the optimizer state created by the first step, the code pages faulted in by the first
  backward and whatever malloc keeps; it moves by an MB or two from run to run (median of ``--memory-repeats``
  processes, run side by side), which is much of what a tiny model adds, hence not the goal's metric.

Goals: our step time <= 1.5x FP32 and no worse than torch.ao's ratio (ours on vs torch.ao on, ours off vs torch.ao
off, TQT vs torch.ao on, the default state of prepare_qat); our peak tensor memory <= 1.3x FP32's.

    python bench/qat_overhead.py             # 21 rounds of 5 steps, memory over 5 steps in 3 processes each
    python bench/qat_overhead.py --quick     # a short run (5 rounds of 2 steps, 1 memory process each)
    python bench/qat_overhead.py --optimizer sgd --batch 64
    python bench/qat_overhead.py --profile   # also: top ops by self CPU time of every contender
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao import quantization as tq

from quark.torch import ModelQuantizer
from quark.torch.cpu_allocator import keep_freed_memory
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from tasks.digits import DigitsCNN
from tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

_TQT = {"method": "tqt", "threshold_init_meth": "_3SD"}
_POF2 = {"symmetric": True, "is_dynamic": False, "round_method": "half_even", "scale_type": "pof2", "qat_spec": _TQT}
W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
W4A8_TQT = {
    "global_quant_config": {
        "weight": {"dtype": "int4", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", **_POF2},
        "input_tensors": {"dtype": "int8", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", **_POF2},
    }
}

FP32 = "fp32"
OURS_ON, OURS_OFF, OURS_TQT = "ours W8A8, observers on", "ours W8A8, observers off", "ours W4A8 TQT"
AO_ON, AO_OFF = "torch.ao, observers on", "torch.ao, observers off"
CONTENDERS = (FP32, OURS_ON, OURS_OFF, OURS_TQT, AO_ON, AO_OFF)
#: our contender -> the torch.ao contender whose ratio it must not exceed
PEER = {OURS_ON: AO_ON, OURS_OFF: AO_OFF, OURS_TQT: AO_ON}
TIME_GOAL, MEMORY_GOAL = 1.5, 1.3
_MARK = "QAT-OVERHEAD-MEMORY "


class _AOWrapper(nn.Module):
    """QuantStub -> model -> DeQuantStub: eager torch.ao needs the stubs to quantize the input."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.quant = tq.QuantStub()
        self.model = model
        self.dequant = tq.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.model(self.quant(x)))


def _set_observers(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, FakeQuantizeBase):
            m.enable_observer(enabled)


def _quantized_model(name: str, base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base).train()
    if name in (OURS_ON, OURS_OFF):
        return ModelQuantizer(W8A8).prepare(model)
    if name == OURS_TQT:
        return ModelQuantizer(W4A8_TQT).prepare(model)
    if name in (AO_ON, AO_OFF):
        wrapped = _AOWrapper(model).train()
        wrapped.qconfig = tq.get_default_qat_qconfig("x86")
        with warnings.catch_warnings():  # torch.ao's deprecation notice and reduce_range advice
            warnings.simplefilter("ignore")
            return tq.prepare_qat(wrapped, inplace=True)
    return model


def build(
    name: str, batch: int = 256, optimizer: str = "adam", observe_steps: int = 3, seed: int = 0
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """The training step of one contender (and its optimizer), ready to run.

    Every contender sees one forward of the batch first (observers on, no_grad): it sets our qparams, the TQT
    thresholds and torch.ao's scales as a calibration batch would. "observers off" contenders then run
    ``observe_steps`` training steps with observers on (QAT warm-up) and switch their observers off.
    """
    torch.manual_seed(seed)
    base = DigitsCNN()
    x = torch.rand(batch, 1, 8, 8)
    y = torch.randint(0, 10, (batch,))
    model = _quantized_model(name, base)
    params = list(model.parameters())  # TQT adds the log2 thresholds
    opt = torch.optim.Adam(params, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    with torch.no_grad():
        model(x)
    if name in (OURS_OFF, AO_OFF):
        for _ in range(observe_steps):
            step()
        if name == OURS_OFF:
            _set_observers(model, False)
        else:
            model.apply(tq.disable_observer)
    return step, opt


def run(
    batch: int = 256, optimizer: str = "adam", rounds: int = 21, steps: int = 5, warmup: int = 5
) -> dict[str, list[float]]:
    """Per-round ms per step of every contender: all contenders in every round, in an order rotated each round."""
    fns = {name: build(name, batch, optimizer)[0] for name in CONTENDERS}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append(1e3 * (time.perf_counter() - t0) / steps)
    return times


def ratios(times: dict[str, list[float]], ref: str = FP32) -> dict[str, tuple[float, float, float]]:
    """(first quartile, median, third quartile) of each contender's per-round time over ``ref``'s in the same round:
    slow drift of the machine (other processes) hits both sides of every ratio alike."""
    out = {}
    for name, ts in times.items():
        q1, med, q3 = statistics.quantiles(
            [t / r for t, r in zip(ts, times[ref], strict=True)], n=4, method="inclusive"
        )
        out[name] = (q1, med, q3)
    return out


# ----------------------------------------------------------------------------------------------- memory
def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _tensor_peak_mb(step: Callable[[], None], opt: torch.optim.Optimizer, steps: int) -> float:
    """Peak of live tensor bytes over ``steps`` steps, relative to the start, from the allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    opt.zero_grad(set_to_none=True)  # start with no gradients alive (their frees would be of unknown size)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def memory_child(name: str, batch: int, optimizer: str, steps: int) -> dict[str, float]:
    """In a fresh process: RSS growth over the first ``steps`` steps, then the tensor peak of ``steps`` more."""
    step, opt = build(name, batch, optimizer, observe_steps=0)  # no step before the baseline
    baseline = _status_mb("VmRSS")
    for _ in range(steps):
        step()
    rss = _status_mb("VmHWM") - baseline
    return {"rss_mb": rss, "tensor_mb": _tensor_peak_mb(step, opt, steps)}


def run_memory(
    batch: int = 256, optimizer: str = "adam", steps: int = 5, repeats: int = 3, system_allocator: bool = False
) -> dict[str, dict[str, float]]:
    """{contender: {"tensor_mb", "rss_mb"}}: medians over ``repeats`` fresh processes per contender (the processes
    of one repeat run side by side: they share no memory, and their CPU time does not enter what they measure)."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    for _ in range(repeats):
        procs = {}
        for name in CONTENDERS:
            cmd = [sys.executable, __file__, "--memory-child", name, "--batch", str(batch), "--optimizer", optimizer,
                   "--memory-steps", str(steps)] + (["--system-allocator"] if system_allocator else [])  # fmt: skip
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, proc in procs.items():
            stdout, stderr = proc.communicate()
            lines = [ln for ln in stdout.splitlines() if ln.startswith(_MARK)]
            if proc.returncode or not lines:
                raise RuntimeError(f"memory child for {name!r} failed (rc {proc.returncode}):\n{stderr[-2000:]}")
            samples[name].append(json.loads(lines[-1].removeprefix(_MARK)))
    return {name: {k: statistics.median(s[k] for s in v) for k in v[0]} for name, v in samples.items()}


# ----------------------------------------------------------------------------------------------- profile
def profile(batch: int = 256, optimizer: str = "adam", steps: int = 20, top: int = 12) -> None:
    """Top ops by self CPU time of every contender (torch.profiler, after warm-up). Contenders run one after the
    other here, so compare shares of a step and calls per step across them rather than milliseconds."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name in CONTENDERS:
        step, _ = build(name, batch, optimizer)
        for _ in range(5):
            step()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        averages = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in averages)
        rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        print(f"\n## {name}: top ops by self CPU time ({total / steps / 1e3:.2f} ms per step under the profiler)")
        print("| op | % of step | self ms / step | calls / step |")
        print("|---|---|---|---|")
        for e in rows:
            share = 100 * e.self_cpu_time_total / total
            print(f"| {e.key} | {share:.1f} | {e.self_cpu_time_total / steps / 1e3:.3f} | {e.count / steps:g} |")


# ----------------------------------------------------------------------------------------------- report
def _report(times: dict[str, list[float]], memory: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    rel = ratios(times)
    fp32_m, fp32_r = memory[FP32]["tensor_mb"], memory[FP32]["rss_mb"]
    print(
        f"# QAT step on DigitsCNN, batch {args.batch}x1x8x8, {args.optimizer}; time: {args.rounds} interleaved rounds "
        f"of {args.steps} steps, x FP32 = median of per-round ratios (quartiles in brackets); memory: "
        f"{args.memory_steps} steps, median of {args.memory_repeats} fresh process(es)"
    )
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| contender | step ms | x FP32 | peak MB | x FP32 memory | RSS MB | x FP32 RSS | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CONTENDERS:
        (q1, ratio, q3), t = rel[name], statistics.median(times[name])
        m, r = memory[name]["tensor_mb"], memory[name]["rss_mb"]
        mem_ratio = m / fp32_m
        goal = ""
        if name in PEER:
            peer = rel[PEER[name]][1]
            time_ok = ratio <= TIME_GOAL and ratio <= peer
            goal = (
                f"time <= {TIME_GOAL}x and <= {PEER[name]} ({peer:.2f}x): {'met' if time_ok else 'MISSED'}; "
                f"memory <= {MEMORY_GOAL}x: {'met' if mem_ratio <= MEMORY_GOAL else 'MISSED'}"
            )
        print(
            f"| {name} | {t:.2f} | {ratio:.2f} ({q1:.2f}-{q3:.2f}) | {m:.1f} | {mem_ratio:.2f} | {r:.1f} | "
            f"{r / fp32_r:.2f} | {goal} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system-allocator", action="store_true",
        help="leave glibc's allocator as it is (default: keep_freed_memory(), as train.py does)",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a short run: 5 rounds of 2 steps, 1 memory process each")
    parser.add_argument("--profile", action="store_true", help="also print the top ops of every contender")
    parser.add_argument("--memory-child", metavar="CONTENDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kept = not args.system_allocator and keep_freed_memory()
    print(f"# CPU allocator: {'freed memory kept (keep_freed_memory)' if kept else 'system default'}")
    if args.memory_child:
        res = memory_child(args.memory_child, args.batch, args.optimizer, args.memory_steps)
        print(_MARK + json.dumps(res), flush=True)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup, args.memory_steps, args.memory_repeats = 5, 2, 2, 3, 1
    t0 = time.perf_counter()
    memory = run_memory(args.batch, args.optimizer, args.memory_steps, args.memory_repeats, args.system_allocator)
    times = run(args.batch, args.optimizer, args.rounds, args.steps, args.warmup)
    _report(times, memory, args)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.profile:
        profile(args.batch, args.optimizer)


if __name__ == "__main__":
    main()
