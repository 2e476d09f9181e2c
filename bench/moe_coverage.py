"""Share of weights W8A8 quantizes in tiny mixture-of-experts LMs of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE),
with their fused experts left float (what the engine did before it had a twin for them: ``exclude`` the experts) and
quantized per expert.

Models: random weights from each family's config, 2 decoder layers, hidden 64, 4 experts (top 2) of intermediate
size 32 (Qwen2-MoE: a shared expert of 64), vocabulary 128. W8A8: int8 per-channel weights, int8 per-tensor static
inputs, calibrated on 2 batches of 4 x 16 random tokens. The share is ``model_size_bits``'s count of weight elements
at 8 bits over every Parameter of two or more dimensions but the input embeddings (quantized only when named; the
routers stay float). Bits per parameter count every Parameter (embeddings and norms in float32 included).

    python bench/moe_coverage.py
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.report import model_size_bits
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def build(family: str) -> nn.Module:
    """The tiny model of ``family`` (random weights, seed 0)."""
    import transformers

    configs = {
        "mixtral": lambda: transformers.MixtralConfig(
            **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        ),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[family]()).eval()


def measure(family: str, experts_float: bool) -> tuple[float, float]:
    """(share of weights quantized, bits per parameter) of ``family`` after W8A8 PTQ."""
    model = build(family)
    config = {**W8A8, "exclude": ["*.mlp.experts"]} if experts_float else W8A8
    g = torch.Generator().manual_seed(1)
    batches = [{"input_ids": torch.randint(0, 128, (4, 16), generator=g)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the float layers (embeddings, norms, routers) are listed in a warning
        ModelQuantizer(config).quantize_model(model, batches)
    quantized_bits, float_bits = model_size_bits(model)
    embeddings = id(model.get_input_embeddings().weight)
    weights = sum(p.numel() for p in model.parameters() if p.ndim >= 2 and id(p) != embeddings)
    parameters = sum(p.numel() for p in model.parameters())
    return (float_bits - quantized_bits) / 24 / weights, quantized_bits / parameters


def main() -> None:
    print("| model | weights quantized, experts float | weights quantized, experts twin | bits/param, float -> twin |")
    print("|---|---|---|---|")
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        before, bits_before = measure(family, experts_float=True)
        after, bits_after = measure(family, experts_float=False)
        print(f"| {family} | {100 * before:.1f}% | {100 * after:.1f}% | {bits_before:.1f} -> {bits_after:.1f} |")


if __name__ == "__main__":
    main()
