"""Graph-mode quantization on Fashion-MNIST: our engine (eager and fx_graph_mode) against PyTorch's PT2E flow.

Two small networks from bench/models_graph.py (a ResNet with residual adds, a MobileNet-V2-style network with
depthwise convs and ReLU6) are trained in float on a seeded subset of the training images, then deep copies are
quantized and every row is scored on the 10,000 test images:

1. float
2. eager W8A8 PTQ                 our engine, module swapping (BatchNorm stays float, adds are not quantized)
3. graph W8A8 PTQ                 our engine, ``quant_mode=fx_graph_mode`` on the exported graph (BatchNorm folded)
4. graph W8A8 PTQ + CLE           the same with cross-layer equalization first
5. graph W8A8 TQT QAT             int8 weights and activations with power-of-two scales and learned TQT thresholds
                                  (Quark's "QAT A8W8" / "QAT TQT"), fine-tuned from the float weights: the
                                  like-for-like peer of row 8
6. graph W4A8 TQT QAT             the w4a8_tqt_graph preset: the same with int4 per-tensor weights
7. PT2E W8A8 PTQ                  torchao's ``prepare_pt2e`` / ``convert_pt2e`` with X86InductorQuantizer (or XNNPACK):
                                  int8 per-channel symmetric weights, static per-tensor activations
8. PT2E W8A8 QAT                  ``prepare_qat_pt2e``, fine-tuned with the same schedule as rows 5 and 6
9. PT2E W4A8 QAT                  the same quantizer with its weight range narrowed to int4 (-8..7, per channel,
                                  float scales): the like-for-like peer of row 6

W8A8 (ours) is the w8a8 preset: int8 per-channel symmetric weights, int8 per-tensor symmetric static activations; the
quantizer specs are read from conf/quant/spec/*.yaml, so the rows follow the presets. All PTQ rows calibrate on the same
batches; all QAT rows start from the float weights and run the same optimizer, learning rate and epochs, with the
BatchNorm statistics frozen in the last epoch. Our TQT thresholds train with the weights unless ``--quantizer-lr``
gives them a rate of their own (through the callback's group split); PT2E's fake quantizers have no learned
parameters. QAT rows run ``--qat-seeds`` times (data order and initialisation
seeded differently each time) and show the mean and standard deviation: single QAT runs on this data differ by a few
tenths of a point from seed to seed, the size of the differences being compared. A row that cannot run shows
"n/a (reason)".

    .venv/bin/python -m bench.graph_mode                       # defaults: about 20 minutes on 2 cores
    .venv/bin/python -m bench.graph_mode --epochs 8 --train-size 40000 --qat-epochs 2 --pt2e-quantizer xnnpack

PT2E comes from torchao (``pip install -e .[bench]``); it was removed from torch.ao.quantization.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from bench.models_graph import MODELS
from callbacks.quantizer_lr import follow_schedule, split_quantizer_groups
from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import CLEConfig, Config
from quark.torch.quantization.config.type import QuantizationMode
from quark.torch.quantization.nn.modules import iter_quantizers
from quark_lightning.tasks.fashion import load_fashion

SPEC_DIR = Path(__file__).resolve().parents[1] / "conf" / "quant" / "spec"
ROWS = (
    "float",
    "eager W8A8 PTQ",
    "graph W8A8 PTQ",
    "graph W8A8 PTQ + CLE",
    "graph W8A8 TQT QAT",
    "graph W4A8 TQT QAT",
    "PT2E W8A8 PTQ",
    "PT2E W8A8 QAT",
    "PT2E W4A8 QAT",
)
QAT_ROWS = ("graph W8A8 TQT QAT", "graph W4A8 TQT QAT", "PT2E W8A8 QAT", "PT2E W4A8 QAT")
Result = float | str  # accuracy in percent (a QAT row: the mean over seeds), or "n/a (reason)"
EvalFn = Callable[[int], Result]  # a row, given the seed of its (QAT) run


# ----------------------------------------------------------------------------------------------- data and training
@dataclass
class Data:
    train: Subset
    calib: list[tuple[torch.Tensor, torch.Tensor]]  # the same batches for every PTQ row
    test: TensorDataset
    example: torch.Tensor  # one batch of inputs, for torch.export


def load_data(train_size: int, calib_batches: int, calib_batch_size: int, seed: int) -> Data:
    train = load_fashion("train")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    subset = Subset(train, order[:train_size])
    calib = list(DataLoader(subset, batch_size=calib_batch_size))[:calib_batches]
    return Data(subset, calib, load_fashion("t10k"), calib[0][0])


def batches(data: Data, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled, full training batches (full: a graph exported with a fixed batch still runs)."""
    gen = torch.Generator().manual_seed(seed)
    yield from DataLoader(data.train, batch_size=batch_size, shuffle=True, drop_last=True, generator=gen)


