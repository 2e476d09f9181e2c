"""Orthonormal Hadamard matrices (``H @ H.T == I``, entries ``+-1/sqrt(n)``) for the fixed rotations.

A size ``n = m * 2**k`` is built as the Kronecker product of a small Hadamard matrix of size ``m`` and Sylvester's of
size ``2**k``, with the smallest ``m`` that one of these constructions gives:

- Sylvester: ``m = 1`` (and so every power of two);
- Paley I: ``m = q + 1`` for a prime ``q = 3 (mod 4)`` (4, 8, 12, 20, 24, 32, 44, 48, ...);
- Paley II: ``m = 2 (q + 1)`` for a prime ``q = 1 (mod 4)`` (12, 28, 36, 60, 76, ...).

Every Hadamard size of LLaMA-like models is covered this way: 4096, 5120 (20 * 256), 11008 (5504 * 2, Paley I with
q = 5503), 13824 (108 * 128), 14336 (28 * 512), 18944 (148 * 128), 3072 and 384 (12 * 2**k). A size none of them gives
(every odd size above 1, 2 mod 4, and some multiples of 4 such as 668) raises ValueError naming it.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = [
    "hadamard_matrix",
    "random_hadamard_matrix",
    "block_hadamard_matrix",
    "hadamard_factor",
    "can_build_hadamard",
]


def _is_prime(q: int) -> bool:
    """Whether ``q`` is a prime (trial division; the sizes here are small)."""
    if q < 2:
        return False
    return all(q % d for d in range(2, math.isqrt(q) + 1))


def _base_construction(m: int) -> str | None:
    """Which construction builds a Hadamard matrix of size ``m`` directly: "sylvester", "paley1", "paley2" or None."""
    if m in (1, 2):
        return "sylvester"
    if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "paley1"
    if m % 4 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "paley2"
    return None


def hadamard_factor(n: int) -> tuple[int, str, int] | None:
    """How size ``n`` is built: ``(m, construction of m, 2**k)`` with ``n == m * 2**k`` and the smallest such ``m``
    that a construction gives; None when none does."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    odd, twos = n, 0
    while odd % 2 == 0:
        odd, twos = odd // 2, twos + 1
    for j in range(twos + 1):  # m = odd * 2**j, smallest first
        m = odd * 2**j
        construction = _base_construction(m)
        if construction is not None:
            return m, construction, n // m
    return None


def can_build_hadamard(n: int) -> bool:
    """Whether ``hadamard_matrix(n)`` can build size ``n``."""
    return hadamard_factor(n) is not None


def _buildable_near(n: int, count: int = 2) -> list[int]:
    """The ``count`` buildable sizes nearest ``n`` on each side, for errors."""
    below = [s for s in range(max(n - 1, 1), 0, -1) if can_build_hadamard(s)][:count]
    above, s = [], n + 1
    while len(above) < count:
        if can_build_hadamard(s):
            above.append(s)
        s += 1
    return sorted(below) + above


def _buildable_divisors(n: int) -> list[int]:
    """The divisors of ``n`` above 1 that are buildable sizes (candidates for ``rotation_size``)."""
    return [d for d in range(2, n) if n % d == 0 and can_build_hadamard(d)]


