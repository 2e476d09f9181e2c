"""Traced min / max reductions fold slices of a long row elementwise before reducing (``grouping._split_along``: it
makes inductor's CPU loop take independent loads instead of one dependent chain). Checked against torch's own eager
``amin`` / ``amax`` (an independent reference) through the compiled kernels: per row, per group and per tensor, row
lengths that split and that do not, rows whose extreme sits in each slice, NaN, infinities and signed zeros."""

from __future__ import annotations

import pytest
import torch

from quark.torch.quantization.formats import aminmax_along, minmax_all
from quark.torch.quantization.formats.grouping import REDUCE_SLICES, _split_along

SHAPES = [(8, 1024), (3, 256), (5, 260), (4, 255), (2, 4096), (6, 64), (1, 1)]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values, NaN where torch has NaN (a zero's sign may differ: min / max of -0.0 and 0.0 is either)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(got[keep], want[keep])


@pytest.mark.parametrize("shape", SHAPES)
def test_split_rows_match_torch(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    for op, reduce in ((torch.minimum, torch.amin), (torch.maximum, torch.amax)):
        folded = _split_along(x, 1, op)
        length = shape[1]
        assert folded.shape[1] == (length // REDUCE_SLICES if length >= 256 and length % REDUCE_SLICES == 0 else length)
        _same(reduce(folded, 1), reduce(x, 1))


def test_the_extreme_is_found_in_every_slice() -> None:
    """A row's minimum and maximum placed in each slice in turn (a fold that dropped a slice would miss them)."""
    length = 1024
    x = torch.zeros(length, length)
    rows = torch.arange(length)
    x[rows, rows] = 1.0 + rows.float()  # each row's maximum at its own position, across every slice
    x[rows, (rows + 512) % length] = -1.0 - rows.float()
    got_min, got_max = _split_along(x, 1, torch.minimum).amin(1), _split_along(x, 1, torch.maximum).amax(1)
    assert torch.equal(got_max, 1.0 + rows.float()) and torch.equal(got_min, -1.0 - rows.float())


def _special(shape: tuple[int, ...]) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(shape)
    flat = x.view(-1)
    flat[3] = float("nan")
    flat[-5] = float("inf")
    flat[flat.numel() // 2] = float("-inf")
    if x.ndim == 2 and x.shape[0] > 2:
        x[1] = 0.0
        x[1, ::3] = -0.0  # a row of signed zeros
        x[2] = float("nan")
    return x


@pytest.mark.parametrize("shape", [(8, 1024), (5, 260), (16, 512)])
def test_compiled_per_row_and_per_group_match_torch(compiled: None, shape: tuple[int, int]) -> None:
    x = _special(shape)
    mn, mx = aminmax_along(x, 1)
    _same(mn, x.amin(1))
    _same(mx, x.amax(1))
    groups = x.reshape(shape[0], -1, shape[1] // 4 if shape[1] % 4 == 0 else shape[1])
    gmn, gmx = aminmax_along(groups, -1)
    _same(gmn, groups.amin(-1))
    _same(gmx, groups.amax(-1))


@pytest.mark.parametrize("shape", [(32, 1024), (7, 13), (4096,)])
@pytest.mark.parametrize("special", [False, True])
def test_compiled_per_tensor_matches_torch(compiled: None, shape: tuple[int, ...], special: bool) -> None:
    torch.manual_seed(2)
    x = _special(shape) if special else torch.randn(shape)
    fn = torch.compile(minmax_all, dynamic=False, fullgraph=True)
    mn, mx = fn(x)
    want_mn, want_mx = torch.aminmax(x)
    _same(mn, want_mn)
    _same(mx, want_mx)
    # a transposed (non-contiguous) input is reduced as it is
    if x.ndim == 2:
        mn_t, mx_t = fn(x.t())
        _same(mn_t, want_mn)
        _same(mx_t, want_mx)
