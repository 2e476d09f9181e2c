"""The torch.compile backend of the format kernels gives the same bits as eager, forward and backward."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import (
    FLOAT_FORMATS,
    fake_quantize_bfp16,
    fake_quantize_int,
    fake_quantize_minifloat,
    fake_quantize_mx,
    fake_quantize_mx9,
    set_compile,
)
from quark.torch.quantization.formats.table import TORCH_FLOAT8

pytestmark = pytest.mark.slow  # each kernel compiles once (~20 s)


def _cases():
    s = torch.tensor(0.02)
    z = torch.tensor(3, dtype=torch.int32)
    return {
        "int8 round": lambda t: fake_quantize_int(t, s, z, -128, 127, round_method=RoundType.round),
        "int4 floor per-group": lambda t: fake_quantize_int(
            t, torch.full((8, 3), 0.1), torch.zeros(8, 3, dtype=torch.int32), -8, 7,
            round_method=RoundType.floor, qscheme=QSchemeType.per_group, axis=1, group_size=16,
        ),
        "fp8_e4m3": lambda t: fake_quantize_minifloat(t, FLOAT_FORMATS[Dtype.fp8_e4m3], s, torch_dtype=TORCH_FLOAT8[Dtype.fp8_e4m3]),
        "fp6_e3m2": lambda t: fake_quantize_minifloat(t, FLOAT_FORMATS[Dtype.fp6_e3m2], s),
        "mxfp4": lambda t: fake_quantize_mx(t, Dtype.fp4, 32, -1),
        "mx9": lambda t: fake_quantize_mx9(t, 16, -1),
        "bfp16": lambda t: fake_quantize_bfp16(t, 8, -1),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_compiled_equals_eager(name: str) -> None:
    fn = _cases()[name]
    torch.manual_seed(0)
    x = torch.randn(8, 40) * 3
    grad = torch.randn(8, 40)
    outs = []
    for compiled in (False, True):
        set_compile(compiled)
        try:
            xg = x.clone().requires_grad_(True)
            y = fn(xg)
            y.backward(grad)
            outs.append((y.detach(), xg.grad))
        finally:
            set_compile(False)
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
