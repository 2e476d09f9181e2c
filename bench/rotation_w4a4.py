"""W4A4 with and without fixed Hadamard rotations on the char LM: held-out perplexity of the float model, of W4A4
(int4 per-channel weights + int4 per-token dynamic activations, GPTQ) without rotations, and with R1+R2+R4 before
GPTQ (conf/quant/w4a4_rotated.yaml's recipe). Ratios are to the float model measured in the same run.

Machine: 2 shared CPU cores. Run: PYTHONPATH=$PWD python bench/rotation_w4a4.py [--steps 600]
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.char_lm import CharTransformer, load_python_corpus

SPEC = Path(__file__).parents[1] / "conf" / "quant" / "spec"


def windows(tokens: torch.Tensor, n: int, length: int, offset: int = 0) -> torch.Tensor:
    return torch.stack([tokens[offset + i * (length + 1) : offset + (i + 1) * (length + 1)] for i in range(n)])


def train(model: CharTransformer, tokens: torch.Tensor, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - 65, (32,), generator=g)
        w = torch.stack([tokens[s : s + 65] for s in starts])
        loss = F.cross_entropy(model(w[:, :-1]).reshape(-1, 256), w[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def ppl(model: torch.nn.Module, data: torch.Tensor) -> float:
    losses = [F.cross_entropy(model(w[None, :-1]).reshape(-1, 256), w[1:]) for w in data]
    return math.exp(float(torch.stack(losses).mean()))


def config(rotate: bool) -> Config:
    algos = [{"name": "gptq", "group_size": -1}]
    if rotate:
        algos.insert(0, {"name": "rotation", "r1": True, "r2": True, "r4": True})
    return Config.from_dict(
        {
            "global_quant_config": {
                "weight": yaml.safe_load((SPEC / "int4_per_channel_sym.yaml").read_text()),
                "input_tensors": yaml.safe_load((SPEC / "int4_per_token_dynamic.yaml").read_text()),
            },
            "algo_config": algos,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.manual_seed(0)
    corpus = load_python_corpus(train_bytes=400_000, val_bytes=40_000, test_bytes=40_000)
    model = CharTransformer(d_model=128, n_layers=2, n_heads=4, d_ff=384, max_seq_len=64)
    t0 = time.time()
    train(model, corpus["train"], args.steps)
    model.eval()
    calib = [windows(corpus["val"], 8, 64, i * 8 * 65)[:, :-1] for i in range(4)]
    held = windows(corpus["test"], 64, 64)
    base = ppl(model, held)
    print(
        f"machine: 2 shared CPU cores; char LM d_model=128 d_ff=384 2 layers, {args.steps} steps ({time.time() - t0:.0f} s)"
    )
    print(f"float ppl {base:.3f}")
    for name, rotate in (("w4a4 gptq", False), ("w4a4 rotated (r1 r2 r4) + gptq", True)):
        t0 = time.time()
        q = ModelQuantizer(config(rotate)).quantize_model(copy.deepcopy(model), calib)
        p = ppl(q, held)
        print(f"{name:34s} ppl {p:8.3f}  ratio to float {p / base:.3f}  ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
