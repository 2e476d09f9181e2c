"""Live cross-check with the public amd-quark 0.13 wheel: its own ``import_model_from_safetensors`` loads each of our
exports of the reference schemes and computes the logits of the model it quantized in memory, and so does
transformers' ``from_pretrained`` of the same directory (its quark integration). amd-quark's package
is also named ``quark``, so it lives in its own venv: the test runs when ``AMD_QUARK_PYTHON`` names that venv's
python (bench/amd_quark_reference/README.md says how to make it), and is skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quark.torch import ModelQuantizer, export_safetensors

AMD_PYTHON = os.environ.get("AMD_QUARK_PYTHON")
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not AMD_PYTHON, reason="set AMD_QUARK_PYTHON to an amd-quark 0.13 venv's python")


def test_amd_quark_loads_our_exports_and_computes_its_own_logits(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import test_quark_format as reference_schemes

    for scheme in reference_schemes.SCHEMES:
        ref = reference_schemes.reference(scheme)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # lm_head stays float: expected
            model = ModelQuantizer(reference_schemes.qconfig(scheme)).quantize_model(
                reference_schemes.tiny_llama(), [{"input_ids": ids} for ids in ref["calib"]]
            )
        export_safetensors(model, tmp_path / scheme)
    run = subprocess.run(
        [AMD_PYTHON, str(ROOT / "bench" / "amd_quark_reference" / "check_our_exports.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=900,
    )
    lines = [
        line.split()
        for line in run.stdout.splitlines()
        if line.split() and line.split()[0] in reference_schemes.SCHEMES
    ]
    assert run.returncode == 0 and len(lines) == len(reference_schemes.SCHEMES), run.stdout + run.stderr
    for scheme, in_memory, _, via_transformers in lines:
        assert float(in_memory) == 0.0, f"{scheme}: amd-quark's logits from our export differ by {in_memory}"
        assert float(via_transformers) == 0.0, (
            f"{scheme}: transformers' from_pretrained of our export differs by {via_transformers}"
        )
