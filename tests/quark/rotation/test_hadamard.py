"""Hadamard matrices: orthonormal with entries +-1/sqrt(n) for every size built up to 1024 and the sizes of real
LLaMA-likes; Sylvester's against scipy's; the sizes refused name n and rotation_size."""

import math

import pytest
import torch
from scipy.linalg import hadamard as scipy_hadamard

from quark.torch.algorithm.rotation.hadamard import (
    block_hadamard_matrix,
    can_build_hadamard,
    hadamard_factor,
    hadamard_matrix,
    random_hadamard_matrix,
)

#: the multiples of 4 up to 1024 that Sylvester x Paley I/II does not build (Hadamard matrices exist for them, by
#: other constructions such as Williamson's)
NOT_BUILT_UP_TO_1024 = [
    52, 92, 100, 116, 156, 172, 184, 188, 232, 236, 244, 260, 268, 292, 324, 340, 344, 356, 372, 376, 404, 412, 428,
    436, 452, 472, 476, 508, 520, 532, 536, 580, 584, 596, 604, 612, 652, 668, 680, 688, 712, 716, 724, 732, 756, 764,
    772, 808, 836, 852, 856, 872, 876, 892, 904, 932, 940, 944, 952, 956, 964, 980, 988, 996, 1004, 1012, 1016,
]  # fmt: skip
BUILT = [n for n in range(1, 1025) if can_build_hadamard(n)]


def _assert_hadamard(h: torch.Tensor, n: int) -> None:
    assert h.shape == (n, n)
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(n)), rtol=0, atol=1e-12)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=h.dtype), rtol=0, atol=1e-10)


def test_which_sizes_up_to_1024_are_built():
    # a Hadamard matrix exists only for 1, 2 and multiples of 4: every size built is one, and only the listed
    # multiples of 4 are missing
    assert all(n in (1, 2) or n % 4 == 0 for n in BUILT)
    assert [n for n in range(4, 1025, 4) if n not in BUILT] == NOT_BUILT_UP_TO_1024
    assert len(BUILT) == 2 + 256 - len(NOT_BUILT_UP_TO_1024)


def test_every_size_built_up_to_1024_is_orthonormal_hadamard():
    for n in BUILT:
        _assert_hadamard(hadamard_matrix(n), n)


@pytest.mark.parametrize("k", range(11))
def test_sylvester_matches_scipy(k):
    n = 2**k
    assert hadamard_factor(n) == (1, "sylvester", n)
    assert torch.equal(hadamard_matrix(n) * math.sqrt(n), torch.from_numpy(scipy_hadamard(n)).double())


@pytest.mark.parametrize(
    ("n", "factor"),
    [
        (12, (12, "paley1", 1)),  # q = 11
        (28, (28, "paley2", 1)),  # q = 13
        (192, (12, "paley1", 16)),
        (384, (12, "paley1", 32)),
        (3072, (12, "paley1", 256)),
        (5120, (20, "paley1", 256)),  # q = 19
        (11008, (5504, "paley1", 2)),  # q = 5503
        (13824, (108, "paley1", 128)),  # q = 107
        (14336, (28, "paley2", 512)),
        (18944, (148, "paley2", 128)),  # q = 73
    ],
)
def test_factorisation_of_known_sizes(n, factor):
    assert hadamard_factor(n) == factor


def _assert_rows_orthonormal(h: torch.Tensor, n: int, rows: int = 48) -> None:
    """Entries +-1/sqrt(n) everywhere; rows drawn at random orthonormal to every row."""
    assert h.shape == (n, n)
    assert float((h.abs() * math.sqrt(n) - 1).abs().max()) < 1e-5
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:rows]
    gram = h.double() @ h[idx].double().T
    assert torch.allclose(gram, torch.eye(n, dtype=torch.float64)[:, idx], atol=1e-5)


@pytest.mark.parametrize("n", [192, 384, 3072, 4096, 5120])
def test_llama_sizes(n):
    _assert_rows_orthonormal(hadamard_matrix(n, dtype=torch.float32), n)


@pytest.mark.slow
@pytest.mark.parametrize("n", [8192, 11008, 13824, 14336, 18944])
def test_large_llama_sizes(n):
    _assert_rows_orthonormal(hadamard_matrix(n, dtype=torch.float32), n)


@pytest.mark.slow
def test_paley1_5504_fully_orthonormal():  # the factor of 11008
    _assert_hadamard(hadamard_matrix(5504), 5504)


def test_refused_size_names_n_and_rotation_size():
    with pytest.raises(ValueError, match=r"n=668.*Paley.*near 668: \[660, 664, 672, 676\].*rotation_size"):
        hadamard_matrix(668)
    with pytest.raises(ValueError, match="n=6"):
        hadamard_matrix(6)
    with pytest.raises(ValueError, match="positive int"):
        hadamard_matrix(0)


def test_cached_result_is_a_copy():
    h = hadamard_matrix(16)
    h.zero_()
    _assert_hadamard(hadamard_matrix(16), 16)


def test_dtype_and_device():
    h = hadamard_matrix(12, dtype=torch.float32, device="cpu")
    assert h.dtype == torch.float32 and h.device.type == "cpu"
    assert torch.allclose(h.double(), hadamard_matrix(12), atol=1e-7)


def test_random_hadamard_is_signed_rows_of_hadamard():
    h = hadamard_matrix(20)
    r1 = random_hadamard_matrix(20, torch.Generator().manual_seed(3))
    r2 = random_hadamard_matrix(20, torch.Generator().manual_seed(3))
    r3 = random_hadamard_matrix(20, torch.Generator().manual_seed(4))
    assert torch.equal(r1, r2) and not torch.equal(r1, r3)
    signs = (r1 / h)[:, 0]
    assert set(signs.round().tolist()) <= {-1.0, 1.0}
    assert torch.allclose(r1, signs[:, None] * h)
    assert torch.allclose(r1 @ r1.T, torch.eye(20, dtype=torch.float64), atol=1e-12)


def test_block_hadamard():
    b = block_hadamard_matrix(48, 12)
    assert torch.equal(b, torch.block_diag(*[hadamard_matrix(12)] * 4))
    assert torch.equal(block_hadamard_matrix(12), hadamard_matrix(12))
    with pytest.raises(ValueError, match="rotation_size=5 must be a positive int dividing the size 48"):
        block_hadamard_matrix(48, 5)
