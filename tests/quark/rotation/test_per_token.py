"""The preset's int4 per-token dynamic activation spec: one scale per token vector of a [B, T, D] input (absmax / 7.5,
amd-quark's symmetric int4 range (qmax - qmin) / 2), checked against a hand computation, for every input width."""

from pathlib import Path

import pytest
import torch
import yaml

from quark.torch.quantization.config.spec import QuantizationSpec
from quark.torch.quantization.tensor_quantize import ScaledFakeQuantize

SPEC = Path(__file__).parents[3] / "conf" / "quant" / "spec" / "int4_per_token_dynamic.yaml"


def hand_per_token_int4(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(dim=-1, keepdim=True) / 7.5
    # float32 and x times 1/scale, as torch's fake-quant kernels compute (at the absmax, x / s is a tie at +-7.5)
    return torch.round(x * (1.0 / scale)).clamp(-8, 7) * scale


@pytest.mark.parametrize("shape", [(2, 5, 64), (3, 7, 192), (1, 4, 384), (6, 128)])
def test_per_token_matches_hand_computation(shape):
    spec = QuantizationSpec.from_dict(yaml.safe_load(SPEC.read_text()))
    quantizer = ScaledFakeQuantize(spec)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 10  # rows of different ranges
    out = quantizer(x)
    assert torch.allclose(out, hand_per_token_int4(x), atol=1e-6)
    assert quantizer.scale.numel() == x.numel() // shape[-1]  # one scale per token
    # per token, not per position across the batch: a token made larger changes its own row only
    y = x.clone()
    y[..., 0, :] *= 100
    changed = (quantizer(y) - out).abs().amax(-1).reshape(-1, shape[-2])
    assert torch.all(changed[:, 1:] == 0) and torch.all(changed[:, 0] > 0)
