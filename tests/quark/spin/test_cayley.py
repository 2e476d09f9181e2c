"""CayleySGD: stays orthonormal, solves orthogonal Procrustes (closed-form SVD reference), a zero gradient is a
fixed point, and bad starts are refused by name."""

import pytest
import torch
from torch import nn

from quark.torch.algorithm.rotation.cayley import CayleySGD, orthonormality_error
from quark.torch.algorithm.rotation.hadamard import hadamard_matrix


def _random_orthonormal(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q.to(dtype)


def _procrustes(n: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
    b = a @ _random_orthonormal(n, seed + 1, torch.float64) + 0.1 * torch.randn(
        3 * n, n, generator=g, dtype=torch.float64
    )
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_stays_orthonormal_after_200_steps(dtype, tol):
    x = nn.Parameter(hadamard_matrix(32, dtype=dtype))
    opt = CayleySGD([x], lr=0.5, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    target = torch.randn(32, 32, generator=g, dtype=dtype)
    for _ in range(200):
        opt.zero_grad()
        ((x @ target).sin().sum()).backward()
        opt.step()
    assert orthonormality_error(x) < tol
    assert (x.detach() - hadamard_matrix(32, dtype=dtype)).abs().max() > 0.1  # it did move


@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_converges_to_procrustes_solution(momentum):
    n = 8
    a, b = _procrustes(n, 3, torch.float64)
    u, _, vh = torch.linalg.svd(a.T @ b)
    best = u @ vh  # argmin ||A X - B||_F over orthogonal X
    start = torch.eye(n, dtype=torch.float64)
    start[0, 0] = torch.linalg.det(best).sign()  # rotations keep the determinant: start in the answer's component
    x = nn.Parameter(start)
    opt = CayleySGD([("R", x)], lr=0.01, momentum=momentum)
    for _ in range(1500):
        opt.zero_grad()
        ((a @ x - b) ** 2).sum().backward()
        opt.step()
    assert (x.detach() - best).abs().max() < 1e-6
    assert orthonormality_error(x) < 1e-12


def test_zero_gradient_leaves_point_unchanged():
    start = _random_orthonormal(16, 0, torch.float32)
    x = nn.Parameter(start.clone())
    opt = CayleySGD([x], lr=1.5, momentum=0.5)
    x.grad = torch.zeros_like(x)
    opt.step()
    assert torch.equal(x.detach(), start)
    x.grad = None  # no gradient: skipped
    opt.step()
    assert torch.equal(x.detach(), start)


def test_refuses_bad_starts_by_name():
    with pytest.raises(ValueError, match=r"rot\.R1 has shape \(4, 3\).*square"):
        CayleySGD([("rot.R1", nn.Parameter(torch.zeros(4, 3)))])
    with pytest.raises(ValueError, match=r"rot\.R2 is not orthonormal"):
        CayleySGD([("rot.R2", nn.Parameter(2 * torch.eye(4)))])
    with pytest.raises(ValueError, match=r"params\[1\] is not orthonormal"):
        CayleySGD([nn.Parameter(torch.eye(4)), nn.Parameter(torch.ones(4, 4))])
    with pytest.raises(ValueError, match="lr=0"):
        CayleySGD([nn.Parameter(torch.eye(4))], lr=0)
    with pytest.raises(ValueError, match="momentum=1"):
        CayleySGD([nn.Parameter(torch.eye(4))], momentum=1)
