"""Benchmarks (``python bench/<name>.py``); what several of them share."""

from __future__ import annotations


def as_a_long_run() -> None:
    """Time the steps of a long training run: auto compile mode compiles the format kernels once a run that tells
    nothing of its length has counted ``Backend.payback_numel`` elements, far more than a bench's few hundred timed
    steps, so the bench counts as past that point (the kernels compile after the usual warm-up)."""
    from quark.torch.quantization.formats import Backend

    Backend.payback_numel = 0
