"""``elementwise_quantizer``: the eager core that GPTQ runs per column gives fake_quantize's bits."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import elementwise_quantizer, fake_quantize


@pytest.mark.parametrize(
    "dtype,round_method,zp",
    [
        (Dtype.int8, RoundType.half_even, 0),
        (Dtype.uint4, RoundType.half_even, 7),
        (Dtype.int4, RoundType.round, 0),
        (Dtype.int8, RoundType.floor, 3),
        (Dtype.fp8_e4m3, None, 0),
        (Dtype.fp8_e5m2, None, 0),
        (Dtype.fp4, None, 0),
        (Dtype.fp6_e3m2, None, 0),
    ],
)
def test_elementwise_quantizer_equals_fake_quantize_per_channel(dtype, round_method, zp):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * 4
    x[0, :4] = torch.tensor([0.0, 1e6, -1e6, 0.05])  # zero and clipped values
    scale = torch.rand(64, generator=g) * 0.1 + 0.01
    zero_point = torch.full((64,), zp, dtype=torch.int32)
    ref = fake_quantize(x, dtype, scale, zero_point, qscheme=QSchemeType.per_channel, axis=0, round_method=round_method)
    out = elementwise_quantizer(dtype, round_method)(x, scale[:, None], zero_point[:, None])
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
    assert not torch.equal(out, x)


@pytest.mark.parametrize("dtype", [Dtype.mx, Dtype.bfp16, Dtype.bfloat16])
def test_elementwise_quantizer_refuses_formats_without_a_scale(dtype):
    with pytest.raises(ValueError, match="has no scale"):
        elementwise_quantizer(dtype)