def fit(
    model: nn.Module,
    data: Data,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    before_epoch: Callable[[int], None] | None = None,
    quantizer_lr: float | None = None,
) -> None:
    """Adam with a cosine schedule over all steps; ``model`` is expected in training mode. ``before_epoch(e)`` runs
    before each epoch (QAT: freeze BatchNorm statistics for the last one). The optimizer is built here, after any
    quantizer preparation, so learnable thresholds (TQT) are trained too; at ``quantizer_lr`` when given (their
    own group on the same schedule, as ``QuantCallback(quantizer_lr=...)`` does)."""
    torch.manual_seed(seed)
    steps = epochs * (len(data.train) // batch_size)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    learned = [p for _, q in iter_quantizers(model) for p in q.parameters()]  # TQT thresholds (observers: buffers)
    splits = split_quantizer_groups([opt], learned, quantizer_lr, [sched]) if quantizer_lr else []
    for epoch in range(epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        for x, y in batches(data, batch_size, seed + epoch):
            follow_schedule(splits, quantizer_lr)  # type: ignore[arg-type]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()


@torch.no_grad()
def accuracy(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], test: TensorDataset) -> float:
    """Top-1 accuracy (%) on the test split; ``model`` must already be in inference mode."""
    correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in DataLoader(test, batch_size=500))
    return 100.0 * correct / len(test)


def eval_float(model: nn.Module, data: Data) -> float:
    return accuracy(model.eval(), data.test)


# ----------------------------------------------------------------------------------------------- our engine
def spec(name: str) -> dict[str, Any]:
    """A quantizer spec of the Hydra presets (conf/quant/spec/<name>.yaml) as a dict."""
    return OmegaConf.to_container(OmegaConf.load(SPEC_DIR / f"{name}.yaml"))  # type: ignore[return-value]


def preset(name: str) -> dict[str, Any]:
    """The quantizer roles of a Hydra preset (conf/quant/<name>.yaml): its ``defaults`` list read as role -> spec."""
    entries = OmegaConf.to_container(OmegaConf.load(SPEC_DIR.parent / f"{name}.yaml"))["defaults"]  # type: ignore[index]
    return {role: spec(file) for entry in entries if isinstance(entry, dict) for role, file in entry.items() if file}


W8A8 = preset("int8_graph")  # the same roles as conf/quant/w8a8.yaml, which eager mode uses
W8A8_TQT = {"weight": spec("int8_tqt"), "input_tensors": spec("int8_tqt")}
W4A8_TQT = preset("w4a8_tqt_graph")


def quark_config(qconfig: dict[str, Any], graph: bool, cle_iterations: int = 0) -> Config:
    mode = QuantizationMode.fx_graph_mode if graph else QuantizationMode.eager_mode
    cle = [CLEConfig(iterations=cle_iterations)] if cle_iterations else None
    return Config(global_quant_config=qconfig, quant_mode=mode, pre_quant_opt_config=cle)  # type: ignore[arg-type]


def eager_ptq(model: nn.Module, data: Data) -> float:
    with warnings.catch_warnings():  # eager mode keeps BatchNorm float (and says so): stated in the docstring
        warnings.filterwarnings("ignore", ".*stay float.*")
        quantized = ModelQuantizer(quark_config(W8A8, graph=False)).quantize_model(model.eval(), data.calib)
    return accuracy(ModelQuantizer.freeze(quantized).eval(), data.test)


def capture(model: nn.Module, data: Data) -> torch.fx.GraphModule:
    from quark.torch.quantization.graph import capture as quark_capture

    return quark_capture(model.eval(), (data.example,))


def graph_ptq(model: nn.Module, data: Data, cle_iterations: int = 0) -> float:
    gm = capture(model, data)
    gm = ModelQuantizer(quark_config(W8A8, graph=True, cle_iterations=cle_iterations)).quantize_model(gm, data.calib)
    return accuracy(ModelQuantizer.freeze(gm).eval(), data.test)


