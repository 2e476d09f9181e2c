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
    BFP16Spec,
    FP8E4M3PerChannelSpec,
    FP8E4M3PerTensorSpec,
    Int4PerChannelSpec,
    Int8PerChannelSpec,
    Int8PerGroupSpec,
    Int8PerTensorSpec,
    OCP_MXFP4Spec,
    OCP_MXFP6E2M3Spec,
    OCP_MXFP6E3M2Spec,
    QConfig,
    QLayerConfig,
    Uint4PerGroupSpec,
    Uint8PerChannelSpec,
    Uint8PerTensorSpec,
)
from quark.torch.quantization.nn.modules import QuantMixin

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
save_file = pytest.importorskip("safetensors.torch").save_file

EXPORTS = Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference" / "exports"
FP8 = FP8E4M3PerTensorSpec().to_quantization_spec()
INT8_W = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
INT8_A = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
UINT4_G32 = Uint4PerGroupSpec(ch_axis=1, group_size=32).to_quantization_spec()


def _mx(helper: type) -> QLayerConfig:
    return QLayerConfig(
        weight=helper(ch_axis=-1, is_dynamic=False).to_quantization_spec(),
        input_tensors=helper(ch_axis=-1).to_quantization_spec(),
    )


SCHEMES = {  # the configs make_export_reference.py gave amd-quark, spelled with the same helpers
    "w8a8_int8": QLayerConfig(weight=INT8_W, input_tensors=INT8_A),
    "w8a8_fp8": QLayerConfig(weight=FP8, input_tensors=FP8),
    "w_uint4_g32": QLayerConfig(weight=UINT4_G32),
    "w_mxfp4_a_mxfp4": _mx(OCP_MXFP4Spec),
    "w_mxfp6e3m2_a_mxfp6e3m2": _mx(OCP_MXFP6E3M2Spec),
    "w_mxfp6e2m3_a_mxfp6e2m3": _mx(OCP_MXFP6E2M3Spec),
    "w8a8_int8_dynamic": QLayerConfig(
        weight=INT8_W, input_tensors=Int8PerTensorSpec(symmetric=True, is_dynamic=True).to_quantization_spec()
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
        weight=FP8E4M3PerChannelSpec(ch_axis=0).to_quantization_spec(), input_tensors=FP8
    ),
    # amd-quark's rule: the down_proj entry replaces the global config (uint4 weights, inputs not quantized)
    "w8a8_int8_down_proj_w_uint4": {
        "global_quant_config": QLayerConfig(weight=INT8_W, input_tensors=INT8_A),
        "layer_quant_config": {"*down_proj": QLayerConfig(weight=UINT4_G32)},
    },
}


def qconfig(scheme: str) -> QConfig:
    fields = SCHEMES[scheme] if isinstance(SCHEMES[scheme], dict) else {"global_quant_config": SCHEMES[scheme]}
    return QConfig(**fields, exclude=["lm_head"])


def tiny_llama() -> nn.Module:
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
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def reference(scheme: str) -> dict:
    return torch.load(EXPORTS / scheme / "reference.pt")


