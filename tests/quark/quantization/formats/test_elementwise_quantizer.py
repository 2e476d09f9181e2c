"""``elementwise_quantizer``: the eager core that GPTQ runs per column gives fake_quantize's bits; ``fake_quantize_grad``
is the gradient autograd gives through fake_quantize."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import Dtype, QSchemeType, RoundType
from quark.torch.quantization.formats import elementwise_quantizer, fake_quantize, fake_quantize_grad


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


_GRAD_CASES = {
    "int8 per-tensor (torch's kernel)": (Dtype.int8, QSchemeType.per_tensor, None, None, RoundType.half_even),
    "uint8 per-channel axis 1 (torch's kernel)": (Dtype.uint8, QSchemeType.per_channel, 1, None, RoundType.half_even),
    "int4 per-group, round half away": (Dtype.int4, QSchemeType.per_group, 1, 16, RoundType.round),
    "fp8 e4m3 per-tensor": (Dtype.fp8_e4m3, QSchemeType.per_tensor, None, None, None),
    "fp4 per-group along rows": (Dtype.fp4, QSchemeType.per_group, 0, 8, None),
    "fp6 e2m3 per-channel": (Dtype.fp6_e2m3, QSchemeType.per_channel, 0, None, None),
}


@pytest.mark.parametrize("name", list(_GRAD_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_grad_equals_autograd_through_fake_quantize(name, dtype):
    """The gradient a fused caller computes without autograd is the one autograd gives through ``fake_quantize`` (for
    per-tensor/channel int8 on small float32 tensors that is torch's own fused kernel's mask): 0 where it clips."""
    qdtype, qscheme, axis, group_size, round_method = _GRAD_CASES[name]
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(24, 40, generator=g) * 3).to(dtype)
    x[0, :3] = torch.tensor([1e4, -1e4, 0.0]).to(dtype)  # clipped both ways, and zero
    if qscheme == QSchemeType.per_tensor:
        shape = ()
    elif qscheme == QSchemeType.per_channel:
        shape = (x.shape[axis],)
    else:
        shape = (24, -(-40 // group_size)) if axis == 1 else (40, -(-24 // group_size))  # a ragged last group
    scale = torch.rand(shape, generator=g) * 0.05 + 0.02
    zp = torch.full(shape, 5 if qdtype == Dtype.uint8 else 0, dtype=torch.int32)
    kw = {"qscheme": qscheme, "axis": axis, "group_size": group_size, "round_method": round_method}
    upstream = torch.randn(x.shape, generator=g).to(dtype)
    leaf = x.clone().requires_grad_()
    fake_quantize(leaf, qdtype, scale, zp, **kw).backward(upstream)
    ours = fake_quantize_grad(upstream, x, qdtype, scale, zp, **kw)
    assert ours.dtype == dtype and torch.equal(ours, leaf.grad)
    assert bool((ours == 0).any()) and bool((ours != 0).any())


def test_fake_quantize_grad_refuses_formats_without_a_scale():
    with pytest.raises(ValueError, match="has no scale"):
        fake_quantize_grad(torch.ones(4), torch.ones(4), Dtype.mx, torch.ones(()), torch.zeros(()))
