"""KV-cache quantization (amd-quark 0.13's ``kv_cache_quant_config``): perplexity change with fp8 (e4m3) and int8 keys
and values, before and after RoPE, and the memory of the cache.

Two small byte-level LMs are trained here on Python's standard library source (offline, see /work/shared/DATA.md):
a Hugging Face ``LlamaForCausalLM`` (RoPE, grouped-query attention, eager attention) and the project's byte LM
(``quark_lightning.tasks.char_lm.CharTransformer``: learned positions, its own attention, so pre-RoPE placement
only). Only the KV cache (and, in one row, the attention probabilities) is quantized: weights and other activations
stay float, so the change is the cache's. Scales are static per tensor, calibrated (min-max) on training windows;
``exported`` rows are the model written with ``export_safetensors(custom_mode="quark")`` (k and v sharing
max(k, v) per layer, ``kv_cache_group``) and imported back.

The memory column is computed from the shapes, not measured: 2 (k and v) x layers x KV heads x head dim x context
x bytes per element, plus one float32 scale per k and v per layer.

    python bench/kv_cache.py                 # about 3 minutes on 2 cores
    python bench/kv_cache.py --steps 600     # longer training
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.config.config import Config
from quark_lightning.tasks.char_lm import CharTransformer, load_python_corpus

FP8 = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver", "is_dynamic": False}
INT8 = {**FP8, "dtype": "int8", "symmetric": True, "scale_type": "float", "round_method": "half_even"}
SPECS = {"fp8": FP8, "int8": INT8}
SEQ = 128


def kv_config(fmt: str, post_rope: bool = False, softmax: bool = False) -> Config:
    """Only the keys and values (``k_proj`` / ``v_proj`` outputs, or the states after RoPE) quantized."""
    entry = {"output_tensors": SPECS[fmt]}
    return Config.from_dict(
        {
            "global_quant_config": {},
            "kv_cache_quant_config": {"*k_proj": entry, "*v_proj": entry},
            "kv_cache_group": ["*k_proj", "*v_proj"],
            "kv_cache_post_rope": post_rope,
            "softmax_quant_spec": FP8 if softmax else None,
        }
    )


# ----------------------------------------------------------------------------------------------- models and data
class HFLlama(nn.Module):
    """A tiny LLaMA (GQA: 4 query heads, 2 KV heads) called on token ids, logits out."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        config._attn_implementation = "eager"  # the softmax row needs it; one implementation for every row
        self.net = transformers.LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=ids, use_cache=False).logits


