"""Tiny random-weight MoE causal LMs of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE) built from their configs, the
recipes the MoE tests quantize them with, and what they measure on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch.quantization.report import model_size_bits
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, SEQ = 128, 64, 16
EXPERTS, TOP_K = 4, 2
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
#: family -> its config (tiny); the experts' intermediate size is 32 everywhere
CONFIGS: dict[str, Callable[[], Any]] = {
    "mixtral": lambda: transformers.MixtralConfig(
        **_COMMON, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, moe_intermediate_size=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K
    ),
}
FAMILIES = tuple(CONFIGS)

W8A8 = {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}


def build(family: str, seed: int = 0) -> nn.Module:
    """The tiny model of ``family`` with random weights, in eval mode (transformers' default experts implementation,
    ``grouped_mm``)."""
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()


def token_batches(n: int = 2, batch: int = 4, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (batch, SEQ), generator=g)} for _ in range(n)]


def eval_ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def experts_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every fused-experts module (``mlp.experts``) of a model."""
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def weight_share(model: nn.Module, weight_bits: int = 8) -> float:
    """The share of the model's weight elements that ``model_size_bits`` counts as quantized to ``weight_bits``:
    (float bits - quantized bits) / (32 - weight_bits) elements, over every Parameter of two or more dimensions but
    the input embeddings (quantized only when named). Every Parameter is float32 here."""
    quantized_bits, float_bits = model_size_bits(model)
    quantized = (float_bits - quantized_bits) / (32 - weight_bits)
    embeddings = {id(model.get_input_embeddings().weight)}
    total = sum(p.numel() for p in model.parameters() if p.ndim >= 2 and id(p) not in embeddings)
    return quantized / total
