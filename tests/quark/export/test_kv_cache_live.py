"""Live cross-check of the KV-cache exports with the public amd-quark 0.13 wheel (its own venv, named by
``AMD_QUARK_PYTHON``; skipped otherwise): amd-quark's ``import_model_from_safetensors`` and transformers'
``from_pretrained`` of our exports of ``kv_fp8`` and ``kv_int8`` compute the logits of amd-quark's model after its own
export. ``kv_fp8_softmax_fp8`` is left out: amd-quark 0.13 imports a probabilities' scale on CUDA only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quark.torch import export_safetensors

AMD_PYTHON = os.environ.get("AMD_QUARK_PYTHON")
ROOT = Path(__file__).resolve().parents[3]
SCHEMES = ("kv_fp8", "kv_int8")

pytestmark = [
    pytest.mark.skipif(not AMD_PYTHON, reason="set AMD_QUARK_PYTHON to an amd-quark 0.13 venv's python"),
    pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*"),
    pytest.mark.filterwarnings("ignore:.*raised to min_kv_scale.*"),
]


def test_amd_quark_and_transformers_load_our_kv_exports_to_amd_quarks_logits(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import test_kv_cache_export as kv

    for scheme in SCHEMES:
        export_safetensors(kv.quantized(scheme), tmp_path / scheme, custom_mode="quark")
    run = subprocess.run(
        [AMD_PYTHON, str(ROOT / "bench" / "amd_quark_reference" / "check_our_exports.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=900,
    )
    lines = [line.split() for line in run.stdout.splitlines() if line.split() and line.split()[0] in SCHEMES]
    assert run.returncode == 0 and len(lines) == len(SCHEMES), run.stdout + run.stderr
    for scheme, in_memory, reimported, via_transformers in lines:
        assert float(in_memory) == 0.0 and float(reimported) == 0.0, f"{scheme}: {in_memory}, {reimported}"
        assert float(via_transformers) == 0.0, f"{scheme}: transformers' from_pretrained differs by {via_transformers}"
