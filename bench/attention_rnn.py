"""Cost of the attention and recurrent twins at transformer width, as ratios to the float modules in the same run.

Contenders per model, each a copy of the same initial weights:

- ``float``: torch's module as is (in eval under no_grad ``nn.TransformerEncoderLayer`` takes its fused fast path:
  the peer a deployed float model gets).
- ``W8A8``: ``ModelQuantizer`` with int8 per-channel weights and int8 per-tensor static activations (min-max), one
  calibration batch, observers off (fixed qparams: the QAT steady state and the PTQ evaluation).

Measured: a training step (forward, mean-square loss, backward; no optimizer) and an eval forward under no_grad.
Models: ``nn.TransformerEncoderLayer(d_model, nhead, 4 * d_model, batch_first=True)`` on (batch, seq, d_model), and
a 2-layer ``nn.LSTM(d_model, d_model)`` on (seq, batch, d_model). Ratios are medians over rounds of per-round ratios
(every contender runs in every round), so a shared machine's drift hits both sides alike.

    python bench/attention_rnn.py                 # d_model 512, seq 128, batch 8; 7 rounds
    python bench/attention_rnn.py --d-model 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from bench import as_a_long_run
from quark.torch import ModelQuantizer
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}


class _Wrap(nn.Module):
    """The engine swaps children: the layer under test inside a container; LSTMs return only the sequence."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def _models(kind: str, d_model: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    if kind == "transformer":
        layer: nn.Module = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.0, batch_first=True)
    else:
        layer = nn.LSTM(d_model, d_model, num_layers=2)
    return _Wrap(layer), _Wrap(copy.deepcopy(layer))


def _input(kind: str, d_model: int, seq: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, seq, d_model) if kind == "transformer" else torch.randn(seq, batch, d_model)


def _quantize(model: nn.Module, x: torch.Tensor) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the LayerNorms are listed as float
        ModelQuantizer(W8A8).quantize_model(model, [x])
    for m in model.modules():
        if isinstance(m, FakeQuantizeBase):
            m.disable_observer()
    return model


def _train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    return step


def _eval_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.eval()
        with torch.no_grad():
            model(x)

    return step


def _median_ratio(times: dict[str, list[float]], name: str, ref: str) -> float:
    return statistics.median(t / r for t, r in zip(times[name], times[ref], strict=True))


def bench(kind: str, d_model: int, seq: int, batch: int, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """{contender: (median ms, ratio to float)} for the train step and the eval forward."""
    x = _input(kind, d_model, seq, batch)
    float_model, quant_model = _models(kind, d_model)
    _quantize(quant_model, x)
    fns = {
        "float train": _train_step(float_model, x),
        "W8A8 train": _train_step(quant_model, x),
        "float eval": _eval_step(float_model, x),
        "W8A8 eval": _eval_step(quant_model, x),
    }
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            for _ in range(steps):
                fns[name]()
            times[name].append(1e3 * (time.perf_counter() - t0) / steps)
    return {n: (statistics.median(times[n]), _median_ratio(times, n, "float " + n.split()[1])) for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    as_a_long_run()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; d_model {args.d_model}, seq {args.seq}, batch {args.batch}"
    )
    print("| model | contender | ms | x float |")
    print("|---|---|---|---|")
    for kind in ("transformer", "lstm"):
        results = bench(kind, args.d_model, args.seq, args.batch, args.rounds, args.steps)
        for name, (ms, ratio) in results.items():
            print(f"| {kind} | {name} | {ms:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
