"""amd-quark 0.13's own import (``import_model_from_safetensors``) and transformers' ``from_pretrained`` (its quark
integration) of a rotated model's export (``export_quark_dir``: online R4 rotations, ``input_rotation``), against
this project's in-memory logits.

Run with the amd-quark venv, never the project venv (``tests/quark/rotation/test_rotation_amd_quark_live.py`` does
so):

    $AMD_QUARK_PYTHON bench/amd_quark_reference/check_rotated.py DIR

``DIR`` holds ``export/`` (the export directory) and ``reference.pt`` (``input_ids`` and ``logits``: this project's
quantized model's). Prints one line ``<amd-quark's import> <transformers' from_pretrained> <online-rotated layers>``:
the first two are ``max |logits - reference|`` or ``FAILED:<error>``, the last how many layers amd-quark's import
gave an online rotation.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QUARK_LOG_LEVEL", "error")
import torch  # noqa: E402
import transformers  # noqa: E402


def _failed(err: Exception) -> str:
    return "FAILED:" + f"{type(err).__name__}:{str(err).splitlines()[0][:120]}".replace(" ", "_")


def _rotated_layers(model: torch.nn.Module) -> int:
    return sum(type(m).__name__ == "QParamsLinearWithRotation" for m in model.modules())


def _amd_quark_import(path: Path, ids: torch.Tensor, expected: torch.Tensor) -> tuple[str, int]:
    from quark.torch import import_model_from_safetensors  # the wheel's (this script's folder is sys.path[0])

    config = transformers.AutoConfig.from_pretrained(str(path))
    config.quantization_config = None  # a float model of the architecture, as amd-quark's import takes it
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    try:
        model = import_model_from_safetensors(model, str(path), device="cpu")
        with torch.no_grad():
            return f"{float((model(input_ids=ids).logits - expected).abs().max()):.6g}", _rotated_layers(model)
    except Exception as err:  # noqa: BLE001 - reported, not a failure of this check
        return _failed(err), -1


def _from_pretrained(path: Path, ids: torch.Tensor, expected: torch.Tensor) -> str:
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()
        with torch.no_grad():
            return f"{float((model(input_ids=ids).logits - expected).abs().max()):.6g}"
    except Exception as err:  # noqa: BLE001 - reported, not a failure of this check
        return _failed(err)


def main(root: Path) -> int:
    ref = torch.load(root / "reference.pt")
    ids, expected = ref["input_ids"], ref["logits"]
    own, rotated = _amd_quark_import(root / "export", ids, expected)
    print(own, _from_pretrained(root / "export", ids, expected), rotated)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
