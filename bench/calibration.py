"""Calibration time over the same batches, as ratios to a plain no_grad forward pass and to torch.ao.quantization.

Model: an MLP of four 1024-wide Linear layers; 16 batches of 256 x 1024. Ours: ModelQuantizer.quantize_model
(prepare + calibrate) with int8 per-channel weights and int8 per-tensor static activations, for each activation
observer. torch.ao: prepare with the equivalent observers, then the same forward passes.

    python bench/calibration.py
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.ao import quantization as tq

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

OBSERVERS = {
    "min-max": ("PerTensorMinMaxObserver", tq.MinMaxObserver),
    "histogram": ("PerTensorHistogramObserver", tq.HistogramObserver),
    "percentile": ("PerTensorPercentileObserver", tq.HistogramObserver),
    "mse": ("PerTensorMSEObserver", tq.HistogramObserver),
}


def _mlp(width: int = 1024, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def _ours(model: nn.Module, batches: list[torch.Tensor], observer: str) -> None:
    act = {**INT8_PER_TENSOR_ACT, "observer_cls": observer}
    config = Config.from_dict({"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": act}})
    ModelQuantizer(config).quantize_model(copy.deepcopy(model), batches)


def _torch_ao(model: nn.Module, batches: list[torch.Tensor], observer: type) -> None:
    m = copy.deepcopy(model)
    m.qconfig = tq.QConfig(
        activation=observer.with_args(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric),
        weight=tq.PerChannelMinMaxObserver.with_args(dtype=torch.qint8, qscheme=torch.per_channel_symmetric),
    )
    tq.prepare(m, inplace=True)
    with torch.no_grad():
        for b in batches:
            m(b)
    for mod in m.modules():  # every qparam, as our calibration computes them: activations ...
        if isinstance(mod, tq.ObserverBase):
            mod.calculate_qparams()
        if isinstance(mod, nn.Linear):  # ... and weights (torch.ao observes those in convert)
            weight_observer = m.qconfig.weight()
            weight_observer(mod.weight)
            weight_observer.calculate_qparams()


def _plain(model: nn.Module, batches: list[torch.Tensor]) -> None:
    m = copy.deepcopy(model)  # the copy is part of every contender's cost
    with torch.no_grad():
        for b in batches:
            m(b)


def run(n_batches: int = 16, batch: int = 256, width: int = 1024, repeats: int = 9) -> dict[str, float]:
    """Median ms of every contender; contenders are interleaved round by round so drift hits them alike."""
    torch.manual_seed(0)
    model = _mlp(width)
    batches = [torch.randn(batch, width) for _ in range(n_batches)]
    contenders: dict[str, Callable[[], object]] = {"plain no_grad forward": lambda: _plain(model, batches)}
    for name, (ours, theirs) in OBSERVERS.items():
        contenders[f"ours: {name}"] = lambda o=ours: _ours(model, batches, o)
        contenders[f"torch.ao: {name}"] = lambda t=theirs: _torch_ao(model, batches, t)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    res = run()
    plain = res["plain no_grad forward"]
    print(
        f"# calibration of a 4x1024 MLP on 16 batches of 256, median of 9 interleaved rounds, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print("| observer | ours ms | x plain | torch.ao ms | ours / torch.ao | goal |")
    print("|---|---|---|---|---|---|")
    print(f"| (plain no_grad forward) | {plain:.0f} | 1.00 | | | |")
    for name in OBSERVERS:
        ours, theirs = res[f"ours: {name}"], res[f"torch.ao: {name}"]
        limit = 1.3 if name == "min-max" else 3.0
        met = ours / plain <= limit and ours <= theirs
        print(
            f"| {name} | {ours:.0f} | {ours / plain:.2f} | {theirs:.0f} | {ours / theirs:.2f} | "
            f"<= {limit}x plain and <= torch.ao: {'met' if met else 'MISSED'} |"
        )


if __name__ == "__main__":
    main()