def _check_size(n: int) -> tuple[int, str, int]:
    """``hadamard_factor(n)``, or ValueError naming ``n``, what can be built and ``rotation_size``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"hadamard_matrix: n={n!r} must be a positive int")
    factor = hadamard_factor(n)
    if factor is None:
        divisors = _buildable_divisors(n)
        hint = (
            f"; or set RotationConfig.rotation_size to a buildable divisor of {n} (block-diagonal rotations), e.g. "
            f"{divisors[-3:]}"
            if divisors
            else ""
        )
        raise ValueError(
            f"hadamard_matrix: cannot build a Hadamard matrix of size n={n}: sizes built are m * 2**k with m = 1 "
            "(Sylvester), m = q + 1 for a prime q = 3 mod 4 (Paley I) or m = 2(q + 1) for a prime q = 1 mod 4 "
            f"(Paley II); buildable sizes near {n}: {_buildable_near(n)}{hint}"
        )
    return factor


def _quadratic_character(q: int) -> torch.Tensor:
    """``chi(a)`` for a = 0..q-1 mod the prime ``q``: 0 for 0, 1 for a nonzero square, -1 otherwise."""
    chi = -torch.ones(q, dtype=torch.int64)
    squares = (torch.arange(1, q, dtype=torch.int64) ** 2) % q
    chi[squares] = 1
    chi[0] = 0
    return chi


def _jacobsthal(q: int) -> torch.Tensor:
    """The Jacobsthal matrix ``Q[i, j] = chi(j - i)`` of the prime ``q``."""
    idx = torch.arange(q, dtype=torch.int64)
    return _quadratic_character(q)[(idx[None, :] - idx[:, None]) % q]


def _paley1(m: int) -> torch.Tensor:
    """Paley I, size ``m = q + 1`` (q prime, 3 mod 4): ``I + [[0, 1^T], [-1, Q]]`` (Q is antisymmetric), entries +-1."""
    q = m - 1
    s = torch.zeros(m, m, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(m, dtype=torch.int64)


def _paley2(m: int) -> torch.Tensor:
    """Paley II, size ``m = 2(q + 1)`` (q prime, 1 mod 4): the symmetric conference matrix ``C = [[0, 1^T], [1, Q]]``
    with each 0 replaced by ``[[1, -1], [-1, -1]]`` and each +-1 by ``+-[[1, 1], [1, -1]]``."""
    q = m // 2 - 1
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    plus = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    zero = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return torch.kron(c, plus) + torch.kron(torch.eye(q + 1, dtype=torch.int64), zero)


def _sylvester(n: int) -> torch.Tensor:
    """Sylvester's matrix of size ``n = 2**k``, entries +-1."""
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_BASE = {"sylvester": _sylvester, "paley1": _paley1, "paley2": _paley2}


@lru_cache(maxsize=16)
def _cached(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The orthonormal matrix of size ``n`` (cached per size, dtype and device; callers get a copy)."""
    m, construction, power = _check_size(n)
    small = _BASE[construction](m).to(torch.int8)  # the signs in one byte each: a size of 18944 takes 0.36 GB
    signs = torch.kron(small, _sylvester(power).to(torch.int8)) if power > 1 else small
    if dtype == torch.float64:
        return (signs.to(torch.float64) / math.sqrt(n)).to(device=device)
    return (signs.to(dtype) * (1.0 / math.sqrt(n))).to(device=device)


def hadamard_matrix(
    n: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """Orthonormal Hadamard matrix (``H @ H.T == I``, entries ``+-1/sqrt(n)``) of size ``n``.

    Sylvester for ``2**k``; else the Kronecker product of a Paley I / Paley II matrix of the smallest size ``m`` with
    ``n = m * 2**k`` and Sylvester's of size ``2**k``. Built in float64 and cast; cached per (n, dtype, device), each
    call returns its own copy (safe to modify or wrap in a Parameter).

    Args:
        n: The size.
        dtype: The dtype of the result.
        device: Its device (default: CPU).

    Returns:
        The ``[n, n]`` matrix.

    Raises:
        ValueError: When ``n`` cannot be built, naming it, the constructions, buildable sizes near it and (where one
            exists) a buildable divisor to use as ``RotationConfig.rotation_size``.
    """
    _check_size(n)
    return _cached(n, dtype, str(torch.device(device if device is not None else "cpu"))).clone()


def random_hadamard_matrix(
    n: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``diag(s) @ hadamard_matrix(n)`` with random signs ``s`` in {-1, +1} drawn from ``generator`` (CPU): still
    orthonormal, a different rotation per draw (SpinQuant's random Hadamard).

    Args:
        n: The size.
        generator: A CPU ``torch.Generator``; the same seed gives the same matrix.
        dtype: The dtype of the result.
        device: Its device (default: CPU).

    Returns:
        The ``[n, n]`` matrix.
    """
    h = hadamard_matrix(n, dtype=dtype, device=device)
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64) * 2 - 1
    return signs.to(dtype=dtype, device=h.device)[:, None] * h


def block_hadamard_matrix(
    n: int,
    block_size: int | None = None,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The ``[n, n]`` rotation made of ``n // block_size`` Hadamard blocks of size ``block_size`` on the diagonal
    (``block_size`` None: one block of size ``n``); random signs per block when ``generator`` is given.

    Raises:
        ValueError: When ``block_size`` does not divide ``n`` or cannot be built.
    """
    size = n if block_size is None else block_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
        raise ValueError(f"rotation_size={block_size!r} must be a positive int dividing the size {n}")
    blocks = [
        random_hadamard_matrix(size, generator, dtype=dtype, device=device)
        if generator is not None
        else hadamard_matrix(size, dtype=dtype, device=device)
        for _ in range(n // size)
    ]
    return blocks[0] if len(blocks) == 1 else torch.block_diag(*blocks)
