"""Export directories written by the public ``amd-quark`` 0.13 ``export_safetensors``, kept as evidence of its format.

Run with the amd-quark venv (see README.md here), never the project venv:

    /tmp/aqref/venv/bin/python bench/amd_quark_reference/make_export_reference.py [scheme ...]

For each scheme, a tiny ``LlamaForCausalLM`` (random weights from a seeded transformers config, no download) is
quantized by amd-quark's ``ModelQuantizer`` and exported to ``exports/<scheme>/`` (``config.json`` with its
``quantization_config`` and ``model.safetensors``). ``exports/<scheme>/reference.pt`` holds the calibration and eval
token batches and the logits amd-quark computed on the eval batch: from the quantized model in memory
(``logits_quantized``) and from its own re-import of the directory (``logits_reimported``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]  # AMD's quark, not ours
os.environ.setdefault("QUARK_LOG_LEVEL", "warning")

import torch  # noqa: E402
import transformers  # noqa: E402

import quark  # noqa: E402

if "site-packages" not in (quark.__file__ or ""):
    raise SystemExit(f"Imported quark from {quark.__file__!r}; run with the amd-quark venv (see README.md)")

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors  # noqa: E402
from quark.torch.quantization.config.config import (  # noqa: E402
    FP8E4M3PerTensorSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    OCP_MXFP4Spec,
    QConfig,
    QLayerConfig,
    Uint4PerGroupSpec,
)

OUT = HERE / "exports"


def tiny_llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def schemes() -> dict[str, QLayerConfig]:
    int8_w = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
    int8_a = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
    fp8 = FP8E4M3PerTensorSpec().to_quantization_spec()
    mxfp4 = OCP_MXFP4Spec(ch_axis=-1).to_quantization_spec()
    mxfp4_w = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()  # 0.13's import refuses dynamic weights
    return {
        "w8a8_int8": QLayerConfig(weight=int8_w, input_tensors=int8_a),
        "w8a8_fp8": QLayerConfig(weight=fp8, input_tensors=fp8),
        "w_uint4_g32": QLayerConfig(weight=Uint4PerGroupSpec(ch_axis=1, group_size=32).to_quantization_spec()),
        "w_mxfp4_a_mxfp4": QLayerConfig(weight=mxfp4_w, input_tensors=mxfp4),
    }


def main(names: list[str]) -> None:
    torch.manual_seed(1)
    calib = [torch.randint(0, 256, (4, 16)) for _ in range(4)]
    torch.manual_seed(2)
    eval_ids = torch.randint(0, 256, (2, 16))
    for name, qlayer in schemes().items():
        if names and name not in names:
            continue
        model = tiny_llama()
        config = QConfig(global_quant_config=qlayer, exclude=["lm_head"])
        model = ModelQuantizer(config).quantize_model(model, [{"input_ids": ids} for ids in calib])
        with torch.no_grad():
            logits_quantized = model(input_ids=eval_ids).logits
        target = OUT / name
        shutil.rmtree(target, ignore_errors=True)
        export_safetensors(model, target)
        reimported = import_model_from_safetensors(tiny_llama(), str(target))
        with torch.no_grad():
            logits_reimported = reimported(input_ids=eval_ids).logits
        torch.save(
            {"calib": calib, "eval_ids": eval_ids, "logits_quantized": logits_quantized,
             "logits_reimported": logits_reimported, "amd_quark": "0.13",
             "torch": str(torch.__version__), "transformers": str(transformers.__version__)},
            target / "reference.pt",
        )  # fmt: skip
        files = sorted(p.name for p in target.iterdir())
        diff = float((logits_quantized - logits_reimported).abs().max())
        print(f"{name}: {files}; re-import max |logits diff| {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1:])