def graph_qat(model: nn.Module, data: Data, args: argparse.Namespace, qconfig: dict[str, Any], seed: int) -> float:
    from quark.torch.quantization.graph import freeze_bn_stats

    gm = ModelQuantizer(quark_config(qconfig, graph=True)).prepare(capture(model, data))
    gm.train()

    def before_epoch(epoch: int) -> None:
        if epoch == freeze_epoch(args.qat_epochs):
            freeze_bn_stats(gm)

    fit(gm, data, args.qat_epochs, args.qat_lr, args.batch_size, seed, before_epoch, args.quantizer_lr)
    return accuracy(ModelQuantizer.freeze(gm).eval(), data.test)


def freeze_epoch(qat_epochs: int) -> int | None:
    """The QAT epoch from which BatchNorm statistics (and PT2E's observers) are frozen: the last one, when there
    are at least two (with one, the statistics have to adapt to quantization first)."""
    return qat_epochs - 1 if qat_epochs >= 2 else None


# ----------------------------------------------------------------------------------------------- PT2E (torchao)
def quiet_torchao() -> None:
    """torchao's CPU wheel logs a warning per CUDA kernel library it cannot load, torch one per Enum it registers."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def pt2e_quantizer(kind: str, is_qat: bool, weight_bits: int = 8) -> Any:
    """int8 per-channel symmetric weights, static per-tensor int8 activations (X86: uint8 affine, histogram
    observer for PTQ; XNNPACK: int8 affine, min-max). ``weight_bits=4`` narrows the weights' integer range to
    -8..7 (int8 storage), PT2E's way of simulating int4."""
    if kind == "x86":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        config = get_default_x86_inductor_quantization_config(is_qat=is_qat)
        quantizer = X86InductorQuantizer()
    else:
        from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "XNNPACKQuantizer is deprecated")
            config = get_symmetric_quantization_config(is_per_channel=True, is_qat=is_qat)
            quantizer = XNNPACKQuantizer()
    if weight_bits != 8:
        qmax = 2 ** (weight_bits - 1) - 1
        weight = dataclasses.replace(config.weight, quant_min=-qmax - 1, quant_max=qmax)
        config = dataclasses.replace(config, weight=weight)
    return quantizer.set_global(config)


def pt2e_export(model: nn.Module, data: Data) -> torch.fx.GraphModule:
    batch = torch.export.Dim("batch")
    return torch.export.export(model, (data.example,), dynamic_shapes=({0: batch},)).module()  # type: ignore[return-value]


def pt2e_ptq(model: nn.Module, data: Data, kind: str) -> float:
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    prepared = prepare_pt2e(pt2e_export(model.eval(), data), pt2e_quantizer(kind, is_qat=False))
    with torch.no_grad():
        for x, _ in data.calib:
            prepared(x)
    return accuracy(convert_pt2e(prepared), data.test)


def pt2e_freeze_bn_stats(gm: torch.fx.GraphModule) -> None:
    """BatchNorm on running statistics from now on (the ``training`` argument of the exported batch_norm ops)."""
    targets = (torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit.default)
    for node in gm.graph.nodes:
        if node.target in targets:
            args = list(node.args)
            args[5] = False  # input, weight, bias, running_mean, running_var, training, ...
            node.args = tuple(args)
    gm.recompile()


def pt2e_qat(model: nn.Module, data: Data, args: argparse.Namespace, seed: int, weight_bits: int = 8) -> float:
    from torchao.quantization.pt2e import disable_observer, move_exported_model_to_eval, move_exported_model_to_train
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    quantizer = pt2e_quantizer(args.pt2e_quantizer, is_qat=True, weight_bits=weight_bits)
    prepared = prepare_qat_pt2e(pt2e_export(model.train(), data), quantizer)
    move_exported_model_to_train(prepared)

    def before_epoch(epoch: int) -> None:
        if epoch == freeze_epoch(args.qat_epochs):  # as PyTorch's QAT tutorial: BatchNorm and observers fixed
            pt2e_freeze_bn_stats(prepared)
            prepared.apply(disable_observer)

    fit(prepared, data, args.qat_epochs, args.qat_lr, args.batch_size, seed, before_epoch)
    move_exported_model_to_eval(prepared)
    return accuracy(convert_pt2e(prepared), data.test)


