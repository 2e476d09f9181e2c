"""Load the amd-quark 0.13 reference files produced by make_reference.py.

Only needs torch (works in the project venv).  ``load_reference("w8a8")`` returns one dict with
model_state, calib_batches, eval_batch, float_output (from reference_common.pt) merged with the
per-config data (qparams, output, config_description, ...).
"""

from __future__ import annotations

from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COMMON_FILE = "reference_common.pt"
CONFIG_NAMES = ("w8a8", "w8a8_uint8_asym", "w4_per_group", "fp8_e4m3", "a8_percentile", "a8_mse")


def load_common() -> dict:
    return torch.load(HERE / COMMON_FILE, weights_only=True)


def load_reference(name: str) -> dict:
    ref = torch.load(HERE / f"reference_{name}.pt", weights_only=True)
    common = load_common()
    for key in ("sha256_model_state", "sha256_calib_batches", "sha256_eval_batch"):
        if ref[key] != common[key]:
            raise ValueError(f"reference_{name}.pt and {COMMON_FILE} disagree on {key}; regenerate both.")
    merged = dict(common)
    merged.update(ref)
    return merged


if __name__ == "__main__":
    for n in CONFIG_NAMES:
        r = load_reference(n)
        print(n, {layer: sorted(roles) for layer, roles in r["qparams"].items()}, tuple(r["output"].shape))
