"""amd-quark 0.13's own ``import_model_from_safetensors`` on directories this project exported.

Run with the amd-quark venv (see README.md here), never the project venv:

    /tmp/aqref/venv/bin/python bench/amd_quark_reference/check_our_exports.py DIR

``DIR/<scheme>/`` are our exports of the schemes in ``exports/`` (the same tiny LLaMA, config and calibration batches;
``tests/quark/export/test_amd_quark_live.py`` writes them). For each, prints one line
``<scheme> <max |logits - amd-quark's in-memory logits|> <max |logits - amd-quark's re-import of its own export|>
<the same as the first, for transformers' ``AutoModelForCausalLM.from_pretrained(DIR/<scheme>)``>`` (the Hugging Face
quark integration, which uses amd-quark)
and exits with status 1 if any scheme does not load. For the KV-cache schemes (``kv_*``: the model in eager attention)
"in-memory" is amd-quark's model after its export (``logits_after_export``: the k/v scales merged, as the files hold
them), and the re-import column is ``nan`` where amd-quark could not re-import its own export.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QUARK_LOG_LEVEL", "error")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# make_export_reference (imported below, before quark) keeps this repo off sys.path and accepts only the wheel's quark
import torch  # noqa: E402
import transformers  # noqa: E402
from make_export_reference import tiny_llama  # noqa: E402

from quark.torch import import_model_from_safetensors  # noqa: E402


def main(root: Path) -> int:
    failed = 0
    for target in sorted(p for p in root.iterdir() if p.is_dir()):
        ref = torch.load(HERE / "exports" / target.name / "reference.pt")
        attn = ref.get("attn_implementation")
        expected = ref.get("logits_after_export", ref["logits_quantized"])
        try:
            model = import_model_from_safetensors(tiny_llama(attn), str(target))
        except Exception as err:  # noqa: BLE001 - reported per scheme
            print(f"{target.name} FAILED {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            failed += 1
            continue
        with torch.no_grad():
            logits = model(input_ids=ref["eval_ids"]).logits
        in_memory = float((logits - expected).abs().max())
        own = ref["logits_reimported"]
        reimported = float("nan") if own is None else float((logits - own).abs().max())
        kwargs = {"attn_implementation": attn} if attn else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(target), **kwargs).eval()  # the quark integration
        with torch.no_grad():
            via_hf = float((hf(input_ids=ref["eval_ids"]).logits - expected).abs().max())
        print(f"{target.name} {in_memory:.6g} {reimported:.6g} {via_hf:.6g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
