"""W4A4 configs for the learned-rotation tests (the preset's specs: int4 per-channel weights, int4 per-token dynamic
inputs), the KL of a quantized model against its float outputs (an independent computation), and helpers."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import yaml
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, RotationConfig
from quark.torch.quantization.config.spec import QuantizationSpec

sys.path.insert(0, str(Path(__file__).parents[1] / "rotation"))
from rot_models import char_batches, char_model, hf_batches, hf_llama, logits  # noqa: E402

__all__ = ["char_batches", "char_model", "hf_batches", "hf_llama", "logits", "w4a4", "quantized", "kl", "SPEC_DIR"]

SPEC_DIR = Path(__file__).parents[3] / "conf" / "quant" / "spec"


def _spec(name: str) -> QuantizationSpec:
    return QuantizationSpec.from_dict(yaml.safe_load((SPEC_DIR / f"{name}.yaml").read_text()))


def w4a4(rotation: RotationConfig) -> Config:
    """int4 per-channel weights, int4 per-token dynamic inputs, and ``rotation``."""
    layer = QuantizationConfig(weight=_spec("int4_per_channel_sym"), input_tensors=_spec("int4_per_token_dynamic"))
    return Config(global_quant_config=layer, algo_config=[rotation])


def quantized(model: nn.Module, batches: list[torch.Tensor], rotation: RotationConfig) -> nn.Module:
    """A quantized copy of ``model`` (ModelQuantizer's PTQ with ``rotation``)."""
    return ModelQuantizer(w4a4(rotation)).quantize_model(copy.deepcopy(model), batches)


def kl(model: nn.Module, reference: nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean over tokens of KL(reference || model) of the next-token distributions, in float64."""
    total, count = 0.0, 0
    for x in batches:
        p = torch.log_softmax(logits(reference, x).double(), -1)
        q = torch.log_softmax(logits(model, x).double(), -1)
        per_token = (p.exp() * (p - q)).sum(-1)
        total += float(per_token.sum())
        count += per_token.numel()
    return total / count
