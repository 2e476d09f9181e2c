"""Learned (SpinQuant) vs fixed Hadamard rotations: the held-out KL of the W4A4 quantized model from the float model.

Machine: whatever runs it (the figures in docs were taken on 2 shared CPU cores). Model: the tiny CharTransformer of
the tests (d_model 64, 2 layers, d_ff 192, random weights) with three outlier residual channels (embedding columns
x50) and a sharpened lm_head (x10); int4 per-channel weights, int4 per-token dynamic inputs, R1+R2+R4, no GPTQ; 4
calibration batches of 4x24 bytes, 2 held-out batches. The peer (fixed Hadamard) runs in the same process.

Run: PYTHONPATH=$PWD python bench/spinquant_kl.py [--steps 30] [--lr 1.5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "quark" / "spin"))
from spin_models import char_batches, char_model, kl, quantized  # noqa: E402

from quark.torch.quantization.config.config import RotationConfig  # noqa: E402


def outlier_model() -> torch.nn.Module:
    """The tests' CharTransformer with three large residual channels and a sharper lm_head."""
    model = char_model()
    with torch.no_grad():
        for embedding in (model.model.embed_tokens, model.model.embed_positions):
            embedding.weight[:, :3] *= 50
        model.lm_head.weight *= 10
    return model


def main() -> None:
    """Quantize with fixed and learned rotations and print the held-out KLs and their ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1.5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, batches, held = outlier_model(), char_batches(4), char_batches(2, seed=7)
    start = time.perf_counter()
    fixed = quantized(model, batches, RotationConfig(r1=True, r2=True, r4=True))
    t_fixed = time.perf_counter() - start
    learned_cfg = RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=args.steps, train_lr=args.lr)
    start = time.perf_counter()
    learned = quantized(model, batches, learned_cfg)
    t_learned = time.perf_counter() - start
    kl_fixed, kl_learned = kl(fixed, model, held), kl(learned, model, held)
    print(
        f"held-out KL from float: fixed Hadamard {kl_fixed:.5f}, learned ({args.steps} steps, lr {args.lr}) {kl_learned:.5f}"
    )
    print(f"ratio learned / fixed: {kl_learned / kl_fixed:.3f}; quantize time ratio {t_learned / t_fixed:.2f}x")


if __name__ == "__main__":
    main()
