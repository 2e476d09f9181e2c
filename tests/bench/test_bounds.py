"""The bounds the QAT benches fit beside the quantized models (``bench.qat_overhead.BOUND_LAYERS``) compute exactly what
the float model computes, forward and backward: they add memory traffic only, so a ratio under them is not a
quantizer skipping work the bound does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from bench.qat_overhead import BOUND_LAYERS, MLP, ClampLinear, FloorLinear, bounded


@pytest.mark.parametrize("bound", sorted(BOUND_LAYERS))
def test_bound_is_the_float_model(bound: str) -> None:
    torch.manual_seed(0)
    plain = MLP(48, d=32)
    wrapped = bounded(copy.deepcopy(plain), bound)
    layers = [m for m in wrapped.modules() if isinstance(m, (FloorLinear, ClampLinear))]
    assert len(layers) == 3 and all(type(m) is BOUND_LAYERS[bound] for m in layers)
    assert not any(isinstance(m, torch.nn.Linear) for m in wrapped.modules())
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    for model in (plain, wrapped):
        F.cross_entropy(model(x), y).backward()
    torch.testing.assert_close(wrapped(x), plain(x), rtol=0, atol=0)
    for (name, p), (_, q) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


def test_clamp_bound_masks_out_of_range_gradients() -> None:
    """``torch clamp`` is a straight-through quantizer (its backward reads the input for the mask): an input past
    the float32 range (inf) gets no gradient, as a fake quantizer's clipped value gets none."""
    linear = torch.nn.Linear(2, 1)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[2.0, 3.0]]))
    x = torch.tensor([[float("inf"), 1.0]], requires_grad=True)
    ClampLinear(linear)(x).sum().backward()
    assert x.grad is not None
    assert x.grad.tolist() == [[0.0, 3.0]]  # without the mask: [[2.0, 3.0]]