def windows(tokens: torch.Tensor, count: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of SEQ + 1 tokens, [n, SEQ + 1]."""
    n = (tokens.numel() - 1) // SEQ
    w = tokens[: n * SEQ + 1].unfold(0, SEQ + 1, SEQ)
    return w if count is None else w[:count]


def train(model: nn.Module, data: torch.Tensor, steps: int, batch: int = 16, lr: float = 3e-3) -> float:
    """AdamW with warmup and cosine decay on random windows; returns the seconds it took."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    g = torch.Generator().manual_seed(0)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        w = data[torch.randint(0, data.shape[0], (batch,), generator=g)]
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return time.perf_counter() - t0


@torch.no_grad()
def evaluate(model: nn.Module, data: torch.Tensor, reference: list[torch.Tensor] | None = None, batch: int = 32) -> Any:
    """(perplexity, the logits of every batch, mean KL(reference || model) per token in nats or None)."""
    model.eval()
    total, count, kl, logits_out = 0.0, 0, 0.0, []
    for i, start in enumerate(range(0, data.shape[0], batch)):
        w = data[start : start + batch]
        logits = model(w[:, :-1]).reshape(-1, 256)
        logits_out.append(logits)
        total += float(F.cross_entropy(logits, w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
        if reference is not None:
            kl += float(
                F.kl_div(logits.log_softmax(-1), reference[i].log_softmax(-1), log_target=True, reduction="sum")
            )
    return math.exp(total / count), logits_out, (kl / count if reference is not None else None)


def quantized(model: nn.Module, config: Config, calib: torch.Tensor) -> nn.Module:
    """A copy of ``model`` quantized with ``config`` (an HFLlama's transformers model itself, as it is exported),
    calibrated on ``calib`` in batches of 8 windows."""
    model = copy.deepcopy(model)
    hf = isinstance(model, HFLlama)
    batches = [w[:, :-1] for w in calib.split(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "layers stay float": the weights, on purpose
        if hf:
            ModelQuantizer(config).quantize_model(model.net, [{"input_ids": b} for b in batches])
        else:
            ModelQuantizer(config).quantize_model(model, batches)
    return model


def exported(model: nn.Module, float_model: nn.Module) -> nn.Module:
    """``model`` (an HFLlama) through amd-quark's directory and back: k and v share max(k, v) per layer."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_safetensors(model.net, tmp, custom_mode="quark")
        back = copy.deepcopy(float_model)
        back.net = import_model_from_safetensors(back.net, tmp)
    return back


# ----------------------------------------------------------------------------------------------- memory
def kv_bytes(layers: int, kv_heads: int, head_dim: int, context: int, bytes_per_element: float) -> float:
    """Bytes of a KV cache of one sequence (k and v), plus the two float32 scales per layer of a quantized one."""
    scales = 2 * layers * 4 if bytes_per_element < 2 else 0
    return 2 * layers * kv_heads * head_dim * context * bytes_per_element + scales


def memory_table() -> list[str]:
    shapes = {  # (layers, KV heads, head dim, context)
        f"tiny LLaMA here, context {SEQ}": (4, 2, 64, SEQ),
        "Llama-3-8B shapes (32 layers, 8 KV heads, head dim 128), context 8192": (32, 8, 128, 8192),
    }
    rows = ["| model | float32 | bf16 | fp8 / int8 |", "|---|---|---|---|"]
    for name, (layers, heads, dim, context) in shapes.items():
        cells = [kv_bytes(layers, heads, dim, context, b) for b in (4, 2, 1)]
        rows.append(f"| {name} | " + " | ".join(_size(c) for c in cells) + " |")
    return rows


def _size(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


# ----------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--test-windows", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    corpus = load_python_corpus(2_000_000, 100_000, 200_000)
    train_w, test_w = windows(corpus["train"]), windows(corpus["test"], args.test_windows)
    calib = train_w[torch.randperm(train_w.shape[0], generator=torch.Generator().manual_seed(1))[:32]]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps of 16 x {SEQ} bytes; "
        f"test {test_w.shape[0]} windows of {SEQ} bytes; calibration 32 windows"
    )

    lines = [
        "| model | KV cache | placement | perplexity | change | KL(float ‖ quantized), nats/token |",
        "|---|---|---|---|---|---|",
    ]

    def row(model_name: str, what: str, where: str, q: nn.Module, base: tuple[float, list[torch.Tensor]]) -> None:
        ppl, _, kl = evaluate(q, test_w, base[1])
        lines.append(f"| {model_name} | {what} | {where} | {ppl:.4f} | {100 * (ppl / base[0] - 1):+.3f}% | {kl:.2e} |")

    torch.manual_seed(0)
    llama = HFLlama()
    seconds = train(llama, train_w, args.steps)
    base = evaluate(llama, test_w)[:2]
    print(f"tiny LLaMA trained in {seconds:.0f} s")
    lines.append(f"| tiny LLaMA | float32 | - | {base[0]:.4f} | | |")
    for fmt in ("fp8", "int8"):
        for post in (False, True):
            q = quantized(llama, kv_config(fmt, post), calib)
            row("tiny LLaMA", fmt, "after RoPE" if post else "before RoPE (k_proj / v_proj outputs)", q, base)
            if not post:
                row(
                    "tiny LLaMA",
                    f"{fmt}, exported + imported (k, v share max)",
                    "before RoPE",
                    exported(q, llama),
                    base,
                )
    q = quantized(llama, kv_config("fp8", True, softmax=True), calib)
    row("tiny LLaMA", "fp8 + fp8 probabilities", "after RoPE", q, base)

    torch.manual_seed(0)
    byte_lm = CharTransformer(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=384, max_seq_len=SEQ)
    seconds = train(byte_lm, train_w, args.steps)
    base = evaluate(byte_lm, test_w)[:2]
    print(f"byte LM trained in {seconds:.0f} s")
    lines.append(f"| byte LM (char_lm) | float32 | - | {base[0]:.4f} | | |")
    for fmt in ("fp8", "int8"):
        row("byte LM (char_lm)", fmt, "k_proj / v_proj outputs", quantized(byte_lm, kv_config(fmt), calib), base)
    print("\n".join(lines))
    print("\nKV-cache memory of one sequence, computed from the shapes (not measured):")
    print("\n".join(memory_table()))


if __name__ == "__main__":
    main()
