"""Cayley SGD: gradient descent on square orthonormal matrices (the Stiefel manifold O(n)), as SpinQuant trains its
rotations (Li, Li and Todorovic 2020, "Efficient Riemannian optimization on the Stiefel manifold via the Cayley
transform").

For a point ``X`` (``X^T X = I``) with Euclidean gradient ``G``, the skew-symmetric ``A = G X^T - X G^T`` is the
Riemannian gradient moved to the identity (``A X`` is the gradient on the manifold under the canonical metric). The
step is the Cayley retraction ``X <- (I + a/2 A)^-1 (I - a/2 A) X``: a product of ``X`` with an orthogonal matrix, so
the point stays orthonormal up to rounding whatever the step size (computed by a linear solve in float64, not by the
paper's fixed-point iteration). With ``momentum`` the skew matrices are accumulated (``M <- m M + A``, the step uses
``M``): a skew matrix acts on the left, so it needs no transport between points.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["CayleySGD", "orthonormality_error"]

#: largest ``||X^T X - I||_max`` accepted at the start (float32 rounding of a Hadamard matrix is far below it)
START_TOLERANCE = 1e-4


def orthonormality_error(x: torch.Tensor) -> float:
    """``max |X^T X - I|`` computed in float64."""
    x64 = x.detach().double()
    return float((x64.T @ x64 - torch.eye(x64.shape[1], dtype=torch.float64, device=x64.device)).abs().max())


def _named(params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]) -> tuple[list, list[str]]:
    """The parameters and their names (``params[i]`` for unnamed ones)."""
    tensors, names = [], []
    for i, item in enumerate(params):
        if isinstance(item, tuple):
            names.append(str(item[0]))
            tensors.append(item[1])
        else:
            names.append(f"params[{i}]")
            tensors.append(item)
    return tensors, names


def _check_start(param: torch.Tensor, name: str) -> None:
    """ValueError naming ``name`` unless ``param`` is a square orthonormal floating-point matrix."""
    if param.dim() != 2 or param.shape[0] != param.shape[1]:
        raise ValueError(f"CayleySGD: {name} has shape {tuple(param.shape)}; allowed: a square matrix [n, n]")
    if not param.is_floating_point():
        raise ValueError(f"CayleySGD: {name} has dtype {param.dtype}; allowed: a floating-point matrix")
    error = orthonormality_error(param)
    if error > START_TOLERANCE:
        raise ValueError(
            f"CayleySGD: {name} is not orthonormal (max |X^T X - I| = {error:.3g} > {START_TOLERANCE}); start from an "
            "orthonormal matrix (e.g. a Hadamard matrix)"
        )


def cayley_step(x: torch.Tensor, skew: torch.Tensor, lr: float) -> torch.Tensor:
    """``(I + lr/2 A)^-1 (I - lr/2 A) X`` in float64 (``A`` skew-symmetric), cast back to ``x``'s dtype."""
    x64, a = x.double(), skew.double()
    eye = torch.eye(a.shape[0], dtype=torch.float64, device=a.device)
    step = torch.linalg.solve(eye + 0.5 * lr * a, (eye - 0.5 * lr * a) @ x64)
    return step.to(dtype=x.dtype)


class CayleySGD(torch.optim.Optimizer):
    """SGD (optional momentum) of square orthonormal Parameters, each kept on the orthogonal group.

    Args:
        params: Parameters, ``(name, Parameter)`` pairs (their names appear in errors) or param groups.
        lr: The step size ``a`` of the Cayley retraction.
        momentum: The momentum factor of the accumulated skew-symmetric gradients (0: none).

    Raises:
        ValueError: For a non-positive ``lr``, a ``momentum`` outside [0, 1), or a parameter that is not a square
            orthonormal floating-point matrix (named).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]] | Iterable[dict],
        lr: float = 1.0,
        momentum: float = 0.0,
    ) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"CayleySGD: lr={lr!r}; allowed: a positive number")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"CayleySGD: momentum={momentum!r}; allowed: a number in [0, 1)")
        items = list(params)
        if items and isinstance(items[0], dict):
            groups = items
        else:
            tensors, names = _named(items)
            groups = [{"params": tensors, "names": names}]
        for group in groups:
            names = group.get("names") or [f"params[{i}]" for i in range(len(group["params"]))]
            group["names"] = list(names)
            for param, name in zip(group["params"], group["names"], strict=True):
                _check_start(param, name)
        super().__init__(groups, {"lr": float(lr), "momentum": float(momentum)})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Cayley step of every parameter with a gradient.

        Args:
            closure: Re-evaluates the loss (called with gradients on), as for other optimizers.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                x, grad = param.detach().double(), param.grad.detach().double()
                skew = grad @ x.T - x @ grad.T
                if group["momentum"]:
                    state = self.state[param]
                    buf = state.get("momentum_buffer")
                    skew = skew if buf is None else group["momentum"] * buf + skew
                    state["momentum_buffer"] = skew
                param.copy_(cayley_step(param, skew, group["lr"]))
        return loss