def assert_amd_quarks_logits(logits: torch.Tensor, ref: dict) -> None:
    """Our logits against those amd-quark computed in its own process (``reference.pt``, made once on another
    machine): the weights and qparams are the same bits, the float32 sums are another run's (CPU kernels, thread
    count), so they may differ in the last bits; 1e-5 of the largest logit is far below any quantization step."""
    expected = ref["logits_reimported"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))


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
    assert_amd_quarks_logits(logits, ref)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_our_export_is_amd_quarks_file_byte_for_byte(scheme: str, tmp_path: Path) -> None:
    ref = reference(scheme)
    config = qconfig(scheme)
    with pytest.warns(UserWarning, match="stay float"):
        model = ModelQuantizer(config).quantize_model(tiny_llama(), [{"input_ids": ids} for ids in ref["calib"]])
    path = export_safetensors(model, tmp_path, custom_mode="quark")
    ours, theirs = tensors(path), tensors(EXPORTS / scheme / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    float_weights = tiny_llama().state_dict()
    for key, value in theirs.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        if not torch.equal(ours[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)):
            assert_only_ties_differ(
                float_weights[key], ours[key], value, theirs[key + "_scale"], theirs[key + "_zero_point"]
            )
    written = json.loads((tmp_path / "config.json").read_text())
    amd = json.loads((EXPORTS / scheme / "config.json").read_text())
    assert written["quantization_config"] == amd["quantization_config"]
    assert written["hidden_size"] == amd["hidden_size"] and written["num_key_value_heads"] == amd["num_key_value_heads"]


def assert_only_ties_differ(
    w: torch.Tensor, ours: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor
) -> None:
    """amd-quark's exporter stores ``round(w / s + zp)`` (the sum rounded to float32 first) where its simulation,
    ours and torch's kernels compute ``round(w / s) + zp``: the two part ways where ``w / s + zp`` lands on a
    float32 tie. Our file holds the codes the simulated model used; each file must follow its own formula exactly,
    and they may differ only in a handful of codes, by one."""
    v = w.float() * (1.0 / scale.float()).reshape(-1, 1)  # per channel, axis 0: the only asymmetric reference
    z = zp.to(torch.int32).reshape(-1, 1)
    assert torch.equal(ours.to(torch.int32), (torch.round(v) + z).clamp(0, 255).to(torch.int32))
    assert torch.equal(theirs.to(torch.int32), torch.round(v + z).clamp(0, 255).to(torch.int32))
    differ = ours.to(torch.int32) != theirs.to(torch.int32)
    assert int(differ.sum()) <= 4


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
    config = QConfig(global_quant_config=QLayerConfig(weight=BFP16Spec(ch_axis=-1).to_quantization_spec()))
    model = ModelQuantizer(config).quantize_model(nn.Sequential(nn.Linear(32, 8)), [torch.randn(2, 32)])
    with pytest.raises(
        ValueError,
        match=r"layer '0' \(weight\): bfp16 per_group weights have no amd-quark style layout; supported.*custom_mode=None",
    ):
        export_safetensors(model, tmp_path, custom_mode="quark")
    with pytest.raises(ValueError, match=r"custom_mode='awq'; allowed: 'quark'"):
        export_safetensors(model, tmp_path, custom_mode="awq")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            lambda t: t.pop("model.layers.0.mlp.down_proj.weight_scale"),
            r"tensor 'model.layers.0.mlp.down_proj.weight_scale' is missing",
        ),
        (
            lambda t: t.__setitem__("model.layers.1.self_attn.q_proj.input_scale", torch.tensor(0.0)),
            r"'model.layers.1.self_attn.q_proj.input_scale': expected finite scales > 0, found min 0.0",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64, dtype=torch.int16)),
            r"'model.layers.0.self_attn.k_proj.weight': expected \['torch.int8'\] of shape \[32, 64\], found torch.int16",
        ),
        (
            lambda t: t.__setitem__("model.extra", torch.zeros(1)),
            r"tensor 'model.extra': expected only tensors of the model and of its quantized layers",
        ),
    ],
)
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
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and set(before) == set(
        model.state_dict()
    )


