"""QAT training-step overhead: time and peak memory of a step, as ratios to FP32 and to torch.ao.

A step: ``zero_grad`` -> forward -> cross-entropy -> backward -> ``optimizer.step`` (Adam by default) on one batch
of random inputs through the ``--model``: ``cnn`` (``quark_lightning.tasks.digits.DigitsCNN``, 1x8x8 images, batch 256), ``mlp``
(1024 -> ``--width`` -> 1024 -> 10, batch 32) or ``llama`` (a LLaMA-style decoder block, hidden 1024, 4 sequences
of 64 tokens). The transformer-shaped models also have fp8 W8A8 and MXFP4/MXFP8 contenders (``CONTENDERS``);
``--widths`` sweeps the MLP's width and plots the ratios. Contenders, each on its own copy of the same initial model
with its own optimizer:

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
    python bench/qat_overhead.py --model mlp --memory-repeats 1
    python bench/qat_overhead.py --model llama --quick
    python bench/qat_overhead.py --widths 256,512,1024,2048,4096 --rounds 11 --plot docs/qat_overhead_width.png
    python bench/qat_overhead.py --device cuda --widths 1024,4096 --no-memory   # on a GPU (spans synchronised)
    python bench/qat_overhead.py --device cuda --check-syncs   # host syncs per steady step of every contender

On CUDA the memory figures are ``torch.cuda.max_memory_allocated`` over the steps (no RSS), the report names the
GPU and its measured copy bandwidth (``bench/device.py``), and the floor contender (FP32 plus one pass per weight
each way) is the step's memory-bandwidth limit measured on the device.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao import quantization as tq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ``bench`` itself, run as a script from anywhere

from bench import as_a_long_run
from bench.device import copy_bandwidth, describe, parse_device, sync
from quark.torch import ModelQuantizer
from quark.torch.cpu_allocator import keep_freed_memory
from quark.torch.quantization.formats import Backend
from quark.torch.quantization.formats.kernel_cache import DIRECT_AFTER_CALLS
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.digits import DigitsCNN
from quark_lightning.tasks.recipes import FP8_PER_TENSOR, INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT, MXFP4

_TQT = {"method": "tqt", "threshold_init_meth": "_3SD"}
_POF2 = {"symmetric": True, "is_dynamic": False, "round_method": "half_even", "scale_type": "pof2", "qat_spec": _TQT}
W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
W4A8_TQT = {
    "global_quant_config": {
        "weight": {"dtype": "int4", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", **_POF2},
        "input_tensors": {"dtype": "int8", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", **_POF2},
    }
}

FP8_W8A8 = {"global_quant_config": {"weight": FP8_PER_TENSOR, "input_tensors": FP8_PER_TENSOR}}
MXFP8 = {**MXFP4, "mx_element_dtype": "fp8_e4m3"}
MX_W4A8 = {"global_quant_config": {"weight": MXFP4, "input_tensors": MXFP8}}

FP32 = "fp32"
OURS_ON, OURS_OFF, OURS_TQT = "ours W8A8, observers on", "ours W8A8, observers off", "ours W4A8 TQT"
FP8_ON, FP8_OFF = "ours fp8 W8A8, observers on", "ours fp8 W8A8, observers off"
MX = "ours MXFP4 weights / MXFP8 activations"
AO_ON, AO_OFF = "torch.ao, observers on", "torch.ao, observers off"
#: contenders per model: the CNN keeps the TQT row; the transformer-shaped models add fp8 and MX
CONTENDERS = {
    "cnn": (FP32, OURS_ON, OURS_OFF, OURS_TQT, AO_ON, AO_OFF),
    "mlp": (FP32, OURS_ON, OURS_OFF, FP8_ON, FP8_OFF, MX, AO_ON, AO_OFF),
    "llama": (FP32, OURS_ON, OURS_OFF, FP8_ON, FP8_OFF, MX, AO_ON, AO_OFF),
}
CONFIGS = {OURS_ON: W8A8, OURS_OFF: W8A8, OURS_TQT: W4A8_TQT, FP8_ON: FP8_W8A8, FP8_OFF: FP8_W8A8, MX: MX_W4A8}
OBSERVERS_OFF = (OURS_OFF, FP8_OFF, AO_OFF)
#: our contender -> (its time goal over FP32, the torch.ao contender whose ratio it must not exceed, or None)
GOALS = {
    OURS_ON: (1.5, AO_ON),
    OURS_OFF: (1.5, AO_OFF),
    OURS_TQT: (1.5, AO_ON),
    FP8_ON: (1.5, None),
    FP8_OFF: (1.5, None),
    MX: (2.0, None),
}
MEMORY_GOAL = 1.3
DEFAULT_BATCH = {"cnn": 256, "mlp": 32, "llama": 4}


class MLP(nn.Module):
    """The transformer-shaped MLP of the issue: d -> width -> d -> 10 with GELU (weights dominate at batch 32)."""

    def __init__(self, width: int = 4096, d: int = 1024) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d, width), nn.Linear(width, d), nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class FloorLinear(nn.Module):
    """``nn.Linear`` with the memory traffic of a fake quantizer's forward and backward passes and nothing else: its
    weight times a per-row vector of ones (forward: read W, write a W-sized tensor; backward: read the gradient, write
    one) and its input times a scalar one, the same values as float, all torch's C++ ``mul`` and ``MulBackward``. A
    straight-through quantizer also reads W in its backward (the clipping mask), unless it skips the backward where
    nothing clips (ours, observing)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("w_ones", torch.ones(linear.weight.shape[0], 1, device=linear.weight.device))
        self.register_buffer("x_one", torch.ones((), device=linear.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.x_one, self.weight * self.w_ones, self.bias)


class ClampLinear(nn.Module):
    """``nn.Linear`` with its weight and input through torch's ``clamp`` to the float32 range (the same values): the
    cheapest straight-through quantizer PyTorch's own C++ ops give (``ClampBackward`` masks the gradient by the
    input, as a fake quantizer's clipping mask), with a real one's memory traffic and no rounding."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.limit = torch.finfo(torch.float32).max

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.clamp(-self.limit, self.limit), self.weight.clamp(-self.limit, self.limit), self.bias)


#: the bounds fitted beside the quantized models (``bounded``): the floor no fake quantizer reaches, and PyTorch's own
#: C++ straight-through ops at a fake quantizer's memory traffic
FLOOR_BOUND = "floor"
BOUND_LAYERS: dict[str, type[nn.Module]] = {FLOOR_BOUND: FloorLinear, "torch clamp": ClampLinear}


def bounded(model: nn.Module, bound: str) -> nn.Module:
    """``model`` (in place) with every ``nn.Linear`` wrapped as ``BOUND_LAYERS[bound]``."""
    wrap = BOUND_LAYERS[bound]
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, wrap(child))
        else:
            bounded(child, bound)
    return model


class LlamaBlock(nn.Module):
    """One LLaMA-style decoder block, written as users write it: RMSNorm -> causal self-attention (q/k/v/o
    projections, scaled_dot_product_attention) -> residual -> RMSNorm -> SwiGLU MLP (gate/up/down) -> residual, then
    a 10-class head on the mean over tokens."""

    def __init__(self, hidden: int = 1024, heads: int = 16, intermediate: int = 2816) -> None:
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o_proj(attn)
        h = self.post_attention_layernorm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.head(x.mean(dim=1))


def make_model(kind: str, width: int = 4096) -> nn.Module:
    """The model of ``--model``: the digits CNN, the MLP (``width`` its hidden size) or the LLaMA-style block."""
    if kind == "cnn":
        return DigitsCNN()
    if kind == "mlp":
        return MLP(width)
    if kind == "llama":
        return LlamaBlock()
    raise ValueError(f"--model {kind!r}: allowed cnn, mlp, llama")


def make_batch(kind: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of the model's shape (images, feature vectors, or 64 tokens of 1024-wide embeddings) and labels."""
    shape = {"cnn": (batch, 1, 8, 8), "mlp": (batch, 1024), "llama": (batch, 64, 1024)}[kind]
    return torch.rand(*shape), torch.randint(0, 10, (batch,))


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


def qat_step(
    base: nn.Module, config: dict | None, batch: tuple[torch.Tensor, torch.Tensor], observe: bool
) -> Callable[[], None]:
    """A bare training step (Adam, cross-entropy) of a copy of ``base``, quantized with ``config`` (None: FP32),
    calibrated on ``batch``, its observers then on (every step observes) or off (fixed qparams)."""
    x, y = batch
    model = copy.deepcopy(base).train()
    if config is not None:
        model = ModelQuantizer(config).prepare(model)
        with torch.no_grad():
            model(x)
        _set_observers(model, observe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def median_step_time(step: Callable[[], None], steps: int) -> float:
    """The median of ``steps`` timed calls of ``step``, in seconds."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternate(runs: dict[str, Callable[[int], float]], rounds: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each contender's median step time per round: ``runs[name](n)`` times ``n`` steps of it (in its own mode); all
    warm up first, then every round runs every contender, the order reversed every other round."""
    for run_steps in runs.values():
        run_steps(warmup)
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name].append(runs[name](steps))
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of contender ``a``'s step over ``b``'s in the same round."""
    return statistics.median(p / q for p, q in zip(times[a], times[b], strict=True))


def _quantized_model(name: str, base: nn.Module) -> nn.Module:
    model = copy.deepcopy(base).train()
    if name in CONFIGS:
        return ModelQuantizer(CONFIGS[name]).prepare(model)
    if name in (AO_ON, AO_OFF):
        wrapped = _AOWrapper(model).train()
        wrapped.qconfig = tq.get_default_qat_qconfig("x86")
        with warnings.catch_warnings():  # torch.ao's deprecation notice and reduce_range advice
            warnings.simplefilter("ignore")
            return tq.prepare_qat(wrapped, inplace=True)
    return model


FLOOR = "FP32 + one pass per weight each way (floor)"


def _floor_step(model: nn.Module, step: Callable[[], None]) -> Callable[[], None]:
    """FP32's step plus the memory traffic weight fake quantization cannot avoid, per Linear / Conv weight: forward
    one pass that reads W and writes a W-sized tensor (a copy), backward one that reads the gradient and W and writes
    a gradient-sized tensor (a product): what QAT would cost with every other overhead gone."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)]

    def floor_step() -> None:
        step()
        for w in weights:
            w.detach().clone()
            torch.mul(w.grad, w.detach())

    return floor_step


def build(
    name: str,
    batch: int = 256,
    optimizer: str = "adam",
    observe_steps: int = 3,
    seed: int = 0,
    kind: str = "cnn",
    width: int = 4096,
    device: str = "cpu",
) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """The training step of one contender (and its optimizer), ready to run.

    Every contender sees one forward of the batch first (observers on, no_grad): it sets our qparams, the TQT
    thresholds and torch.ao's scales as a calibration batch would. "observers off" contenders then run
    ``observe_steps`` training steps with observers on (QAT warm-up) and switch their observers off.
    """
    torch.manual_seed(seed)
    base = make_model(kind, width)
    x, y = (t.to(device) for t in make_batch(kind, batch))
    model = _quantized_model(name, base).to(device)
    params = list(model.parameters())  # TQT adds the log2 thresholds
    opt = torch.optim.Adam(params, lr=1e-3) if optimizer == "adam" else torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    if name == FLOOR:
        step = _floor_step(model, step)
    with torch.no_grad():
        model(x)
    if name in OBSERVERS_OFF:
        for _ in range(observe_steps):
            step()
        if name == AO_OFF:
            model.apply(tq.disable_observer)
        else:
            _set_observers(model, False)
    return step, opt


@dataclass(frozen=True)
class Setup:
    """What every contender of one run trains: the model kind (and the MLP's width), batch and optimizer."""

    kind: str = "cnn"
    batch: int = 256
    optimizer: str = "adam"
    width: int = 4096
    device: str = "cpu"

    @property
    def contenders(self) -> tuple[str, ...]:
        return CONTENDERS[self.kind]

    def build(self, name: str, observe_steps: int = 3) -> tuple[Callable[[], None], torch.optim.Optimizer]:
        return build(
            name, self.batch, self.optimizer, observe_steps, kind=self.kind, width=self.width, device=self.device
        )

    def describe(self) -> str:
        model = {
            "cnn": f"DigitsCNN, batch {self.batch}x1x8x8",
            "mlp": f"MLP 1024 -> {self.width} -> 1024 -> 10, batch {self.batch}",
            "llama": f"LLaMA-style block (hidden 1024, 16 heads, MLP 2816), batch {self.batch}x64 tokens",
        }[self.kind]
        return f"{model}, {self.optimizer}, on {describe(torch.device(self.device))}"


def run(
    setup: Setup, rounds: int = 21, steps: int = 5, warmup: int = 5, names: Sequence[str] | None = None
) -> dict[str, list[float]]:
    """Per-round ms per step of every contender: all contenders in every round, in an order rotated each round.
    Warm-up steps come first (they include the one-time compile of the format kernels)."""
    fns = {name: setup.build(name)[0] for name in (names or setup.contenders)}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    device = torch.device(setup.device)
    order = list(fns)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            fn = fns[name]
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            sync(device)
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
    device = next(p.device for group in opt.param_groups for p in group["params"])
    if device.type == "cuda":  # the caching allocator counts its own peak
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak / 2**20


def memory_child(name: str, setup: Setup, steps: int) -> dict[str, float]:
    """In a fresh process: RSS growth over the first ``steps`` steps, then the tensor peak of ``steps`` more."""
    step, opt = setup.build(name, observe_steps=0)  # no step before the baseline
    for _ in range(2):  # compile the format kernels (one-time, cached) before the baseline: not a per-step cost
        step()
    opt.zero_grad(set_to_none=True)
    baseline = _status_mb("VmRSS")
    for _ in range(steps):
        step()
    sync(torch.device(setup.device))
    rss = _status_mb("VmHWM") - baseline if setup.device == "cpu" else float("nan")  # (host memory: not the GPU's)
    return {"rss_mb": rss, "tensor_mb": _tensor_peak_mb(step, opt, steps)}


def _setup_args(setup: Setup) -> list[str]:
    return [
        "--model",
        setup.kind,
        "--batch",
        str(setup.batch),
        "--optimizer",
        setup.optimizer,
        "--width",
        str(setup.width),
        "--device",
        setup.device,
    ]


def run_memory(
    setup: Setup, steps: int = 5, repeats: int = 3, system_allocator: bool = False, parallel: bool = True
) -> dict[str, dict[str, float]]:
    """{contender: {"tensor_mb", "rss_mb"}}: medians over ``repeats`` fresh processes per contender (with
    ``parallel``, the processes of one repeat run side by side: they share no memory, and their CPU time does not
    enter what they measure)."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in setup.contenders}
    for _ in range(repeats):
        procs = {}
        for name in setup.contenders:
            cmd = [sys.executable, __file__, "--memory-child", name, *_setup_args(setup), "--memory-steps", str(steps)]
            cmd += ["--system-allocator"] if system_allocator else []
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if not parallel:
                procs[name].wait()
        for name, proc in procs.items():
            stdout, stderr = proc.communicate()
            lines = [ln for ln in stdout.splitlines() if ln.startswith(_MARK)]
            if proc.returncode or not lines:
                raise RuntimeError(f"memory child for {name!r} failed (rc {proc.returncode}):\n{stderr[-2000:]}")
            samples[name].append(json.loads(lines[-1].removeprefix(_MARK)))
    return {name: {k: statistics.median(s[k] for s in v) for k in v[0]} for name, v in samples.items()}


# ----------------------------------------------------------------------------------------------- host syncs
def count_syncs(setup: Setup, steps: int = 3, warmup: int = 5) -> dict[str, float]:
    """Host syncs per steady step of every contender on CUDA, counted from the warnings of
    ``torch.cuda.set_sync_debug_mode("warn")`` (each ``.item()``, ``bool(tensor)``, ``nonzero`` ... that waits for
    the GPU) after ``warmup`` steps."""
    out = {}
    for name in setup.contenders:
        step, _ = setup.build(name)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = sum("synchroniz" in str(w.message) for w in caught) / steps
    return out


# ----------------------------------------------------------------------------------------------- profile
def profile(setup: Setup, steps: int = 20, top: int = 12) -> None:
    """Top ops by self CPU time of every contender (torch.profiler, after warm-up). Contenders run one after the
    other here, so compare shares of a step and calls per step across them rather than milliseconds."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name in setup.contenders:
        step, _ = setup.build(name)
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
def _goal(name: str, rel: dict[str, tuple[float, float, float]], mem_ratio: float | None) -> str:
    if name not in GOALS:
        return ""
    limit, peer = GOALS[name]
    ratio = rel[name][1]
    time_ok = ratio <= limit and (peer is None or peer not in rel or ratio <= rel[peer][1])
    text = f"time <= {limit}x" + (f" and <= {peer} ({rel[peer][1]:.2f}x)" if peer in rel else "")
    text += f": {'met' if time_ok else 'MISSED'}"
    if mem_ratio is not None:
        text += f"; memory <= {MEMORY_GOAL}x: {'met' if mem_ratio <= MEMORY_GOAL else 'MISSED'}"
    return text


def _report(
    times: dict[str, list[float]], memory: dict[str, dict[str, float]] | None, args: argparse.Namespace, setup: Setup
) -> None:
    rel = ratios(times)
    print(
        f"# QAT step on {setup.describe()}; time: {args.rounds} interleaved rounds of {args.steps} steps, x FP32 = "
        "median of per-round ratios (quartiles in brackets)"
        + (f"; memory: {args.memory_steps} steps, median of {args.memory_repeats} fresh process(es)" if memory else "")
    )
    print(f"# {torch.get_num_threads()} CPU threads, format kernels: {_backend_name()}; {_bandwidth(setup)}")
    print("| contender | step ms | x FP32 | peak MB | x FP32 memory | RSS MB | x FP32 RSS | goal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in times:
        (q1, ratio, q3), t = rel[name], statistics.median(times[name])
        mem_cols, mem_ratio = "| | | | ", None
        if memory:
            m, r = memory[name]["tensor_mb"], memory[name]["rss_mb"]
            mem_ratio = m / memory[FP32]["tensor_mb"]
            fp32_rss = memory[FP32]["rss_mb"]
            rss_ratio = f"{r / fp32_rss:.2f}" if fp32_rss >= 1 else "-"  # below 1 MB (or NaN on CUDA): noise
            mem_cols = f"| {m:.1f} | {mem_ratio:.2f} | {r:.1f} | {rss_ratio} "
        print(f"| {name} | {t:.2f} | {ratio:.2f} ({q1:.2f}-{q3:.2f}) {mem_cols}| {_goal(name, rel, mem_ratio)} |")


def _weights_mb(kind: str, width: int) -> float:
    """MB one read + write of the model's float32 weights moves."""
    return 2 * 4 * sum(m.weight.numel() for m in make_model(kind, width).modules() if hasattr(m, "weight")) / 1e6


def _bandwidth(setup: Setup, widths: Sequence[int] = ()) -> str:
    """The device's measured copy bandwidth, and what one read + write of the model's weights costs at it (at each
    of ``widths``, the MLP's, else at the setup's)."""
    gbs = copy_bandwidth(torch.device(setup.device))
    passes = ", ".join(
        f"{_weights_mb(setup.kind, w):.0f} MB {_weights_mb(setup.kind, w) / gbs:.3f} ms"
        + (f" at {w}" if widths else "")
        for w in widths or (setup.width,)
    )
    return f"copy bandwidth {gbs:.0f} GB/s; one read + write of the weights: {passes}"


def _backend_name() -> str:
    if Backend.compile is False:
        return "eager"
    if Backend.failure:
        return f"eager (compile failed: {Backend.failure})"
    if Backend.compile:
        return "compiled"
    return f"auto (compiled for tensors >= {Backend.min_numel} elements, after {Backend.warmup_numel} warm-up elements)"


# ----------------------------------------------------------------------------------------------- width sweep
#: the sweep's contenders, and its columns: each format with observers on, off, and half the steps each (the QAT
#: protocol of issue 38: observers on for the warm-up half of training)
SWEEP = (OURS_ON, OURS_OFF, FP8_ON, FP8_OFF, MX, AO_ON, FLOOR)
HALF = {"int8 W8A8": (OURS_ON, OURS_OFF), "fp8 W8A8": (FP8_ON, FP8_OFF)}
COLUMNS = ("int8 on", "int8 off", "int8 half", "fp8 on", "fp8 off", "fp8 half", "MX", "torch.ao on", "floor")


def _sweep_row(times: dict[str, list[float]]) -> dict[str, float]:
    """One width's ratios over FP32 (medians of per-round ratios): on, off and their mean per round (half)."""

    def med(per_round: list[float]) -> float:
        return statistics.median(t / r for t, r in zip(per_round, times[FP32], strict=True))

    halves = {
        name: [(a + b) / 2 for a, b in zip(times[on], times[off], strict=True)] for name, (on, off) in HALF.items()
    }
    return {
        "int8 on": med(times[OURS_ON]),
        "int8 off": med(times[OURS_OFF]),
        "int8 half": med(halves["int8 W8A8"]),
        "fp8 on": med(times[FP8_ON]),
        "fp8 off": med(times[FP8_OFF]),
        "fp8 half": med(halves["fp8 W8A8"]),
        "MX": med(times[MX]),
        "torch.ao on": med(times[AO_ON]),
        "floor": med(times[FLOOR]),
        "fp32 ms": statistics.median(times[FP32]),
    }


def sweep(widths: Sequence[int], args: argparse.Namespace, plot: str | None) -> None:
    """Step-time ratio over FP32 of the MLP at each hidden width, every format with observers on, off and half the
    steps each, torch.ao (observers on) and the memory-traffic floor; a markdown table, and a PNG plot of the
    half-and-half ratios when ``plot`` names a file (needs matplotlib)."""
    table: dict[int, dict[str, float]] = {}
    for width in widths:
        setup = Setup("mlp", args.batch or DEFAULT_BATCH["mlp"], args.optimizer, width, args.device)
        table[width] = _sweep_row(run(setup, args.rounds, args.steps, args.warmup, names=(FP32, *SWEEP)))
        print(f"# width {width}: " + ", ".join(f"{n} {v:.2f}" for n, v in table[width].items()), flush=True)
    print(
        f"\n# QAT step time over FP32, MLP 1024 -> width -> 1024 -> 10, batch {args.batch or DEFAULT_BATCH['mlp']}, "
        f"{args.optimizer}, format kernels: {_backend_name()}; half = observers on for half the steps; floor = {FLOOR}"
    )
    print(f"# {describe(torch.device(args.device))}; {_bandwidth(Setup('mlp', device=args.device), widths)}")
    print("| width | FP32 ms | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for width, row in table.items():
        print(f"| {width} | {row['fp32 ms']:.1f} | " + " | ".join(f"{row[n]:.2f}" for n in COLUMNS) + " |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for name in ("int8 half", "fp8 half", "MX", "torch.ao on", "floor"):
            ax.plot(list(table), [table[w][name] for w in table], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(table), [str(w) for w in table])
        ax.set_xlabel("MLP hidden width (1024 -> width -> 1024)")
        ax.set_ylabel("QAT step time / FP32 step time")
        ax.set_title(
            f"QAT overhead vs width, batch {args.batch or DEFAULT_BATCH['mlp']}, {torch.get_num_threads()} CPU threads"
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"(plot: {plot})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system-allocator",
        action="store_true",
        help="leave glibc's allocator as it is (default: keep_freed_memory(), as train.py does)",
    )
    parser.add_argument("--model", choices=("cnn", "mlp", "llama"), default="cnn")
    parser.add_argument("--width", type=int, default=4096, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=None, help="default: 256 (cnn), 32 (mlp), 4 sequences (llama)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (every timed span synchronised)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round")
    parser.add_argument(
        "--warmup",
        type=int,
        default=(DIRECT_AFTER_CALLS or 0) + 10,
        help="untimed steps per contender first: kernels compiled and, past DIRECT_AFTER_CALLS calls of a signature, "
        "served directly, as in the later steps of a long run",
    )
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true", help="time only")
    parser.add_argument("--widths", help="comma-separated MLP widths: the step-time ratio sweep instead of one run")
    parser.add_argument("--plot", help="with --widths: write the plot to this PNG")
    parser.add_argument("--quick", action="store_true", help="a short run: 5 rounds of 2 steps, 1 memory process each")
    parser.add_argument("--profile", action="store_true", help="also print the top ops of every contender")
    parser.add_argument(
        "--check-syncs",
        action="store_true",
        help="with --device cuda: only count the host syncs per steady step of every contender",
    )
    parser.add_argument("--memory-child", metavar="CONTENDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    kept = not args.system_allocator and keep_freed_memory()
    as_a_long_run()
    parse_device(args.device)  # refused before any work where this machine has no such device
    setup = Setup(args.model, args.batch or DEFAULT_BATCH[args.model], args.optimizer, args.width, args.device)
    if args.check_syncs:
        if not args.device.startswith("cuda"):
            parser.error("--check-syncs needs --device cuda (on the CPU: tests/callbacks/test_quant_host_syncs.py)")
        print(f"# host syncs per steady step, {setup.describe()}")
        for name, count in count_syncs(setup).items():
            print(f"| {name} | {count:g} |")
        return
    if args.memory_child:
        print(_MARK + json.dumps(memory_child(args.memory_child, setup, args.memory_steps)), flush=True)
        return
    print(f"# CPU allocator: {'freed memory kept (keep_freed_memory)' if kept else 'system default'}")
    if args.quick:
        args.rounds, args.steps, args.warmup, args.memory_steps, args.memory_repeats = 5, 2, 2, 3, 1
    t0 = time.perf_counter()
    if args.widths:
        sweep([int(w) for w in args.widths.split(",")], args, args.plot)
    else:
        # big models: one memory process at a time (8 side by side would not fit the cores or the compile workers)
        memory = (
            None
            if args.no_memory
            else run_memory(
                setup, args.memory_steps, args.memory_repeats, args.system_allocator, parallel=args.model == "cnn"
            )
        )
        times = run(setup, args.rounds, args.steps, args.warmup)
        _report(times, memory, args, setup)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.profile:
        profile(setup)


if __name__ == "__main__":
    main()
