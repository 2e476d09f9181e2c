"""transformers' ``from_pretrained`` (its quark integration, with amd-quark 0.13 installed) of a sharded export
(``stream_quantize``'s shards + ``model.safetensors.index.json``) against the single-file export of the same model.

Run with the amd-quark venv, never the project venv (``tests/quark/export/test_sharded_import_live.py`` does so):

    $AMD_QUARK_PYTHON bench/amd_quark_reference/check_sharded.py DIR

``DIR`` holds ``single/`` (one ``model.safetensors``), ``sharded/`` (shards and the index) and ``reference.pt``
(``input_ids`` and ``logits``: this project's in-memory quantized model's). Prints one line
``<shards> <max |sharded - single|> <max |sharded - reference|> <max |single - reference|> <amd-quark's own import>``
where the last column is ``max |amd-quark's import_model_from_safetensors(sharded) - reference|`` or ``FAILED:<error>``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QUARK_LOG_LEVEL", "error")
import torch  # noqa: E402
import transformers  # noqa: E402


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _amd_quark_import(path: Path, ids: torch.Tensor, expected: torch.Tensor) -> str:
    from quark.torch import import_model_from_safetensors  # the wheel's (this script's folder is sys.path[0])

    config = transformers.AutoConfig.from_pretrained(str(path))
    config.quantization_config = None  # a float model of the architecture, as amd-quark's import takes it
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    try:
        model = import_model_from_safetensors(model, str(path), device="cpu")
        with torch.no_grad():
            return f"{float((model(input_ids=ids).logits - expected).abs().max()):.6g}"
    except Exception as err:  # noqa: BLE001 - reported, not a failure of this check
        return "FAILED:" + f"{type(err).__name__}:{str(err).splitlines()[0][:120]}".replace(" ", "_")


def main(root: Path) -> int:
    ref = torch.load(root / "reference.pt")
    ids, expected = ref["input_ids"], ref["logits"]
    sharded, single = _logits(root / "sharded", ids), _logits(root / "single", ids)
    shards = len(list((root / "sharded").glob("model-*-of-*.safetensors")))
    diffs = [(sharded - single), (sharded - expected), (single - expected)]
    own = _amd_quark_import(root / "sharded", ids, expected)
    print(shards, *(f"{float(d.abs().max()):.6g}" for d in diffs), own)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