# ----------------------------------------------------------------------------------------------- our extensions
class ConvNet(nn.Module):
    """A conv and two Linear layers of widths that divide every block size used below."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def _spec(**kw: object) -> object:
    from quark.torch.quantization.config.config import QuantizationSpec

    base = {
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
    }
    return QuantizationSpec(**(base | kw))


EXTENSIONS = {  # formats amd-quark 0.13 does not export, in the same layout rules
    "int3_per_channel": lambda: {
        "weight": _spec(dtype="int3", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")
    },
    "uint4_per_tensor_asym": lambda: {"weight": _spec(dtype="uint4", qscheme="per_tensor", symmetric=False)},
    "int4_per_channel_conv": lambda: {
        "weight": _spec(dtype="int4", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")
    },
    "int12_w_int16_a": lambda: {
        "weight": _spec(dtype="int12", qscheme="per_tensor"),
        "input_tensors": _spec(dtype="int16", qscheme="per_tensor"),
    },
    "fp8_per_block": lambda: {
        "weight": _spec(
            dtype="fp8_e4m3", qscheme="per_block", block_size=[16, 16], observer_cls="PerBlock2DMinMaxObserver"
        )
    },
    "int8_per_block_e8m0": lambda: {
        "weight": _spec(
            dtype="int8",
            qscheme="per_block",
            block_size=[16, 32],
            observer_cls="PerBlock2DMinMaxObserver",
            scale_type="float8_e8m0fnu",
        )
    },
    "mxfp8_e4m3": lambda: {
        "weight": _spec(
            dtype="mx",
            mx_element_dtype="fp8_e4m3",
            qscheme="per_group",
            ch_axis=-1,
            group_size=32,
            observer_cls="PerBlockMXObserver",
        )
    },
    "mxint8": lambda: {
        "weight": _spec(
            dtype="mx",
            mx_element_dtype="int8",
            qscheme="per_group",
            ch_axis=-1,
            group_size=32,
            observer_cls="PerBlockMXObserver",
        )
    },
    "mx6": lambda: {
        "weight": _spec(
            dtype="mx6",
            qscheme="per_group",
            ch_axis=-1,
            group_size=16,
            observer_cls="PerBlockMXObserver",
            symmetric=None,
            scale_type=None,
        )
    },
    "mx9": lambda: {
        "weight": _spec(
            dtype="mx9",
            qscheme="per_group",
            ch_axis=-1,
            group_size=16,
            observer_cls="PerBlockMXObserver",
            symmetric=None,
            scale_type=None,
        )
    },
    "fp6_e3m2_per_tensor": lambda: {"weight": _spec(dtype="fp6_e3m2", qscheme="per_tensor")},
    "fp4_per_channel": lambda: {
        "weight": _spec(dtype="fp4", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")
    },
    "bf16": lambda: {
        "weight": _spec(
            dtype="bfloat16", qscheme=None, observer_cls=None, symmetric=None, round_method=None, scale_type=None
        )
    },
}


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_extended_formats_round_trip_through_the_directory(name: str, tmp_path: Path) -> None:
    from quark.torch.quantization.config.config import QuantizationConfig

    roles = EXTENSIONS[name]()
    needs_2d = name.startswith(("fp8_per_block", "int8_per_block", "mx", "fp6", "uint4", "int12"))
    conv = QuantizationConfig(
        weight=_spec(dtype="int8", qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver")
    )
    config = QConfig(
        global_quant_config=QuantizationConfig(**roles), layer_type_quant_config={"Conv2d": conv} if needs_2d else {}
    )
    torch.manual_seed(0)
    x = torch.randn(4, 3, 4, 4)
    model = ModelQuantizer(config).quantize_model(ConvNet().eval(), [x])
    expected = ModelQuantizer.freeze(model)(x)
    export_safetensors(model, tmp_path)  # custom_mode="quark" is the default, as in amd-quark
    stored = tensors(tmp_path / "model.safetensors")
    assert "fc1.weight" in stored and stored["fc1.weight"].dtype != torch.float32
    fresh = ConvNet()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    restored = import_model_from_safetensors(fresh, tmp_path)
    assert torch.equal(restored(x), expected)


def test_inherit_roles_is_written_as_amd_quarks_per_layer_entries(tmp_path: Path) -> None:
    from quark.torch.quantization.config.config import QuantizationConfig

    int4 = Int4PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
    config = QConfig(
        global_quant_config=QLayerConfig(weight=INT8_W, input_tensors=INT8_A),
        layer_quant_config={"fc2": QuantizationConfig(weight=int4)},
        inherit_roles=True,
    )
    torch.manual_seed(0)
    x = torch.randn(4, 3, 4, 4)
    model = ModelQuantizer(config).quantize_model(ConvNet().eval(), [x])
    assert model.fc2._input_quantizer is not None  # inherited from global
    expected = ModelQuantizer.freeze(model)(x)
    export_safetensors(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fc2 = written["layer_quant_config"]["fc2"]
    assert (
        fc2["weight"]["dtype"] == "int4" and fc2["input_tensors"]["dtype"] == "int8"
    )  # complete, as amd-quark reads it
    assert written["layer_type_quant_config"] == {} and "inherit_roles" not in written
    assert torch.equal(import_model_from_safetensors(ConvNet(), tmp_path)(x), expected)


def test_per_group_fp8_has_no_layout_and_nothing_is_written(tmp_path: Path) -> None:
    from quark.torch.quantization.config.config import FP8E4M3PerGroupSpec

    spec = FP8E4M3PerGroupSpec(ch_axis=1, group_size=32).to_quantization_spec()
    model = ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=spec))).quantize_model(
        nn.Sequential(nn.Linear(64, 8)), [torch.randn(2, 64)]
    )
    with pytest.raises(ValueError, match=r"layer '0' \(weight\): fp8_e4m3 per_group .*custom_mode=None"):
        export_safetensors(model, tmp_path)
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------- skeletons, device=
def test_model_none_builds_the_hf_skeleton_from_config_json_and_gives_amd_quarks_logits() -> None:
    ref = reference("w8a8_int8")
    model = import_model_from_safetensors(None, EXPORTS / "w8a8_int8", device="cpu")
    assert not any(p.device.type == "meta" for p in model.parameters())
    with torch.no_grad():
        assert_amd_quarks_logits(model(input_ids=ref["eval_ids"]).logits, ref)


def test_a_parameters_on_meta_skeleton_is_filled_and_keeps_its_computed_buffers() -> None:
    from quark.torch.export.skeleton import parameters_on_meta

    ref = reference("w_uint4_g32")
    with parameters_on_meta():
        skeleton = tiny_llama()
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    inv_freq = skeleton.model.rotary_emb.inv_freq.clone()  # non-persistent: not in any checkpoint
    with pytest.warns(UserWarning, match="stay float"):
        model = import_model_from_safetensors(skeleton, EXPORTS / "w_uint4_g32", device="cpu")
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)
    with torch.no_grad():
        assert_amd_quarks_logits(model(input_ids=ref["eval_ids"]).logits, ref)


def test_a_fully_meta_model_names_the_buffer_it_cannot_recover() -> None:
    with torch.device("meta"):
        model = tiny_llama()
    with pytest.raises(ValueError, match=r"buffer\(s\) \['model.rotary_emb.inv_freq'.*parameters_on_meta"):
        import_model_from_safetensors(model, EXPORTS / "w8a8_int8")
    with pytest.raises(ValueError, match="multi_device / multi_gpu loading is not supported"):
        import_model_from_safetensors(tiny_llama(), EXPORTS / "w8a8_int8", multi_device=True)


class WithSpare(ConvNet):
    """A quantized head that no forward reaches (an MoE expert no calibration batch was routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(4, 4)


@pytest.mark.filterwarnings("ignore:.*no forward reached.*")
@pytest.mark.parametrize("frozen", [False, True])
def test_a_layer_no_calibration_reached_is_exported_float_and_excluded(frozen: bool, tmp_path: Path) -> None:
    config = QConfig(global_quant_config=QLayerConfig(weight=INT8_W, input_tensors=INT8_A))
    torch.manual_seed(0)
    x = torch.randn(4, 3, 4, 4)
    model = ModelQuantizer(config).quantize_model(WithSpare().eval(), [x])
    spare_weight = model.spare.weight.detach().clone()
    if frozen:
        with pytest.warns(UserWarning, match="run in float"):
            ModelQuantizer.freeze(model)
    with pytest.warns(UserWarning, match=r"exported in float and excluded .*\['spare'\]"):
        export_safetensors(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert "spare" in written["exclude"]
    stored = tensors(tmp_path / "model.safetensors")
    assert torch.equal(stored["spare.weight"], spare_weight) and "spare.input_scale" not in stored
    assert stored["fc1.weight"].dtype == torch.int8 and "fc1.input_scale" in stored
    restored = import_model_from_safetensors(WithSpare(), tmp_path)
    assert not isinstance(restored.spare, QuantMixin) and isinstance(restored.fc1, QuantMixin)
    assert torch.equal(restored.spare.weight, spare_weight)
    if not frozen:
        with pytest.warns(UserWarning, match="run in float"):
            ModelQuantizer.freeze(model)
    assert torch.equal(restored(x), model(x))


@pytest.mark.parametrize("custom_mode", ["quark", None])
def test_a_tied_lm_head_kept_float_is_stored_once(custom_mode: str | None, tmp_path: Path) -> None:
    """GPT-2 ties its lm_head to the input embedding; with the head excluded both names hold one float tensor. Before,
    safetensors refused to write two names sharing memory; now it is stored once (as save_pretrained does) and the
    import ties it back."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)

    def make():  # noqa: ANN202
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=32)
        ).eval()

    model = make()
    ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=INT8_W), exclude=["lm_head"])).quantize_model(
        model, None
    )
    ModelQuantizer.freeze(model)
    path = export_safetensors(model, tmp_path, custom_mode=custom_mode)
    assert "lm_head.weight" not in tensors(path) and "transformer.wte.weight" in tensors(path)
    restored = import_model_from_safetensors(None if custom_mode else make(), tmp_path)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():  # amd-quark's layout stores a weight's scale as amd-quark does: float noise at most
        assert torch.allclose(restored(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    assert restored.lm_head.weight is restored.transformer.wte.weight


def test_a_classifier_built_from_its_config_reimports_as_itself(tmp_path: Path) -> None:
    """Models built with a constructor have ``config.architectures`` None; the export writes the class (as
    save_pretrained does) so ``model=None`` builds the classifier, not a language-model head."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config).eval()
    ModelQuantizer(QConfig(global_quant_config=QLayerConfig(weight=INT8_W))).quantize_model(model, None)
    ModelQuantizer.freeze(model)
    export_safetensors(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertForSequenceClassification"]
    assert model.config.architectures is None  # the model's own config is left as it was
    restored = import_model_from_safetensors(None, tmp_path)
    assert type(restored).__name__ == "BertForSequenceClassification"
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.allclose(restored(ids).logits, model(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("method", ["reorder", "order"])
def test_pack_int4_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Large weights are packed a few rows at a time (bounded int64 temporaries): the same words as one pass."""
    from quark.torch.export import packing

    codes = torch.randint(-8, 8, (3, 37, 45), generator=torch.Generator().manual_seed(0))
    whole = packing.pack_int4(codes, method)
    monkeypatch.setattr(packing, "PACK_CHUNK", 100)  # 2 rows of 45 per chunk
    chunked = packing.pack_int4(codes, method)
    assert chunked.shape == whole.shape == (3, 37, 6) and torch.equal(chunked, whole)
    assert torch.equal(packing.unpack_int4(chunked, 45, True, method), codes.to(torch.int32))
