"""Live check with the public amd-quark 0.13 wheel (its own venv, named by ``AMD_QUARK_PYTHON``; skipped otherwise):
transformers' ``from_pretrained`` (its quark integration) loads a sharded streamed export
(``stream_quantize``: several shards + ``model.safetensors.index.json``) to the same logits as the single-file export
of the same model, and both to the logits of this project's in-memory quantized model; amd-quark's own
``import_model_from_safetensors`` reads the sharded directory to those logits too
(``bench/amd_quark_reference/check_sharded.py`` prints the figures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir
from quark.torch.streaming import stream_quantize

AMD_PYTHON = os.environ.get("AMD_QUARK_PYTHON")
ROOT = Path(__file__).resolve().parents[3]

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not AMD_PYTHON, reason="set AMD_QUARK_PYTHON to an amd-quark 0.13 venv's python"),
    pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant"),
    pytest.mark.integration,
]


def test_transformers_loads_a_sharded_export_as_the_single_file(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_sharded_import import VOCAB, W4_GPTQ, calibration, tiny_llama

    tiny_llama().save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    stream_quantize(
        tmp_path / "ckpt",
        W4_GPTQ,
        calibration(),
        tmp_path / "sharded",
        max_shard_bytes=6000,
        attn_implementation="sdpa",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="sdpa").eval()
    ModelQuantizer(W4_GPTQ).quantize_model(model, calibration())
    export_quark_dir(model, tmp_path / "single")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.save({"input_ids": ids, "logits": model(input_ids=ids).logits}, tmp_path / "reference.pt")
    run = subprocess.run(
        [AMD_PYTHON, str(ROOT / "bench" / "amd_quark_reference" / "check_sharded.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    shards, sharded_vs_single, sharded_vs_ours, single_vs_ours, amd_quark = run.stdout.split()
    assert int(shards) >= 4
    assert float(sharded_vs_single) == 0.0 and float(sharded_vs_ours) == 0.0 and float(single_vs_ours) == 0.0
    assert not amd_quark.startswith("FAILED") and float(amd_quark) == 0.0, f"amd-quark's import: {amd_quark}"
