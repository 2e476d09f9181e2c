"""Export directories written by the public ``amd-quark`` 0.13 ``export_safetensors``, kept as evidence of its format.

Run with the amd-quark venv (see README.md here), never the project venv:

    /tmp/aqref/venv/bin/python bench/amd_quark_reference/make_export_reference.py [scheme ...]

For each scheme, a tiny ``LlamaForCausalLM`` (random weights from a seeded transformers config, no download) is
quantized by amd-quark's ``ModelQuantizer`` and exported to ``exports/<scheme>/`` (``config.json`` with its
``quantization_config`` and ``model.safetensors``). ``exports/<scheme>/reference.pt`` holds the calibration and eval
token batches and the logits amd-quark computed on the eval batch: from the quantized model in memory
(``logits_quantized``) and from its own re-import of the directory (``logits_reimported``).

The KV-cache schemes (``kv_schemes``) run the model with ``attn_implementation="eager"`` (the softmax quantizer needs
it) and also keep ``logits_after_export``: the in-memory model after ``export_safetensors``, which merges the k/v scales
of ``kv_cache_group`` (with ``min_kv_scale``) into the model as it writes them. Where amd-quark cannot re-import its
own export (the softmax scale on a CPU-only torch) ``logits_reimported`` is None and ``reimport_error`` says why; a
scheme amd-quark cannot quantize or export (post-RoPE on transformers 5.24) is printed and not kept.
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
    FP8E4M3PerChannelSpec,
    FP8E4M3PerTensorSpec,
    Int4PerChannelSpec,
    Int8PerChannelSpec,
    Int8PerGroupSpec,
    Int8PerTensorSpec,
    OCP_MXFP4Spec,
    OCP_MXFP6E2M3Spec,
    OCP_MXFP6E3M2Spec,
    OCP_MXFP8E4M3Spec,
    QConfig,
    QLayerConfig,
    Uint4PerGroupSpec,
    Uint8PerChannelSpec,
    Uint8PerTensorSpec,
)

OUT = HERE / "exports"


def tiny_llama(attn_implementation: str | None = None) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def schemes() -> dict[str, QLayerConfig | dict]:
    """Scheme name -> the global QLayerConfig, or a dict of QConfig fields (per-layer entries)."""
    int8_w = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
    int8_a = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
    fp8 = FP8E4M3PerTensorSpec().to_quantization_spec()
    uint4_g32 = Uint4PerGroupSpec(ch_axis=1, group_size=32).to_quantization_spec()

    def mx(helper: type) -> QLayerConfig:  # 0.13's import refuses dynamic weights: static weights, dynamic inputs
        return QLayerConfig(
            weight=helper(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
            input_tensors=helper(ch_axis=-1).to_quantization_spec(),
        )

    return {
        "w8a8_int8": QLayerConfig(weight=int8_w, input_tensors=int8_a),
        "w8a8_fp8": QLayerConfig(weight=fp8, input_tensors=fp8),
        "w_uint4_g32": QLayerConfig(weight=uint4_g32),
        "w_mxfp4_a_mxfp4": mx(OCP_MXFP4Spec),
        "w_mxfp6e3m2_a_mxfp6e3m2": mx(OCP_MXFP6E3M2Spec),
        "w_mxfp6e2m3_a_mxfp6e2m3": mx(OCP_MXFP6E2M3Spec),
        "w_mxfp8e4m3_a_mxfp8e4m3": mx(OCP_MXFP8E4M3Spec),
        "w8a8_int8_dynamic": QLayerConfig(
            weight=int8_w, input_tensors=Int8PerTensorSpec(symmetric=True, is_dynamic=True).to_quantization_spec()
        ),
        "w8a8_uint8_asym": QLayerConfig(
            weight=Uint8PerChannelSpec(ch_axis=0, symmetric=False).to_quantization_spec(),
            input_tensors=Uint8PerTensorSpec(symmetric=False).to_quantization_spec(),
        ),
        "w_int4_per_channel": QLayerConfig(weight=Int4PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()),
        "w_int8_g32": QLayerConfig(
            weight=Int8PerGroupSpec(ch_axis=1, group_size=32, symmetric=True).to_quantization_spec()
        ),
        "w_fp8_per_channel_a_fp8": QLayerConfig(
            weight=FP8E4M3PerChannelSpec(ch_axis=0).to_quantization_spec(), input_tensors=fp8
        ),
        # a layer_quant_config entry replaces the whole config: down_proj gets uint4 weights and no input quantizer
        "w8a8_int8_down_proj_w_uint4": {
            "global_quant_config": QLayerConfig(weight=int8_w, input_tensors=int8_a),
            "layer_quant_config": {"*down_proj": QLayerConfig(weight=uint4_g32)},
        },
    }


#: the k/v scale floor of ``kv_fp8``: between the two layers' k/v scales of the seeded model (1.3283e-3, 1.3762e-3),
#: so layer 1 is raised to it (amd-quark warns) and layer 0 keeps max(k, v)
MIN_KV_SCALE = 0.00133


def kv_schemes() -> dict[str, dict]:
    """Scheme name -> QConfig fields with a KV cache (amd-quark's LLMTemplate layout: each kv pattern has the same
    entry in layer_quant_config and kv_cache_quant_config, the layer's weight and input specs plus the k/v output)."""
    fp8 = FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False).to_quantization_spec()
    int8_w = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
    int8_a = Int8PerTensorSpec(symmetric=True).to_quantization_spec()

    def kv(weight: object, inputs: object, output: object, **extra: object) -> dict:
        entry = QLayerConfig(weight=weight, input_tensors=inputs, output_tensors=output)
        return {
            "global_quant_config": QLayerConfig(weight=weight, input_tensors=inputs),
            "layer_quant_config": {"*k_proj": entry, "*v_proj": entry},
            "kv_cache_quant_config": {"*k_proj": entry, "*v_proj": entry},
            "kv_cache_group": ["*k_proj", "*v_proj"],
            **extra,
        }

    return {
        "kv_fp8": kv(fp8, fp8, fp8, min_kv_scale=MIN_KV_SCALE),
        "kv_fp8_softmax_fp8": kv(fp8, fp8, fp8, softmax_quant_spec=fp8),
        "kv_int8": kv(int8_w, int8_a, int8_a),
        "kv_fp8_post_rope": kv(fp8, fp8, fp8, kv_cache_post_rope=True),
    }


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def main(names: list[str]) -> None:
    torch.manual_seed(1)
    calib = [torch.randint(0, 256, (4, 16)) for _ in range(4)]
    torch.manual_seed(2)
    eval_ids = torch.randint(0, 256, (2, 16))
    plain = {
        name: (qlayer if isinstance(qlayer, dict) else {"global_quant_config": qlayer}, None)
        for name, qlayer in schemes().items()
    }
    kv = {name: (fields, "eager") for name, fields in kv_schemes().items()}
    for name, (fields, attn) in {**plain, **kv}.items():
        if names and name not in names:
            continue
        config = QConfig(**fields, exclude=["lm_head"])
        target = OUT / name
        shutil.rmtree(target, ignore_errors=True)
        try:
            model = ModelQuantizer(config).quantize_model(tiny_llama(attn), [{"input_ids": ids} for ids in calib])
            with torch.no_grad():
                logits_quantized = model(input_ids=eval_ids).logits
            export_safetensors(model, target)
            with torch.no_grad():
                logits_after_export = model(input_ids=eval_ids).logits
        except Exception as err:  # noqa: BLE001 - a scheme amd-quark cannot export is reported, not kept
            shutil.rmtree(target, ignore_errors=True)
            print(f"{name}: amd-quark 0.13 fails: {_first_line(err)}")
            continue
        logits_reimported, reimport_error = None, None
        try:
            reimported = import_model_from_safetensors(tiny_llama(attn), str(target))
            with torch.no_grad():
                logits_reimported = reimported(input_ids=eval_ids).logits
        except Exception as err:  # noqa: BLE001 - kept for the KV schemes: the export itself is the evidence
            if attn is None:
                shutil.rmtree(target, ignore_errors=True)
                print(f"{name}: amd-quark 0.13 fails: {_first_line(err)}")
                continue
            reimport_error = _first_line(err)
        record = {
            "calib": calib,
            "eval_ids": eval_ids,
            "logits_quantized": logits_quantized,
            "logits_reimported": logits_reimported,
            "amd_quark": "0.13",
            "torch": str(torch.__version__),
            "transformers": str(transformers.__version__),
        }
        if attn is not None:
            record.update(
                attn_implementation=attn, logits_after_export=logits_after_export, reimport_error=reimport_error
            )
        torch.save(record, target / "reference.pt")
        files = sorted(p.name for p in target.iterdir())
        if logits_reimported is None:
            print(f"{name}: {files}; amd-quark's own re-import fails: {reimport_error}")
        else:
            diff = float((logits_quantized - logits_reimported).abs().max())
            print(f"{name}: {files}; re-import max |logits diff| {diff:.3g}")


if __name__ == "__main__":
    main(sys.argv[1:])
