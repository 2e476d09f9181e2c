"""Tiny models for the rotation tests: CharTransformer (LLaMA names, learned positions) and HF LLaMA (GQA, tied or
untied), with norm weights away from 1 so that fusing them is exercised."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark_lightning.tasks.char_lm import CharTransformer

TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 192, "max_seq_len": 32}
#: the rotation tests' weight spec: int4 per output channel, symmetric min-max (what rotations are for)
WEIGHT = {
    "dtype": "int4",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "symmetric": True,
    "observer_cls": "PerChannelMinMaxObserver",
    "is_dynamic": False,
    "round_method": "half_even",
    "scale_type": "float",
}


def _perturb(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.02
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def char_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _perturb(CharTransformer(**TINY), seed)


def hf_llama(tie: bool, kv_heads: int = 2, seed: int = 0) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return _perturb(transformers.LlamaForCausalLM(config), seed)


def plain_llama(intermediate: int) -> nn.Module:
    """An untied HF LLaMA as transformers initialises it (seed 0, no perturbation), with MLP width ``intermediate``:
    the model the amd-quark cross-checks rebuild on their side."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).eval()


def char_batches(n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 24), generator=g) for _ in range(n)]


def hf_batches(n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g) for _ in range(n)]


def logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    return out.logits if hasattr(out, "logits") else out
