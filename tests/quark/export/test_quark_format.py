"""amd-quark 0.13's export directory both ways, against directories amd-quark 0.13 itself wrote
(bench/amd_quark_reference/exports, made by make_export_reference.py from a tiny LLaMA with random weights):
our import reproduces the logits amd-quark computed, and our export of the same model and config is the same
safetensors file, key by key, dtype by dtype, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.export.quark_format import from_quark_dict, pack_int4, to_quark_dict, unpack_int4
from quark.torch.quantization.config.config import (
    FP8E4M3PerTensorSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    MX6Spec,
    OCP_MXFP4Spec,
    QConfig,
    QLayerConfig,
    Uint4PerGroupSpec,
)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
save_file = pytest.importorskip("safetensors.torch").save_file

EXPORTS = Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference" / "exports"
FP8 = FP8E4M3PerTensorSpec().to_quantization_spec()
SCHEMES = {  # the configs make_export_reference.py gave amd-quark, spelled with the same helpers
    "w8a8_int8": QLayerConfig(weight=Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec(),
                              input_tensors=Int8PerTensorSpec(symmetric=True).to_quantization_spec()),
    "w8a8_fp8": QLayerConfig(weight=FP8, input_tensors=FP8),
    "w_uint4_g32": QLayerConfig(weight=Uint4PerGroupSpec(ch_axis=1, group_size=32).to_quantization_spec()),
    "w_mxfp4_a_mxfp4": QLayerConfig(weight=OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
                                    input_tensors=OCP_MXFP4Spec(ch_axis=-1).to_quantization_spec()),
}  # fmt: skip


def tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def reference(scheme: str) -> dict:
    return torch.load(EXPORTS / scheme / "reference.pt")


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_our_import_of_amd_quarks_export_gives_its_logits(scheme: str) -> None:
    ref = reference(scheme)
    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # every value must come from the directory
    with pytest.warns(UserWarning, match="stay float"):
        model = import_model_from_safetensors(model, EXPORTS / scheme)
    with torch.no_grad():
        logits = model(input_ids=ref["eval_ids"]).logits
    assert torch.equal(logits, ref["logits_reimported"])


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_our_export_is_amd_quarks_file_byte_for_byte(scheme: str, tmp_path: Path) -> None:
    ref = reference(scheme)
    config = QConfig(global_quant_config=SCHEMES[scheme], exclude=["lm_head"])
    with pytest.warns(UserWarning, match="stay float"):
        model = ModelQuantizer(config).quantize_model(tiny_llama(), [{"input_ids": ids} for ids in ref["calib"]])
    path = export_safetensors(model, tmp_path, custom_mode="quark")
    ours, theirs = tensors(path), tensors(EXPORTS / scheme / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    written = json.loads((tmp_path / "config.json").read_text())
    amd = json.loads((EXPORTS / scheme / "config.json").read_text())
    assert written["quantization_config"] == amd["quantization_config"]
    assert written["hidden_size"] == amd["hidden_size"] and written["num_key_value_heads"] == amd["num_key_value_heads"]


def test_amd_quark_config_round_trips_to_ours() -> None:
    amd = json.loads((EXPORTS / "w_mxfp4_a_mxfp4" / "config.json").read_text())["quantization_config"]
    config, export = from_quark_dict(amd)
    assert export["pack_method"] == "reorder"
    weight = config.global_quant_config.weight
    assert (weight.dtype.name, weight.mx_element_dtype.name, weight.mx_scale_mode) == ("mx", "fp4", "even")
    assert to_quark_dict(config) == amd


def test_int4_packing_follows_amd_quarks_nibble_order() -> None:
    codes = torch.arange(8).reshape(1, 8)
    assert int(pack_int4(codes, "reorder")) == 0x75316420  # nibble i holds element (0, 2, 4, 6, 1, 3, 5, 7)[i]
    assert int(pack_int4(codes, "order")) == 0x76543210
    assert int(pack_int4(torch.tensor([[-8, 0, 0, 0, 0, 0, 0, -1]]), "order")) == -0x0FFFFFF8  # 0xF0000008 as int32
    torch.manual_seed(0)
    signed = torch.randint(-8, 8, (5, 37))
    for method in ("reorder", "order"):
        assert torch.equal(unpack_int4(pack_int4(signed, method), 37, True, method), signed.to(torch.int32))


def test_a_format_amd_quark_cannot_hold_is_refused_by_name(tmp_path: Path) -> None:
    config = QConfig(global_quant_config=QLayerConfig(weight=MX6Spec(ch_axis=-1, block_size=16).to_quantization_spec()))
    model = ModelQuantizer(config).quantize_model(nn.Sequential(nn.Linear(32, 8)), [torch.randn(2, 32)])
    with pytest.raises(ValueError, match=r"layer '0': mx6 per_group weights have no amd-quark 0.13 layout here; supported"):
        export_safetensors(model, tmp_path, custom_mode="quark")
    with pytest.raises(ValueError, match=r"custom_mode='awq'; allowed: 'quark'"):
        export_safetensors(model, tmp_path, custom_mode="awq")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda t: t.pop("model.layers.0.mlp.down_proj.weight_scale"), r"tensor 'model.layers.0.mlp.down_proj.weight_scale' is missing"),
        (lambda t: t.__setitem__("model.layers.1.self_attn.q_proj.input_scale", torch.tensor(0.0)),
         r"'model.layers.1.self_attn.q_proj.input_scale': expected finite scales > 0, found min 0.0"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64, dtype=torch.int16)),
         r"'model.layers.0.self_attn.k_proj.weight': expected \['torch.int8', 'torch.uint8'\] of shape \[32, 64\], found torch.int16"),
        (lambda t: t.__setitem__("model.extra", torch.zeros(1)), r"tensors the model has no place for: \['model.extra'\]"),
    ],
)  # fmt: skip
def test_a_damaged_directory_is_refused_before_the_model_changes(tamper, message: str, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(EXPORTS / "w8a8_int8", tmp_path, dirs_exist_ok=True)
    stored = tensors(tmp_path / "model.safetensors")
    tamper(stored)
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        import_model_from_safetensors(model, tmp_path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and set(before) == set(model.state_dict())
