"""Live check with the public amd-quark 0.13 wheel (its own venv, named by ``AMD_QUARK_PYTHON``; skipped otherwise):
amd-quark's own ``import_model_from_safetensors`` of our export directory of a rotated (R1, R2, R4), int4-weight
quantized tiny HF LLaMA gives every down_proj its online rotation and computes our logits
(``bench/amd_quark_reference/check_rotated.py`` prints the figures). Two cases amd-quark applies as we do: R4 of a
power-of-two size in one block (amd-quark builds Sylvester's matrix itself) and R4 in blocks of ``rotation_size``
(amd-quark reads our stored signs); and a learned rotation (``trainable=True``) with R4 of 192 inputs in one block
(amd-quark applies our stored float block, whatever its size).

The tolerance is float noise (1e-5 on logits of about 1), not 0 as in the other live checks: amd-quark applies a
Hadamard rotation by its butterfly (``matmul_hadU``) or a block matmul, we by one matmul with the [in, in] matrix.
transformers' ``from_pretrained`` is not checked: with amd-quark 0.13 it fails on any rotated export
(``QParamsLinearWithRotation`` has no ``transform``: its integration never calls ``post_process_after_loading``)."""

from __future__ import annotations

import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from rot_models import WEIGHT, plain_llama

from quark.torch import ModelQuantizer
from quark.torch.export.quark_format import export_quark_dir
from quark.torch.quantization.config.config import Config

AMD_PYTHON = os.environ.get("AMD_QUARK_PYTHON")
ROOT = Path(__file__).resolve().parents[3]
VOCAB = 128
TOLERANCE = 1e-5

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not AMD_PYTHON, reason="set AMD_QUARK_PYTHON to an amd-quark 0.13 venv's python"),
    pytest.mark.integration,
]


def _rotated(intermediate: int, rotation_size: int | None, trainable: bool) -> torch.nn.Module:
    rotation = {"name": "rotation", "r1": True, "r2": True, "r4": True, "rotation_size": rotation_size}
    if trainable:  # learned R1 / R2 (two steps); R4 stays Hadamard, stored as a float block amd-quark applies as is
        rotation |= {"trainable": True, "train_steps": 2}
    config = Config.from_dict({"global_quant_config": {"weight": WEIGHT}, "algo_config": [rotation]})
    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(0, VOCAB, (2, 12), generator=g)} for _ in range(2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*stay float.*")
        warnings.filterwarnings("ignore", ".*rotation training.*")
        return ModelQuantizer.freeze(ModelQuantizer(config).quantize_model(plain_llama(intermediate), calib))


@pytest.mark.parametrize(
    ("intermediate", "rotation_size", "trainable"), [(128, None, False), (192, 64, False), (192, None, True)]
)
def test_amd_quark_imports_a_rotated_export_to_our_logits(
    tmp_path: Path, intermediate, rotation_size, trainable
) -> None:
    model = _rotated(intermediate, rotation_size, trainable)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "amd-quark 0.13 will not apply" warning for these
        warnings.filterwarnings("ignore", ".*stay float.*")
        export_quark_dir(model, tmp_path / "export")
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.save({"input_ids": ids, "logits": model(input_ids=ids).logits}, tmp_path / "reference.pt")
    run = subprocess.run(
        [AMD_PYTHON, str(ROOT / "bench" / "amd_quark_reference" / "check_rotated.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    amd_quark, _, rotated = run.stdout.split()
    assert int(rotated) == 2, f"amd-quark gave {rotated} layers an online rotation (expected both down_projs)"
    assert not amd_quark.startswith("FAILED") and float(amd_quark) <= TOLERANCE, f"amd-quark's import: {amd_quark}"
