"""``grouping.fast_apply``: a format's autograd Function called without ``Function.apply``'s Python layer gives the
same result and gradient, and the layer still runs where it matters (functorch transforms, ``torch.compile``)."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.config.type import RoundType
from quark.torch.quantization.formats import integer
from quark.torch.quantization.formats.grouping import fast_apply


def _args(x: torch.Tensor) -> tuple:
    scale = torch.tensor(0.05)
    return (x, scale, torch.zeros((), dtype=torch.int32), -128, 127, RoundType.half_even)


def test_same_result_and_gradient_as_apply() -> None:
    torch.manual_seed(0)
    base = torch.randn(64, 48) * 4  # some values clip: the gradient is masked there
    fast = fast_apply(integer._IntFakeQuant)
    grads = []
    outs = []
    for call in (integer._IntFakeQuant.apply, fast):
        x = base.clone().requires_grad_()
        y = call(*_args(x))
        (y * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
        outs.append(y.detach())
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert bool((grads[1] == 0).any()) and bool((grads[1] != 0).any())  # masked and passed elements both seen


def test_functorch_transforms_take_the_full_apply() -> None:
    fast = fast_apply(integer._IntFakeQuant)
    x = torch.randn(4, 8)
    errors = []
    for call in (integer._IntFakeQuant.apply, fast):
        with pytest.raises(RuntimeError) as err:
            torch.func.vmap(lambda row, call=call: call(*_args(row)))(x)
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "setup_context" in errors[0]  # the same refusal as before, not another error


def test_a_compiled_caller_traces_it_without_a_graph_break() -> None:
    fast = fast_apply(integer._IntFakeQuant)
    x = torch.randn(16, 32)

    def f(t: torch.Tensor) -> torch.Tensor:
        return fast(*_args(t)) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")  # fullgraph: a graph break would raise
    assert torch.equal(compiled(x), integer._IntFakeQuant.apply(*_args(x)) * 2)


def test_a_function_with_setup_context_keeps_its_apply() -> None:
    class WithContext(torch.autograd.Function):
        @staticmethod
        def forward(x):  # type: ignore[override]
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):  # type: ignore[override]
            pass

        @staticmethod
        def backward(ctx, grad):  # type: ignore[override]
            return grad * 2

    assert fast_apply(WithContext) == WithContext.apply
