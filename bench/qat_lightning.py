"""QAT step time over FP32 under ``Trainer.fit``, the way a user runs it: the MLP of ``qat_overhead.py`` (1024 ->
width -> 1024 -> 10, batch 32, Adam) in a LightningModule, FP32 against the same fit with ``QuantCallback(config,
mode="qat", observer_steps=steps // 2)``: observers on for the first half of the training batches, fixed after, the
protocol of issue 38.

A step is the time from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step and
every callback hook of the batch, the QuantCallback's included), taken by a timing callback. Each fit runs
``--steps`` batches; the first ``--skip`` batches of each half are left out (the switch of the observers). Before
the timed fits, every quantized contender runs one untimed fit of ``--warmup-steps`` batches, so the kernels are
compiled (or loaded) and, past ``kernel_cache.DIRECT_AFTER_CALLS`` calls of a signature, served directly, as they
are in the later steps of a long run. Fits alternate FP32 / int8 / fp8 / MX, ``--rounds`` times, in one process:
x FP32 is the median over rounds of (the contender's median step) / (FP32's median step in the same round), per half
and for the whole fit ("half": the mean of the two halves, the observers on for half the steps). The loggers,
checkpoints and progress bar are off, so Lightning's fixed cost per step is as small as it gets: the ratios are the
least favourable to QAT a fit gives.

    python bench/qat_lightning.py --widths 512,1024,4096
    python bench/qat_lightning.py --widths 1024 --rounds 3 --steps 60   # quicker
    python bench/qat_lightning.py --widths 512,1024,4096 --rounds 5 --graphs   # + int8 without direct kernels
    python bench/qat_lightning.py --widths 1024,4096 --accelerator gpu   # on a GPU: each step's span synchronised
    python bench/qat_lightning.py --widths 512,1024 --no-peers   # ours and the bounds
    python bench/qat_lightning.py --widths 512,1024 --no-peers --compile   # trainer.fit(torch.compile(module))

Bounds in the same rounds (``--no-bounds`` leaves them out), the same MLP, fit, optimizer and timing, every Linear
wrapped as ``qat_overhead.BOUND_LAYERS`` says (all in C++, no Python per layer, no rounding):

- ``floor``: the memory traffic of a fake quantizer's forward and backward passes and nothing else: each weight
  times a per-row vector of ones (forward: read W, write a W-sized tensor; backward: read the gradient, write one),
  each input times a scalar one. A straight-through quantizer also reads W in its backward (the clipping mask); only
  where nothing clips does ours skip that backward (an observing step, ``observe_quantize``), going under it.
- ``torch clamp``: the cheapest straight-through quantizer PyTorch's own ops give: each weight and input through
  ``clamp`` to the float32 range (``ClampBackward`` masks the gradient by the input): a real fake quantizer's
  memory traffic, less its arithmetic.

Peers in the same rounds (``--no-peers`` leaves them out), the same MLP, fit, optimizer and timing:

- ``torch fused``: QAT written by hand with PyTorch's own fused fake-quant kernels at fixed qparams
  (``torch.fake_quantize_per_channel_affine`` on each weight, ``torch.fake_quantize_per_tensor_affine`` on each
  Linear's input, int8, qparams from one float batch): no observer, no Python between the module and the kernel. Its
  steps all do what ours do with the observers off, so compare its ratio with the "off" columns.
- ``torch.ao``: ``torch.ao.quantization.prepare_qat`` (x86 qconfig, QuantStub / DeQuantStub), observers on for the
  first half of the batches and off (``disable_observer``) for the second, as ours.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import as_a_long_run  # noqa: E402
from bench.device import copy_bandwidth, describe, sync  # noqa: E402
from bench.qat_overhead import (  # noqa: E402
    BOUND_LAYERS,
    FLOOR_BOUND,
    FP8_W8A8,
    MLP,
    MX_W4A8,
    W8A8,
    _AOWrapper,
    bounded,
)
from callbacks import QuantCallback  # noqa: E402
from quark.torch.cpu_allocator import keep_freed_memory  # noqa: E402
from quark.torch.quantization.formats import kernel_cache  # noqa: E402
from quark.torch.quantization.formats.kernel_cache import DIRECT_AFTER_CALLS  # noqa: E402

CONTENDERS = {"fp32": None, "int8 W8A8": W8A8, "fp8 W8A8": FP8_W8A8, "MXFP4/MXFP8": MX_W4A8}
#: ``--graphs``: int8 with every kernel through its aot_compile graph (no direct kernels), in the same rounds
GRAPHS = "int8 W8A8, graphs"
#: the peers (module docstring): PyTorch's fused kernels at fixed qparams, and torch.ao's QAT
TORCH_FUSED, TORCH_AO = "torch fused", "torch.ao"
PEERS = (TORCH_FUSED, TORCH_AO)
#: the bounds in the same fits (module docstring, ``qat_overhead.BOUND_LAYERS``): ``--no-bounds`` leaves them out
BOUNDS = tuple(BOUND_LAYERS)


class TorchFusedLinear(nn.Module):
    """``nn.Linear`` with int8 fake quantization through PyTorch's fused kernels at fixed qparams: symmetric per
    output channel for the weight, per tensor for the input (scale = max |value| / 127.5, as our min-max observers
    give), both from ``calibration`` (this layer's input on a float batch)."""

    def __init__(self, linear: nn.Linear, calibration: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        w = linear.weight.detach()
        self.register_buffer("w_scale", (w.abs().amax(dim=1) / 127.5).clamp(min=1e-8))
        self.register_buffer("w_zero_point", torch.zeros(w.shape[0], dtype=torch.int32))
        self.register_buffer("x_scale", (calibration.abs().amax() / 127.5).clamp(min=1e-8).reshape(()))
        self.register_buffer("x_zero_point", torch.zeros((), dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = torch.fake_quantize_per_tensor_affine(x, self.x_scale, self.x_zero_point, -128, 127)
        wq = torch.fake_quantize_per_channel_affine(self.weight, self.w_scale, self.w_zero_point, 0, -128, 127)
        return F.linear(xq, wq, self.bias)


def torch_fused(model: MLP, batch: torch.Tensor) -> MLP:
    """``model`` with every Linear a ``TorchFusedLinear`` calibrated on ``batch``."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(model, name).register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0]))
        for name in ("fc1", "fc2", "head")
    ]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    for name, x in inputs.items():
        setattr(model, name, TorchFusedLinear(getattr(model, name), x))
    return model


def torch_ao(model: MLP) -> nn.Module:
    """``model`` prepared for torch.ao's eager QAT (x86 qconfig), observers on."""
    wrapped = _AOWrapper(model).train()
    wrapped.qconfig = tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(wrapped, inplace=True)


class _AOObserversOff(Callback):
    """torch.ao's observers off from batch ``at`` on (``disable_observer``), as ``observer_steps`` does for ours."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            pl_module.apply(tq.disable_observer)


class MLPModule(LightningModule):
    """The bench's MLP (or a peer's form of it: ``TORCH_FUSED``, ``TORCH_AO``), trained with Adam on cross-entropy."""

    def __init__(self, width: int, peer: str | None = None) -> None:
        super().__init__()
        model = MLP(width)
        if peer == TORCH_FUSED:
            model = torch_fused(model, torch.rand(32, 1024))
        elif peer in BOUNDS:
            model = bounded(model, peer)
        elif peer == TORCH_AO:
            model = torch_ao(model)
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class StepTimer(Callback):
    """Seconds per training batch, from ``on_train_batch_start`` to ``on_train_batch_end``: Lightning calls the
    callbacks' hooks in list order, so the timer's end goes last in the list and its ``start`` callback first, and
    every other callback's hooks of the batch fall inside."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0
        self.start = _StepStart(self)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sync(pl_module.device)  # on CUDA: the step's kernels done, not only launched
        self.times.append(time.perf_counter() - self._start)


class _StepStart(Callback):
    """The start of ``StepTimer``'s span (first in the callback list)."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        sync(pl_module.device)
        self.timer._start = time.perf_counter()


#: ``--accelerator``: where the fits run (Lightning's name: cpu, gpu); ``--compile``: every module under torch.compile
ACCELERATOR = {"name": "cpu"}
COMPILE = {"on": False}


def fit(width: int, config: dict[str, Any] | None, steps: int, seed: int = 0, peer: str | None = None) -> list[float]:
    """Per-batch seconds of one fit of ``steps`` batches (FP32 when ``config`` and ``peer`` are None)."""
    torch.manual_seed(seed)
    module = MLPModule(width, peer)
    data = TensorDataset(torch.rand(steps * 32, 1024), torch.randint(0, 10, (steps * 32,)))
    timer = StepTimer()
    callbacks: list[Callback] = [timer.start, timer]  # the QuantCallback's batch hooks in between
    if config is not None:
        callbacks.insert(1, QuantCallback(config, mode="qat", observer_steps=steps // 2, save_quantized=False))
    if peer == TORCH_AO:
        callbacks.insert(1, _AOObserversOff(steps // 2))
    trainer = Trainer(
        max_steps=steps,
        accelerator=ACCELERATOR["name"],
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )
    if COMPILE["on"]:  # the user's own torch.compile of the module, FP32 and QAT alike, each fit compiled afresh
        torch._dynamo.reset()
        trainer.fit(torch.compile(module), DataLoader(data, batch_size=32, shuffle=True))
        return timer.times
    trainer.fit(module, DataLoader(data, batch_size=32, shuffle=True))
    return timer.times


def _halves(times: list[float], skip: int) -> tuple[float, float]:
    """Median step of the first half (observers on) and of the second (off), the first ``skip`` of each left out."""
    mid = len(times) // 2
    return statistics.median(times[skip:mid]), statistics.median(times[mid + skip :])


def _fit_as(name: str, config: dict[str, Any] | None, width: int, steps: int) -> list[float]:
    """``fit`` for contender ``name``: the ``GRAPHS`` contender's kernels take their graphs, not direct kernels."""
    if name in (*PEERS, *BOUNDS):
        return fit(width, None, steps, peer=name)
    if name != GRAPHS:
        return fit(width, config, steps)
    before = kernel_cache.DIRECT_AFTER_CALLS
    kernel_cache.DIRECT_AFTER_CALLS = None
    try:
        return fit(width, config, steps)
    finally:
        kernel_cache.DIRECT_AFTER_CALLS = before


def sweep(
    widths: list[int],
    rounds: int,
    steps: int,
    skip: int,
    warmup_steps: int,
    graphs: bool = False,
    peers: bool = True,
    bounds: bool = True,
) -> None:
    contenders: dict[str, dict[str, Any] | None] = {**CONTENDERS, GRAPHS: W8A8} if graphs else dict(CONTENDERS)
    if bounds:
        contenders.update(dict.fromkeys(BOUNDS))
    if peers:
        contenders.update(dict.fromkeys(PEERS))
    #: the contenders timed over the floor (``bounds``): every one but FP32 and the floor itself
    over = [n for n in contenders if n not in ("fp32", FLOOR_BOUND)]
    rows = []
    for width in widths:
        for config in CONTENDERS.values():
            if config is not None and warmup_steps:
                fit(width, config, warmup_steps)
        per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, config in contenders.items():
                per_round[name].append(_halves(_fit_as(name, config, width, steps), skip))
        fp32 = per_round["fp32"]
        row = {"width": width, "fp32 ms": 1e3 * statistics.median((a + b) / 2 for a, b in fp32)}
        for name in list(contenders)[1:]:
            on = [a / ((f + g) / 2) for (a, _), (f, g) in zip(per_round[name], fp32, strict=True)]
            off = [b / ((f + g) / 2) for (_, b), (f, g) in zip(per_round[name], fp32, strict=True)]
            row[f"{name} on"], row[f"{name} off"] = statistics.median(on), statistics.median(off)
            row[f"{name} half"] = statistics.median((a + b) / 2 for a, b in zip(on, off, strict=True))
        if bounds:  # each contender over the floor fitted in the same round, and the floor's own spread over FP32
            bound = [(a + b) / 2 for a, b in per_round[FLOOR_BOUND]]
            halves = [(f + g) / 2 for f, g in fp32]
            spread = [b / h for b, h in zip(bound, halves, strict=True)]
            row["floor range"] = (min(spread), max(spread))
            for name in over:
                mean = [(a + b) / 2 for a, b in per_round[name]]
                row[f"{name} x floor"] = statistics.median(m / b for m, b in zip(mean, bound, strict=True))
        rows.append(row)
        print("# " + ", ".join(f"{k} {_cell(v)}" for k, v in row.items()))
    names = list(contenders)[1:]
    print(
        f"\n# QAT step / FP32 step under Trainer.fit, MLP 1024 -> width -> 1024 -> 10, batch 32, Adam; {rounds} rounds "
        f"of {steps}-step fits, observers on for the first half (QuantCallback observer_steps={steps // 2}); "
        f"{torch.get_num_threads()} CPU threads"
    )
    device = torch.device("cuda" if ACCELERATOR["name"] == "gpu" else "cpu")
    compiled = "; every module under torch.compile" if COMPILE["on"] else ""
    print(f"# on {describe(device)}; copy bandwidth {copy_bandwidth(device):.0f} GB/s{compiled}")
    print("| width | FP32 ms | " + " | ".join(f"{n} on | {n} off | **{n} half**" for n in names) + " |")
    print("|---|---|" + "---|---|---|" * len(names))
    for row in rows:
        cells = " | ".join(f"{row[f'{n} on']:.2f} | {row[f'{n} off']:.2f} | **{row[f'{n} half']:.2f}**" for n in names)
        print(f"| {row['width']} | {row['fp32 ms']:.1f} | {cells} |")
    if bounds:
        print("\n# step time (both halves) over the floor's in the same round; the floor's own ratio to FP32 per round")
        print("| width | floor x FP32, lowest-highest round | " + " | ".join(f"{n} x floor" for n in over) + " |")
        print("|---|---|" + "---|" * len(over))
        for row in rows:
            low, high = row["floor range"]
            cells = " | ".join(f"{row[f'{n} x floor']:.2f}" for n in over)
            print(f"| {row['width']} | {low:.2f}-{high:.2f} | {cells} |")


def _cell(value: Any) -> str:
    """A row value for the progress line: floats to two places, a (low, high) pair as a range."""
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, tuple):
        return f"{value[0]:.2f}-{value[1]:.2f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="512,1024,4096", help="comma-separated MLP hidden widths")
    parser.add_argument("--rounds", type=int, default=5, help="fits per contender per width")
    parser.add_argument("--steps", type=int, default=80, help="training batches per fit (observers on for half)")
    parser.add_argument("--skip", type=int, default=5, help="batches left out at the start of each half")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2 * (DIRECT_AFTER_CALLS or 0) + 20,
        help="batches of one untimed fit per quantized contender first (observers on for half of them)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help=f"also {GRAPHS!r}: int8 with direct kernels off in the same rounds (what they save)",
    )
    parser.add_argument(
        "--no-peers", action="store_true", help=f"leave out the peers {', '.join(PEERS)} (see the module docstring)"
    )
    parser.add_argument("--no-bounds", action="store_true", help=f"leave out the bounds {', '.join(BOUNDS)}")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="Lightning's accelerator")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="fit torch.compile(module) for every contender, FP32 included (the compile and the observer switch's "
        "recompile fall in the left-out first batches of each half)",
    )
    args = parser.parse_args()
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error(f"--accelerator gpu: torch {torch.__version__} sees no CUDA device here")
    ACCELERATOR["name"] = args.accelerator
    COMPILE["on"] = args.compile
    if args.steps < 2 * args.skip + 4:
        parser.error(f"--steps {args.steps} leaves too few batches after --skip {args.skip} in each half")
    keep_freed_memory()  # as train.py does
    # the timed fits stand for the steps of a long training run, whose kernels auto mode compiles; short as they are,
    # the run plan would keep each of them eager (too few elements left to pay a compile back)
    as_a_long_run()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("quark").setLevel(logging.WARNING)
    widths = [int(w) for w in args.widths.split(",")]
    sweep(
        widths,
        args.rounds,
        args.steps,
        args.skip,
        args.warmup_steps,
        args.graphs,
        not args.no_peers,
        not args.no_bounds,
    )


if __name__ == "__main__":
    main()
