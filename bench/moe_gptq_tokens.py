"""How many routed tokens an MoE expert needs for GPTQ to beat round-to-nearest: the evidence behind
``GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE``.

On the trained tiny MoE models of ``bench/families_w4.py`` (their cached weights; trained first if missing), every
expert projection's inputs are collected on ``--samples`` calibration and ``--eval`` held-out windows of 128 bytes
(the float model, quantizers off). For each projection with at least twice as many calibration rows as input
features, GPTQ (W4 g128, uint4 asymmetric, the engine's defaults) runs on the Hessian of a random subset of
``f x input features`` of its calibration rows, for each ``f`` of ``--fractions``; printed per family and ``f``: the
median and the largest ratio of GPTQ's held-out output error ``||X (Wq - W)^T||^2`` to round-to-nearest's.

    python bench/moe_gptq_tokens.py --families mixtral qwen3-moe
"""

from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import torch
from torch import nn

from bench.families_w4 import MOE_FAMILIES, REPO_ROOT, float_model, weight_spec, windows
from quark.torch import ModelQuantizer
from quark.torch.algorithm.awq import rtn
from quark.torch.algorithm.gptq import gptq_quantize
from quark.torch.quantization.config.config import Config, QuantizationSpec
from quark.torch.quantization.nn.modules import iter_quantizers
from quark.torch.quantization.nn.modules.linear_parts import LinearPart, named_modules_with_parts
from quark_lightning.tasks.char_lm import load_python_corpus


def part_inputs(model: nn.Module, windows_: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each expert projection's input rows over ``windows_`` (the float function: every quantizer off)."""
    for _, q in iter_quantizers(model):
        q.disable_fake_quant()
    parts = {n: p for n, p in named_modules_with_parts(model) if isinstance(p, LinearPart)}
    rows: dict[str, list[torch.Tensor]] = {}
    handles = [
        p.register_forward_pre_hook(lambda m, args, n=n: rows.setdefault(n, []).append(args[0].detach()))
        for n, p in parts.items()
    ]
    try:
        with torch.no_grad():
            for window in windows_:
                model(input_ids=window[None])
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(r) for n, r in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=MOE_FAMILIES, default=list(MOE_FAMILIES))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.01, 0.03, 0.1, 0.3, 1.0, 2.0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--eval", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "outputs" / "families_w4")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    corpus = load_python_corpus(train_bytes=1, val_bytes=400_000, test_bytes=400_000)
    calib, held = windows(corpus["val"], args.samples, seed=3), windows(corpus["test"], args.eval, seed=4)
    spec_dict = weight_spec(symmetric=False)
    spec = QuantizationSpec.from_dict(spec_dict)
    generator = torch.Generator().manual_seed(0)
    print("| family | tokens / input features | projections | median GPTQ / RTN | largest GPTQ / RTN |")
    print("|---|---|---|---|---|")
    for family in args.families:
        reference = float_model(family, args.train_steps, args.cache_dir)
        config = Config.from_dict({"global_quant_config": {"weight": spec_dict}, "exclude": ["lm_head"]})
        probe = ModelQuantizer(config).prepare(copy.deepcopy(reference))
        weights = {n: p.weight.detach() for n, p in named_modules_with_parts(probe) if isinstance(p, LinearPart)}
        calib_rows, held_rows = part_inputs(probe, calib), part_inputs(probe, held)
        ratios: dict[float, list[float]] = {f: [] for f in args.fractions}
        for name, w in weights.items():
            x, x_held = calib_rows.get(name), held_rows.get(name)
            if x is None or x_held is None or x.shape[0] < 2 * w.shape[1]:
                continue
            rtn_error = float((x_held @ (rtn(w, spec) - w).T).pow(2).sum())
            for f in args.fractions:
                m = max(1, int(f * w.shape[1]))
                sub = x[torch.randperm(x.shape[0], generator=generator)[:m]]
                q = gptq_quantize(w, 2.0 / m * sub.T @ sub, spec).weight
                ratios[f].append(float((x_held @ (q - w).T).pow(2).sum()) / rtn_error)
        for f, values in ratios.items():
            v = torch.tensor(values)
            print(f"| {family} | {f:g} | {len(v)} | {float(v.median()):.3f} | {float(v.max()):.3f} |")


if __name__ == "__main__":
    main()
