"""GPTQ's factorization without extra copies of the Hessian: ``prepare_accumulated`` takes an accumulator's matrix,
and a large Hessian waits in a temporary file while it is factorized (read back only for a retry). Both must give
the very factors ``prepare_hessian`` gives, retries included."""

from __future__ import annotations

import pytest
import torch

from quark.torch.algorithm import gptq
from quark.torch.algorithm.gptq import HessianAccumulator, prepare_accumulated, prepare_hessian


def _accumulator(columns: int = 48, seed: int = 0, dead: int | None = 5) -> HessianAccumulator:
    g = torch.Generator().manual_seed(seed)
    acc = HessianAccumulator(columns)
    x = torch.randn(4 * columns, columns, generator=g) * torch.linspace(0.1, 3.0, columns)
    if dead is not None:
        x[:, dead] = 0.0  # a dead input column: its diagonal is set to 1
    acc.add(x)
    return acc


def _same(a: gptq.InverseHessian, b: gptq.InverseHessian) -> None:
    assert torch.equal(a.perm, b.perm) and torch.equal(a.dead, b.dead) and a.damp == b.damp
    assert torch.equal(a.factor.contiguous().view(torch.int32), b.factor.contiguous().view(torch.int32))


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize("desc_act", [True, False])
def test_taken_hessian_gives_the_factors_of_a_copy(
    monkeypatch: pytest.MonkeyPatch, spill: bool, desc_act: bool
) -> None:
    monkeypatch.setattr(gptq, "SPILL_BYTES", 0 if spill else 2**62)
    acc = _accumulator()
    reference = prepare_hessian(acc.hessian.clone(), desc_act=desc_act)
    _same(prepare_accumulated(acc, desc_act=desc_act), reference)
    assert acc.hessian is None  # handed over, not copied
    with pytest.raises(RuntimeError, match="taken"):
        acc.add(torch.ones(2, 48))
    with pytest.raises(RuntimeError, match="already taken"):
        acc.take()


def test_prepare_hessian_leaves_the_callers_matrix_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gptq, "SPILL_BYTES", 0)
    h = _accumulator().hessian
    before = h.clone()
    prepare_hessian(h, desc_act=False)
    assert torch.equal(h, before)


def test_a_retry_after_the_hessian_was_spilled_reads_it_back_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second factorization fails once (after H went to the file): the retry with 10x the damping must be the
    factorization of H + 0.1 * mean(diag) I, exactly as if that damping had been asked for."""
    monkeypatch.setattr(gptq, "SPILL_BYTES", 0)
    acc = _accumulator(seed=1)
    expected = prepare_hessian(acc.hessian.clone(), damp_percent=0.1)
    spills: list[int] = []
    real_spilled, real_cholesky = gptq._Spilled, torch.linalg.cholesky
    failures = iter([True])

    class Counted(real_spilled):  # type: ignore[misc, valid-type]
        def __init__(self, tensor: torch.Tensor) -> None:
            spills.append(tensor.numel())
            super().__init__(tensor)

    def cholesky(a: torch.Tensor, *, upper: bool = False) -> torch.Tensor:
        if upper and next(failures, False):
            raise torch.linalg.LinAlgError("forced: the inverse is not positive definite")
        return real_cholesky(a, upper=upper)

    monkeypatch.setattr(gptq, "_Spilled", Counted)
    monkeypatch.setattr(torch.linalg, "cholesky", cholesky)
    result = prepare_accumulated(acc, damp_percent=0.01)
    assert spills == [48 * 48, 48 * 48]  # spilled at each attempt
    assert result.damp == pytest.approx(0.1)
    _same(result, expected)


def test_no_room_for_the_file_keeps_the_hessian_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gptq, "SPILL_BYTES", 0)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gptq.tempfile, "TemporaryFile", full)
    acc = _accumulator(seed=2)
    expected = prepare_hessian(acc.hessian.clone())
    _same(prepare_accumulated(acc), expected)


def test_gptq_quantize_without_hessian_or_inverse_is_refused() -> None:
    from quark.torch.algorithm.gptq import gptq_quantize

    spec = prepare_hessian  # any object: the check comes first
    with pytest.raises(ValueError, match="Hessian or its prepared inverse"):
        gptq_quantize(torch.ones(2, 4), None, spec)  # type: ignore[arg-type]
