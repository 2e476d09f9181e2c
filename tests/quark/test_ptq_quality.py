"""End-to-end PTQ quality on the digits CNN: each recipe stays within its accuracy budget against FP32."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # trains a CNN (~45 s on 2 cores)


def test_recipes_stay_within_their_accuracy_budgets() -> None:
    from bench.ptq_digits import BUDGET, run

    results = run()
    fp32 = results["fp32"]
    assert fp32 > 95.0  # the float model learned the task, so the drops below mean something
    for name, budget in BUDGET.items():
        assert name in results
        if budget is not None:
            assert fp32 - results[name] <= budget, (name, results)
