"""RTN, GPTQ and AWQ at W4 g128 on the families of issue 35: Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``,
grouped-query attention), GPT-NeoX (q/k/v interleaved per head; ``use_parallel_residual`` on and off) and the
mixture-of-experts layers of transformers 5 (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE: 8 fused experts,
2 per token, each of intermediate size 256; GPTQ and AWQ per expert on its routed tokens); LLaMA as the control whose
map AWQ has had all along.

Models: transformers configs (no download) of hidden 256, 2 decoder layers, 64-dimensional heads (Phi-3, LLaMA and the
MoE models: 4 query heads, 2 kv heads), byte vocabulary (256), untied ``lm_head``. Their weights are not a bare random init: a few
channels of every norm weight start large (4..16, about 1 in 64 channels), so the inputs of the projections have
outlier channels as trained LLMs do, then the model is trained for ``--train-steps`` AdamW steps of 16 x 128 bytes on
the Python standard library's source (an offline corpus, ``quark_lightning.tasks.char_lm``); the trained weights are
cached under ``--cache-dir``. With ``--train-steps 0`` the models keep their random weights.

Quantization: weight-only, 4 bits, groups of 128 input features, min-max, half-even rounding, ``lm_head``
excluded: uint4 asymmetric (AWQ's usual format), or int4 symmetric with ``--symmetric``. RTN is the engine without an
algorithm; GPTQ and AWQ run with their defaults and the scaling groups of ``MODEL_FAMILIES``. Calibration:
``--samples`` windows of 128 bytes from the corpus' validation files (one per batch); held-out: ``--eval`` windows
from its test files. Printed per family and method: held-out logits mean squared error against the float model, its
ratio to RTN's, held-out perplexity (float's in the header), the same error on the calibration windows, seconds.
Training makes the routing non-trivial: the 4096 calibration tokens x 2 choices reach the experts unevenly (56 to
3910 per expert and layer with the defaults).

    python bench/families_w4.py                      # first run trains each model (a minute or two each on 2 cores)
    python bench/families_w4.py --families phi3 --train-steps 0
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.algorithm import derive_scaling_groups, find_decoder_layers, model_family
from quark.torch.algorithm.structure import EXPERT
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.char_lm import load_python_corpus

REPO_ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, VOCAB, GROUP, TOKENS = 256, 2, 256, 128, 128
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HIDDEN // 64,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
EXPERTS = 8
_MOE = {"num_key_value_heads": 2, "num_experts_per_tok": 2}
FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**_COMMON, **_IDS, intermediate_size=2 * HIDDEN, num_key_value_heads=2)
    ),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**_COMMON, **_IDS, intermediate_size=4 * HIDDEN, use_parallel_residual=True)
    ),
    "gpt-neox-seq": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**_COMMON, **_IDS, intermediate_size=4 * HIDDEN, use_parallel_residual=False)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_COMMON, **_IDS, intermediate_size=2 * HIDDEN, num_key_value_heads=2)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**_COMMON, **_IDS, **_MOE, intermediate_size=HIDDEN, num_local_experts=EXPERTS)
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **_COMMON,
            **_IDS,
            **_MOE,
            moe_intermediate_size=HIDDEN,
            shared_expert_intermediate_size=2 * HIDDEN,
            num_experts=EXPERTS,
        )
    ),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **_COMMON, **_IDS, **_MOE, head_dim=64, moe_intermediate_size=HIDDEN, num_experts=EXPERTS
        )
    ),
}
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe")


def weight_spec(symmetric: bool) -> dict[str, Any]:
    return {
        "dtype": "int4" if symmetric else "uint4",
        "qscheme": "per_group",
        "ch_axis": 1,
        "group_size": GROUP,
        "symmetric": symmetric,
        "observer_cls": "PerGroupMinMaxObserver",
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
    }


def windows(tokens: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``TOKENS`` tokens at seeded random offsets: [count, TOKENS] int64."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - TOKENS - 1, (count,), generator=generator)
    return torch.stack([tokens[s : s + TOKENS] for s in starts.tolist()])


def float_model(family: str, steps: int, cache_dir: Path) -> nn.Module:
    """The float model: outlier channels in every norm, then ``steps`` of training (weights cached on disk)."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    path = cache_dir / f"{family}_h{HIDDEN}_l{LAYERS}_s{steps}.pt"
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("layernorm"):
                channels = torch.randperm(HIDDEN, generator=generator)[: max(2, HIDDEN // 64)]
                module.weight[channels] = 4 + 12 * torch.rand(len(channels), generator=generator)
    if steps:
        corpus = load_python_corpus(train_bytes=2_000_000)["train"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
        model.train()
        for step in range(steps):
            batch = windows(corpus, 16, seed=100 + step)
            for group in optimizer.param_groups:
                group["lr"] = 2e-3 * min(1.0, (step + 1) / 10)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0 or step == steps - 1:
                print(f"  train {family}: step {step + 1}/{steps} loss {loss.item():.3f}", file=sys.stderr, flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.eval()


def _without_fused(model: nn.Module) -> list[dict[str, Any]]:
    """The model's scaling groups from ``MODEL_FAMILIES`` but those folding into a fused producer (an ablation: what
    the fused-producer folds add to AWQ)."""
    _, layers = find_decoder_layers(model)  # type: ignore[misc]
    return [
        {"prev_op": g.prev_op, "layers": g.layers, "inp": g.inp, "module2inspect": g.module2inspect}
        for g in derive_scaling_groups(layers[0])
        if g.rows is None
    ]


def _without_norm_into_experts(model: nn.Module) -> list[dict[str, Any]]:
    """The MoE family's scaling groups (``{e}``: every expert) but the norm's into the router and every expert's
    gate and up (an ablation: what that fold adds to AWQ; amd-quark 0.13 leaves it out)."""
    _, layers = find_decoder_layers(model)  # type: ignore[misc]
    family = model_family(layers[0])
    assert family is not None
    derived = {(g.prev_op, tuple(g.layers)) for g in derive_scaling_groups(layers[0])}  # the float model's: no experts
    return [
        {"prev_op": g.prev_op, "layers": g.layers, "inp": g.inp, "module2inspect": g.module2inspect}
        for g in family.groups
        if EXPERT in g.prev_op or (g.prev_op, tuple(g.layers)) in derived
    ]


def outputs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=ids[i : i + 4]).logits for i in range(0, len(ids), 4)])


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    return float(nll.exp())


def run(family: str, args: argparse.Namespace, calib: torch.Tensor, held: torch.Tensor) -> list[dict[str, Any]]:
    """One row per method: held-out and calibration logits MSE against the float model, perplexity, seconds."""
    reference = float_model(family, args.train_steps, args.cache_dir)
    ref_held, ref_calib = outputs(reference, held), outputs(reference, calib)
    batches = [{"input_ids": c[None]} for c in calib]
    rows = []
    for method in args.methods:
        config: dict[str, Any] = {
            "global_quant_config": {"weight": weight_spec(args.symmetric)},
            "exclude": ["lm_head"],
        }
        if method == "awq-no-fused":
            config["algo_config"] = {"name": "awq", "scaling_layers": _without_fused(reference)}
        elif method == "gptq-every-expert":
            if family not in MOE_FAMILIES:
                continue
            config["algo_config"] = {"name": "gptq"}
        elif method == "awq-no-norm":
            if family not in MOE_FAMILIES:
                continue
            config["algo_config"] = {"name": "awq", "scaling_layers": _without_norm_into_experts(reference)}
        elif method != "rtn":
            config["algo_config"] = {"name": method}
        model = copy.deepcopy(reference)
        start = time.perf_counter()
        quantizer = ModelQuantizer(Config.from_dict(config))
        if method == "gptq-every-expert":  # every expert that received a token, however few
            quantizer.config.algo_configs[0].MIN_EXPERT_TOKENS_PER_FEATURE = 0.0
        model = quantizer.quantize_model(model, batches)
        seconds = time.perf_counter() - start
        got_held = outputs(model, held)
        rows.append(
            {
                "family": family,
                "method": method,
                "mse": float((got_held - ref_held).pow(2).mean()),
                "calib_mse": float((outputs(model, calib) - ref_calib).pow(2).mean()),
                "ppl": perplexity(got_held, held),
                "float_ppl": perplexity(ref_held, held),
                "seconds": seconds,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | float ppl | method | held-out logits MSE | / RTN | held-out ppl | calib logits MSE | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rtn = {r["family"]: r["mse"] for r in rows if r["method"] == "rtn"}
    for r in rows:
        ratio = f"{r['mse'] / rtn[r['family']]:.3f}" if r["family"] in rtn else "-"
        lines.append(
            f"| {r['family']} | {r['float_ppl']:.3f} | {r['method']} | {r['mse']:.3e} | {ratio} "
            f"| {r['ppl']:.3f} | {r['calib_mse']:.3e} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--families", nargs="+", choices=list(FAMILIES), default=["phi3", "gpt-neox", "gpt-neox-seq", *MOE_FAMILIES]
    )
    parser.add_argument(
        "--train-steps", type=int, default=150, help="AdamW steps on the stdlib corpus (0: random init)"
    )
    parser.add_argument("--samples", type=int, default=32, help="calibration windows of 128 bytes (one per batch)")
    parser.add_argument("--eval", type=int, default=32, help="held-out windows of 128 bytes")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=["rtn", "gptq", "awq", "awq-no-fused", "awq-no-norm", "gptq-every-expert"],
        default=["rtn", "gptq", "awq"],
        help="ablations: awq-no-fused, AWQ without the folds into fused producers (qkv -> o, gate_up -> down); MoE "
        "families: awq-no-norm, without the fold of the norm into the router and every expert's gate and up; "
        "gptq-every-expert, GPTQ on every expert that received a token (GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE 0)",
    )
    parser.add_argument("--symmetric", action="store_true", help="int4 symmetric instead of uint4 asymmetric")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=REPO_ROOT / "outputs" / "families_w4")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    corpus = load_python_corpus(train_bytes=1, val_bytes=400_000, test_bytes=400_000)
    calib, held = windows(corpus["val"], args.samples, seed=3), windows(corpus["test"], args.eval, seed=4)
    rows = [row for family in args.families for row in run(family, args, calib, held)]
    spec = "int4 symmetric" if args.symmetric else "uint4 asymmetric"
    print(f"W4 g{GROUP} ({spec}), hidden {HIDDEN}, {LAYERS} layers, {args.train_steps} training steps")
    print(table(rows))


if __name__ == "__main__":
    main()