# ----------------------------------------------------------------------------------------------- the table
def attempt(fn: EvalFn, seed: int) -> Result:
    """The row's accuracy for ``seed``, or "n/a (reason)" when it cannot run (engine feature missing, torchao
    absent...)."""
    try:
        return fn(seed)
    except Exception as e:  # noqa: BLE001 - a failed row is reported in the table, the others still run
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
        return f"n/a ({reason[:140]})"


def run_net(name: str, data: Data, args: argparse.Namespace) -> tuple[dict[str, Result], dict[str, float]]:
    """Train ``name`` in float, then every row on a deep copy of it (QAT rows once per QAT seed). Returns the
    accuracies (QAT rows: the mean over seeds) and, for the QAT rows, the standard deviation over seeds."""
    torch.manual_seed(args.seed)
    model = MODELS[name]()
    t0 = time.perf_counter()
    fit(model.train(), data, args.epochs, args.lr, args.batch_size, args.seed)
    print(f"[{name}] float training: {time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict[str, EvalFn] = {
        "float": lambda _: eval_float(copy.deepcopy(model), data),
        "eager W8A8 PTQ": lambda _: eager_ptq(copy.deepcopy(model), data),
        "graph W8A8 PTQ": lambda _: graph_ptq(copy.deepcopy(model), data),
        "graph W8A8 PTQ + CLE": lambda _: graph_ptq(copy.deepcopy(model), data, args.cle_iterations),
        "graph W8A8 TQT QAT": lambda seed: graph_qat(copy.deepcopy(model), data, args, W8A8_TQT, seed),
        "graph W4A8 TQT QAT": lambda seed: graph_qat(copy.deepcopy(model), data, args, W4A8_TQT, seed),
        "PT2E W8A8 PTQ": lambda _: pt2e_ptq(copy.deepcopy(model), data, args.pt2e_quantizer),
        "PT2E W8A8 QAT": lambda seed: pt2e_qat(copy.deepcopy(model), data, args, seed),
        "PT2E W4A8 QAT": lambda seed: pt2e_qat(copy.deepcopy(model), data, args, seed, weight_bits=4),
    }
    rows = {row: fn for row, fn in rows.items() if row in args.rows or row == "float"}
    results: dict[str, Result] = {}
    spread: dict[str, float] = {}
    for row, fn in rows.items():
        t0 = time.perf_counter()
        seeds = [args.seed + 1 + k for k in range(args.qat_seeds)] if row in QAT_ROWS else [args.seed]
        runs = [attempt(fn, seed) for seed in seeds]
        accs = [r for r in runs if isinstance(r, float)]
        if len(accs) < len(runs):
            results[row] = next(r for r in runs if not isinstance(r, float))
        else:
            results[row] = statistics.fmean(accs)
            if len(accs) > 1:
                spread[row] = statistics.stdev(accs)
        each = f" (runs: {', '.join(fmt(r) for r in runs)})" if len(runs) > 1 else ""
        print(f"[{name}] {row}: {fmt(results[row])}{each} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return results, spread


def fmt(value: Result) -> str:
    return f"{value:.2f}" if isinstance(value, float) else value


def print_table(results: dict[str, dict[str, Result]], spreads: dict[str, dict[str, float]]) -> None:
    nets = list(results)
    print("| row | " + " | ".join(f"{n} acc % | {n} vs float (points)" for n in nets) + " |")
    print("|---|" + "---|---|" * len(nets))
    for row in (r for r in ROWS if r in results[nets[0]]):
        cells = []
        for net in nets:
            acc, ref = results[net][row], results[net]["float"]
            sd = spreads[net].get(row)
            if isinstance(acc, float) and isinstance(ref, float):
                cells += [fmt(acc) + (f" ± {sd:.2f}" if sd is not None else ""), f"{acc - ref:+.2f}"]
            else:
                cells += [fmt(acc), ""]
        print(f"| {row} | " + " | ".join(cells) + " |")


def _ge(a: Result, b: Result, slack: float = 0.0) -> bool | None:
    return a >= b - slack if isinstance(a, float) and isinstance(b, float) else None


def _se(spread: dict[str, float], seeds: int, *rows: str) -> float | None:
    """Standard error of a difference of means over ``seeds`` runs (rows without a spread count as exact)."""
    parts = [spread[row] ** 2 / seeds for row in rows if row in spread]
    return sum(parts) ** 0.5 if parts else None


def _verdict(ok: bool | None, a: Result, b: Result, se: float | None) -> str:
    """met / MISSED / n/a, with the difference and, for rows run over seeds, its standard error (so that a miss by
    a few test images reads as what it is)."""
    if ok is None or not isinstance(a, float) or not isinstance(b, float):
        return "n/a"
    noise = f", standard error {se:.2f}" if se is not None else ""
    return f"{'met' if ok else 'MISSED'} (difference {a - b:+.2f} points{noise})"


def check_targets(results: dict[str, dict[str, Result]], spreads: dict[str, dict[str, float]], seeds: int) -> None:
    """The issue's targets, per network, on the means. Each QAT row is compared with float and with its
    like-for-like PT2E peer (W8A8 with W8A8, W4A8 with W4A8); rows left out with ``--rows`` read n/a."""
    for net, r in results.items():
        sd = spreads[net]

        best = max(
            ("graph W8A8 PTQ", "graph W8A8 PTQ + CLE"), key=lambda k: r.get(k) if isinstance(r.get(k), float) else -1.0
        )
        checks = [
            ("graph W8A8 PTQ within 0.5 points of float", "graph W8A8 PTQ", "float", 0.5),
            (f"graph PTQ (best of +/- CLE: {best}) >= PT2E PTQ", best, "PT2E W8A8 PTQ", 0.0),
        ]
        for row, peer in (("graph W8A8 TQT QAT", "PT2E W8A8 QAT"), ("graph W4A8 TQT QAT", "PT2E W4A8 QAT")):
            checks += [
                (f"{row} within 0.5 points of float", row, "float", 0.5),
                (f"{row} >= {peer}", row, peer, 0.0),
            ]
        for text, a, b, slack in checks:
            ra, rb = r.get(a, "n/a"), r.get(b, "n/a")
            print(f"[{net}] {text}: {_verdict(_ge(ra, rb, slack), ra, rb, _se(sd, seeds, a, b))}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--epochs", type=int, default=8, help="float training epochs")
    p.add_argument("--train-size", type=int, default=30000, help="training images (seeded subset of the 60,000)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="float training: Adam, cosine to 0")
    p.add_argument("--qat-epochs", type=int, default=2, help="QAT fine-tuning epochs (ours and PT2E)")
    p.add_argument("--qat-lr", type=float, default=5e-4, help="QAT fine-tuning: Adam, cosine to 0")
    p.add_argument("--qat-seeds", type=int, default=3, help="runs of each QAT row (seeds seed+1, seed+2, ...)")
    p.add_argument(
        "--quantizer-lr",
        type=float,
        default=OmegaConf.load(SPEC_DIR.parent / "w4a8_tqt_graph.yaml").get("quantizer_lr"),
        help="our QAT rows: learning rate of the TQT thresholds in a group of their own (default: the w4a8_tqt_graph "
        "preset's quantizer_lr, which is unset: the weights' group and rate)",
    )
    p.add_argument(
        "--calib-batches", type=int, default=8, help="calibration batches of 64 training images (all PTQ rows)"
    )
    p.add_argument("--cle-iterations", type=int, default=5)
    p.add_argument("--pt2e-quantizer", choices=["x86", "xnnpack"], default="x86")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="rows to run (float always runs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(2)
    quiet_torchao()
    t0 = time.perf_counter()
    data = load_data(args.train_size, args.calib_batches, 64, args.seed)
    runs = {name: run_net(name, data, args) for name in args.models}
    results = {name: r for name, (r, _) in runs.items()}
    spreads = {name: sd for name, (_, sd) in runs.items()}
    print()
    print_table(results, spreads)
    print()
    check_targets(results, spreads, args.qat_seeds)
    print(
        f"({time.perf_counter() - t0:.0f} s; Fashion-MNIST test split of {len(data.test)} images; float: {args.epochs} epochs "
        f"on {args.train_size} images; QAT: {args.qat_epochs} epochs at lr {args.qat_lr} (our TQT thresholds: {args.quantizer_lr or args.qat_lr}), mean ± sd over {args.qat_seeds} seeds; PT2E: torchao "
        f"{_torchao_version()} {args.pt2e_quantizer} quantizer)"
    )


def _torchao_version() -> str:
    try:
        import torchao

        return torchao.__version__
    except ImportError:
        return "(not installed: pip install -e .[bench])"


if __name__ == "__main__":
    main()
