"""PTQ quality on the digits CNN: accuracy of each recipe against FP32 (train once, quantize copies).

python bench/ptq_digits.py
"""

from __future__ import annotations

import copy
import time

from torch.utils.data import DataLoader

from quark.torch import ModelQuantizer
from quark_lightning.tasks.digits import accuracy, train_digits_cnn
from quark_lightning.tasks.recipes import RECIPES, recipe

#: accuracy points a recipe may lose against FP32 (None: reported only)
BUDGET = {"w8a8_int8": 0.5, "w4_int4_g32": 2.0, "w8a8_fp8_e4m3": 0.5, "mxfp4": None}


def run(epochs: int = 12, calib_batches: int = 8) -> dict[str, float]:
    """Accuracy (%) of FP32 and of every recipe on the test split."""
    model, train, test = train_digits_cnn(epochs=epochs)
    results = {"fp32": accuracy(model, test)}
    calib = DataLoader(train, batch_size=64, shuffle=False)
    for name in RECIPES:
        quantized = ModelQuantizer(recipe(name)).quantize_model(copy.deepcopy(model), calib, max_batches=calib_batches)
        results[name] = accuracy(ModelQuantizer.freeze(quantized), test)
    return results


def main() -> None:
    t0 = time.perf_counter()
    results = run()
    fp32 = results["fp32"]
    print("| recipe | test accuracy % | drop (points) | budget |")
    print("|---|---|---|---|")
    for name, acc in results.items():
        budget = BUDGET.get(name)
        verdict = "" if budget is None else f"<= {budget}: {'met' if fp32 - acc <= budget else 'MISSED'}"
        print(f"| {name} | {acc:.2f} | {fp32 - acc:+.2f} | {verdict} |")
    print(f"({time.perf_counter() - t0:.0f} s, digits test split of 360 images)")


if __name__ == "__main__":
    main()
