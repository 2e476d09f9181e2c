"""The one rule by which function-preserving transforms are judged (quark.torch.quantization.equivalence)."""

import pytest
import torch
from torch import nn

from quark.torch.quantization.equivalence import (
    EquivalenceError,
    check_equivalent,
    relative_error,
    restored_on_error,
    tolerance,
)


def test_relative_error_is_the_norm_ratio_over_every_float_output():
    a = {"logits": torch.tensor([3.0, 4.0]), "ids": torch.tensor([1, 2])}
    b = {"logits": torch.tensor([3.0, 4.5]), "ids": torch.tensor([9, 9])}  # integer outputs are not compared
    assert relative_error(a, b) == pytest.approx(0.5 / 5.0)
    assert relative_error((torch.ones(2),), (torch.ones(3),)) == float("inf")  # shapes differ
    assert relative_error(torch.ones(2), torch.tensor([1.0, float("nan")])) == float("inf")


def test_a_rescaled_linear_pair_passes_and_a_misplaced_scale_raises():
    torch.manual_seed(0)
    a, b, x = nn.Linear(16, 32), nn.Linear(32, 8), torch.randn(64, 16)
    before = b(a(x))
    s = torch.rand(32) + 0.5
    with torch.no_grad():  # the exact fold: a's rows / s, b's columns * s
        a.weight.div_(s[:, None]), a.bias.div_(s), b.weight.mul_(s[None, :])
    assert check_equivalent("test fold", "b", before, b(a(x))) < tolerance(torch.float32)
    with torch.no_grad():  # Gemma's (1 + w) norm folded as if it were w: off by O(1)
        a.bias.add_(1.0)
    with pytest.raises(EquivalenceError, match=r"test fold changed what layers\.0 computes"):
        check_equivalent("test fold", "layers.0", before, b(a(x)))


def test_half_precision_noise_passes():
    torch.manual_seed(0)
    x = torch.randn(256)
    assert check_equivalent("t", "l", x.bfloat16(), (x * 1.001).bfloat16()) < tolerance(torch.bfloat16)


def test_the_module_is_put_back_when_the_transform_raises():
    layer = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    weight = layer[0].weight
    saved = {k: v.clone() for k, v in layer.state_dict().items()}
    with pytest.raises(RuntimeError), restored_on_error(layer), torch.no_grad():
        layer[0].weight.mul_(3)
        layer[1].running_mean.add_(1)
        raise RuntimeError("check failed")
    assert layer[0].weight is weight  # the same Parameter object (optimizers keep theirs)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_float32_on_a_gpu_allowing_tf32_gets_tf32_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN runs float32 convolutions in TF32 by default: a rescaled conv pair differs by ~4e-4 there (measured on an
    H100 on torchvision ResNet-18), which is TF32 noise, not a broken fold; on the CPU float32's limit holds."""
    assert tolerance(torch.float32, "cpu") == tolerance(torch.float32) == 1e-4
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert tolerance(torch.float32, "cuda") == 8 * 2.0**-10
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert tolerance(torch.float32, "cuda") == 1e-4
    assert tolerance(torch.bfloat16, "cuda") == 8 * torch.finfo(torch.bfloat16).eps
