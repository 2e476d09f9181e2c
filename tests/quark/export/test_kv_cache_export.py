"""KV cache and attention probabilities in amd-quark 0.13's export directory, both ways, against the directories
amd-quark 0.13 wrote (bench/amd_quark_reference/exports/kv_*, make_export_reference.py's ``kv_schemes``: fp8 and
int8 KV caches pre-RoPE with kv_cache_group and min_kv_scale, fp8 softmax; amd-quark's post-RoPE cache fails on
transformers 5.24, see the README there): our import gives amd-quark's logits, our export of the same config is its
file byte for byte and its config.json; the k/v merge and the min_kv_scale floor against the model's own scales;
our own files re-import bit for bit, post-RoPE and softmax included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.export.quark_attention import kv_scale_groups
from quark.torch.quantization.config.config import (
    FP8E4M3PerTensorSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    QConfig,
    QLayerConfig,
    Uint8PerTensorSpec,
)
from quark.torch.quantization.tensor_quantize import FrozenScaledFakeQuantize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")

EXPORTS = Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference" / "exports"
FP8 = FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False).to_quantization_spec()
INT8_W = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
INT8_A = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
MIN_KV_SCALE = 0.00133  # make_export_reference.py's: raises layer 1's k/v scale


def kv_fields(weight, inputs, output, **extra) -> dict:
    """make_export_reference.py's ``kv_schemes`` (amd-quark's LLMTemplate layout), spelled with the same helpers."""
    entry = QLayerConfig(weight=weight, input_tensors=inputs, output_tensors=output)
    return {
        "global_quant_config": QLayerConfig(weight=weight, input_tensors=inputs),
        "layer_quant_config": {"*k_proj": entry, "*v_proj": entry},
        "kv_cache_quant_config": {"*k_proj": entry, "*v_proj": entry},
        "kv_cache_group": ["*k_proj", "*v_proj"],
        **extra,
    }


SCHEMES = {
    "kv_fp8": kv_fields(FP8, FP8, FP8, min_kv_scale=MIN_KV_SCALE),
    "kv_fp8_softmax_fp8": kv_fields(FP8, FP8, FP8, softmax_quant_spec=FP8),
    "kv_int8": kv_fields(INT8_W, INT8_A, INT8_A),
}


def tiny_llama(attn: str = "eager") -> nn.Module:
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
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def reference(scheme: str) -> dict:
    return torch.load(EXPORTS / scheme / "reference.pt")


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def quantized(scheme: str) -> nn.Module:
    calib = [{"input_ids": ids} for ids in reference(scheme)["calib"]]
    return ModelQuantizer(QConfig(**SCHEMES[scheme], exclude=["lm_head"])).quantize_model(tiny_llama(), calib)


def assert_amd_quarks_logits(logits: torch.Tensor, expected: torch.Tensor) -> None:
    """Same bits of weights and qparams, another process's float sums: at most a few ulps of the largest logit."""
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_our_import_of_amd_quarks_kv_export_gives_its_logits(scheme: str) -> None:
    ref = reference(scheme)
    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # every value must come from the directory
    model = import_model_from_safetensors(model, EXPORTS / scheme)
    with torch.no_grad():
        logits = model(input_ids=ref["eval_ids"]).logits
    # amd-quark's model after its export (k/v scales merged in place) is what its files describe
    assert_amd_quarks_logits(logits, ref["logits_after_export"])
    if ref["logits_reimported"] is not None:  # amd-quark re-imports the softmax scale on CUDA only
        assert_amd_quarks_logits(logits, ref["logits_reimported"])
    else:
        assert "CUDA" in ref["reimport_error"]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_our_kv_export_is_amd_quarks_file_and_config_json(scheme: str, tmp_path: Path) -> None:
    ref = reference(scheme)
    model = quantized(scheme)
    with torch.no_grad():
        assert_amd_quarks_logits(model(input_ids=ref["eval_ids"]).logits, ref["logits_quantized"])
    export_safetensors(model, tmp_path, custom_mode="quark")
    ours, theirs = tensors(tmp_path / "model.safetensors"), tensors(EXPORTS / scheme / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert "model.layers.1.self_attn.v_proj.output_scale" in ours
    assert ("model.layers.0.self_attn.prob_output_scale" in ours) == ("softmax" in scheme)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert written == json.loads((EXPORTS / scheme / "config.json").read_text())["quantization_config"]


def test_kv_cache_group_writes_max_of_k_v_and_min_kv_scale_and_warns_when_the_floor_wins(tmp_path: Path) -> None:
    model = quantized("kv_fp8")

    def scales() -> dict[tuple[int, str], float]:
        attns = [layer.self_attn for layer in model.model.layers]
        return {
            (i, p): float(getattr(a, p)._output_quantizer.calculate_qparams()[0])
            for i, a in enumerate(attns)
            for p in ("k_proj", "v_proj")
        }

    own = scales()
    expected = {i: max(own[i, "k_proj"], own[i, "v_proj"], MIN_KV_SCALE) for i in range(2)}
    assert expected[1] == MIN_KV_SCALE and expected[0] > MIN_KV_SCALE  # the fixture's floor bites one layer
    with pytest.warns(UserWarning, match=r"'model\.layers\.1\.self_attn' .* raised to min_kv_scale=0\.00133"):
        export_safetensors(model, tmp_path, custom_mode="quark")
    written = tensors(tmp_path / "model.safetensors")
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            value = written[f"model.layers.{i}.self_attn.{proj}.output_scale"]
            assert value.dtype == torch.float32 and value.shape == ()
            assert float(value) == pytest.approx(expected[i], rel=1e-7), (i, proj)
    assert scales() == own  # the model is left as it was


def test_without_a_group_or_with_quantized_global_outputs_each_scale_is_written_as_it_is(tmp_path: Path) -> None:
    fields = dict(SCHEMES["kv_fp8"], kv_cache_group=[], min_kv_scale=1.0)
    calib = [{"input_ids": ids} for ids in reference("kv_fp8")["calib"]]
    model = ModelQuantizer(QConfig(**fields, exclude=["lm_head"])).quantize_model(tiny_llama(), calib)
    export_safetensors(model, tmp_path / "a", custom_mode="quark")
    k = model.model.layers[0].self_attn.k_proj._output_quantizer.calculate_qparams()[0]
    assert torch.equal(tensors(tmp_path / "a" / "model.safetensors")["model.layers.0.self_attn.k_proj.output_scale"], k)


def test_kv_scale_groups_pair_names_as_amd_quarks_find_patterns_groups() -> None:
    names = ["a.0.k_proj", "a.0.v_proj", "a.1.k_proj", "b.k_proj", "a.0.q_proj"]
    assert kv_scale_groups(names, ["*k_proj", "*v_proj"]) == [
        ["a.0.k_proj", "a.0.v_proj"],
        ["a.1.k_proj"],
        ["b.k_proj"],
    ]
    assert kv_scale_groups(names, []) == []


@pytest.mark.parametrize("post_rope", [False, True], ids=["pre_rope", "post_rope"])
@pytest.mark.parametrize("custom_mode", ["quark", None], ids=["amd_quark_dir", "single_file"])
def test_our_kv_and_softmax_export_imports_back_bit_for_bit(post_rope: bool, custom_mode, tmp_path: Path) -> None:
    fields = dict(SCHEMES["kv_fp8_softmax_fp8"], kv_cache_post_rope=post_rope, kv_cache_group=[])  # no merge
    calib = [{"input_ids": ids} for ids in reference("kv_fp8")["calib"]]
    model = ModelQuantizer(QConfig(**fields, exclude=["lm_head"])).quantize_model(tiny_llama(), calib)
    model = ModelQuantizer.freeze(model)
    export_safetensors(model, tmp_path, custom_mode=custom_mode)
    back = import_model_from_safetensors(tiny_llama(), tmp_path)
    ids = reference("kv_fp8")["eval_ids"]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
    for ours, theirs in zip(model.model.layers, back.model.layers, strict=True):
        a, b = ours.self_attn, theirs.self_attn
        assert b.k_proj.output_applied_elsewhere is post_rope
        for q_a, q_b in ((a.k_proj, b.k_proj), (a.v_proj, b.v_proj), (a.attn_probs, b.attn_probs)):
            assert isinstance(q_b._output_quantizer, FrozenScaledFakeQuantize)
            assert torch.equal(
                q_b._output_quantizer.calculate_qparams()[0], q_a._output_quantizer.calculate_qparams()[0]
            )


def test_a_missing_probabilities_scale_is_named_before_the_model_is_touched(tmp_path: Path) -> None:
    source = EXPORTS / "kv_fp8_softmax_fp8"
    t = tensors(source / "model.safetensors")
    del t["model.layers.1.self_attn.prob_output_scale"]
    safetensors.torch.save_file(t, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.self_attn\.prob_output_scale'.*no such tensor"):
        import_model_from_safetensors(model, tmp_path)
    assert not hasattr(model.model.layers[0].self_attn, "attn_probs")


def test_uint8_probabilities_store_their_scale_only_and_need_zero_point_0(tmp_path: Path) -> None:
    calib = [{"input_ids": ids} for ids in reference("kv_fp8")["calib"]]
    for symmetric, ok in ((False, True), (True, False)):  # uint8 symmetric has zero point 128
        spec = Uint8PerTensorSpec(symmetric=symmetric).to_quantization_spec()
        config = QConfig(global_quant_config=QLayerConfig(weight=FP8), softmax_quant_spec=spec, exclude=["lm_head"])
        model = ModelQuantizer(config).quantize_model(tiny_llama(), calib)
        if ok:
            export_safetensors(model, tmp_path, custom_mode="quark")
            written = tensors(tmp_path / "model.safetensors")
            probs = model.model.layers[0].self_attn.attn_probs._output_quantizer
            assert torch.equal(written["model.layers.0.self_attn.prob_output_scale"], probs.calculate_qparams()[0])
            assert not any("prob_output_zero_point" in k for k in written)
        else:
            with pytest.raises(ValueError, match=r"attn_probs'.*zero point 128.*scale only"):
                export_safetensors(model, tmp_path / "sym", custom_mode="quark")


def test_inherit_roles_exports_each_kv_layers_own_config_under_its_name(tmp_path: Path) -> None:
    config = QConfig(
        global_quant_config=QLayerConfig(weight=FP8, input_tensors=FP8),
        kv_cache_quant_config={
            "*k_proj": QLayerConfig(output_tensors=FP8),
            "*v_proj": QLayerConfig(output_tensors=FP8),
        },
        inherit_roles=True,
        exclude=["lm_head"],
    )
    calib = [{"input_ids": ids} for ids in reference("kv_fp8")["calib"]]
    model = ModelQuantizer(config).quantize_model(tiny_llama(), calib)
    export_safetensors(model, tmp_path, custom_mode="quark")
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    entry = written["kv_cache_quant_config"]["model.layers.0.self_attn.k_proj"]
    assert entry["weight"]["dtype"] == "fp8_e4m3" and entry["output_tensors"]["dtype"] == "fp8_e4m3"
    back = import_model_from_safetensors(tiny_llama(), tmp_path)
    ids = reference("kv_fp8")["eval_ids"]
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, ModelQuantizer.freeze(model)(input_ids=ids).logits)
