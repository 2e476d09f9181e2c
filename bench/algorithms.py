"""GPTQ and AWQ against round-to-nearest on the byte-level LM (weight-only, groups of 32, asymmetric), at 4 and 3
bits; SmoothQuant against naive W8A8 (per-tensor activations) on the same LM with outlier activation channels.

Prints perplexity, wall time and peak memory (resident set growth during the call) per method.

    python bench/algorithms.py                                # trains the LM first (~3 min on 2 cores)
    python bench/algorithms.py --ckpt runs/lm_float/checkpoints/float-epoch1.ckpt
"""

from __future__ import annotations

import argparse
import copy
import math
import threading
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.char_lm import CharLM, PythonSourceDataModule


def weight_spec(bits: int) -> dict[str, Any]:
    return {
        "dtype": f"uint{bits}",
        "qscheme": "per_group",
        "ch_axis": 1,
        "group_size": 32,
        "observer_cls": "PerGroupMinMaxObserver",
        "symmetric": False,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }


W8A8 = {
    "weight": {
        "dtype": "int8",
        "qscheme": "per_channel",
        "ch_axis": 0,
        "observer_cls": "PerChannelMinMaxObserver",
        "symmetric": True,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    },
    "input_tensors": {
        "dtype": "int8",
        "qscheme": "per_tensor",
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    },
}


class PeakRSS:
    """Peak growth of the process's resident memory while the block runs (sampled every 5 ms)."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def mb(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@torch.no_grad()
def perplexity(model: nn.Module, loader: Any) -> float:
    model.eval()
    total, count = 0.0, 0
    for x, y in loader:
        logits = model(x)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
        count += y.numel()
    return math.exp(total / count)


def add_outlier_channels(model: CharLM, channels: int = 4, factor: float = 30.0) -> CharLM:
    """The same function with outlier activation channels: scale a few channels of every input/post-attention norm
    up and the linears reading them down (what LLMs show at scale, which a 1M-parameter LM trained briefly does not)."""
    model = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.net.model.layers:
            for norm, linears in (
                (layer.input_layernorm, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                (layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj]),
            ):
                idx = torch.randperm(norm.weight.numel(), generator=generator)[:channels]
                norm.weight[idx] *= factor
                for lin in linears:
                    lin.weight[:, idx] /= factor
    return model


def run_method(model: nn.Module, config: dict[str, Any], calib: list[Any], test: Any) -> tuple[float, float, float]:
    """(perplexity, seconds, peak MB) of quantize_model with ``config`` on a copy of ``model``."""
    model = copy.deepcopy(model)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        ModelQuantizer(Config.from_dict(config)).quantize_model(model, calib)
        seconds = time.perf_counter() - t0
    return perplexity(model, test), seconds, mem.mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", help="a float CharLM checkpoint (python train.py experiment=char_lm quant=none)")
    parser.add_argument("--calib-batches", type=int, default=16)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    dm = PythonSourceDataModule()
    dm.setup()
    if args.ckpt:
        model = CharLM()
        model.load_state_dict(torch.load(args.ckpt, map_location="cpu", weights_only=True)["state_dict"])
    else:
        model = CharLM()
        L.Trainer(
            max_epochs=2,
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=1.0,
        ).fit(model, datamodule=dm)
    model.eval()
    calib = [b for _, b in zip(range(args.calib_batches), dm.train_dataloader(), strict=False)]
    test = dm.test_dataloader()
    fp32 = perplexity(model, test)
    print(
        f"FP32 perplexity {fp32:.3f}; calibration: {len(calib)} batches of {calib[0][0].shape[0]}x{calib[0][0].shape[1]} bytes\n"
    )
    print("| bits | method | perplexity | gap to FP32 closed vs RTN | time s | peak MB |")
    print("|---|---|---|---|---|---|")
    for bits in (4, 3):
        rtn = None
        for method, algo in (("RTN", None), ("GPTQ", {"name": "gptq"}), ("AWQ", {"name": "awq"})):
            config: dict[str, Any] = {"global_quant_config": {"weight": weight_spec(bits)}}
            if algo:
                config["algo_config"] = algo
            ppl, seconds, mb = run_method(model, config, calib, test)
            rtn = ppl if rtn is None else rtn
            closed = "" if method == "RTN" else f"{(rtn - ppl) / (rtn - fp32):.0%}"
            print(f"| {bits} | {method} | {ppl:.3f} | {closed} | {seconds:.1f} | {mb:.0f} |")
    outliers = add_outlier_channels(model)
    print(
        f"\nW8A8 (int8 per-channel weights, int8 per-tensor static activations); outlier model FP32 {perplexity(outliers, test):.3f}"
    )
    print("| model | naive W8A8 | SmoothQuant W8A8 (alpha 0.5) |")
    print("|---|---|---|")
    for name, m in (("LM", model), ("LM with outlier channels", outliers)):
        naive = run_method(m, {"global_quant_config": W8A8}, calib, test)[0]
        smooth = run_method(
            m, {"global_quant_config": W8A8, "pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5}}, calib, test
        )[0]
        print(f"| {name} | {naive:.3f} | {smooth:.3f} |")


if __name__ == "__main__":
    main()
