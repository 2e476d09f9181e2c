"""A weight Parameter shared by two QUANTIZED layers (two Linear layers holding one ``weight``; a Hugging Face model
with ``tie_word_embeddings`` whose input embedding is quantized too) re-imports bit for bit from both safetensors
exports, and ONNX stores each layer's codes.

Before the fix, each layer's decoded weight was written into the one shared Parameter in turn (the last one won)
and every holder got a quantizer that re-quantized whatever it held: with two different quantized versions of the
tensor (int8 per channel in one layer, int4 per group or int8 per tensor in the other) the first layer computed with
the second's values re-quantized, and re-quantizing stored bfp16 values moved blocks.

The references are the exporting model's own quantized weights and outputs, and the quantized weights computed here
with torch's ``fake_quantize_per_channel_affine`` from the model's float weight and calibrated scales."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_onnx, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize

pytest.importorskip("safetensors")

warnings.filterwarnings("ignore", message=".*TracerWarning.*")

MODES = {"directory": "quark", "single_file": None}
TIED_LOGGER = "quark.torch.export.tied"


def _spec(**kw: Any) -> QuantizationSpec:
    base = {
        "observer_cls": "PerTensorMinMaxObserver",
        "symmetric": True,
        "is_dynamic": False,
        "round_method": "half_even",
        "scale_type": "float",
        "qscheme": "per_tensor",
    }
    return QuantizationSpec(**(base | kw))


def _per_channel(dtype: str, **kw: Any) -> QuantizationSpec:
    return _spec(dtype=dtype, qscheme="per_channel", ch_axis=0, observer_cls="PerChannelMinMaxObserver", **kw)


def _per_group(dtype: str, **kw: Any) -> QuantizationSpec:
    return _spec(
        dtype=dtype, qscheme="per_group", ch_axis=1, group_size=32, observer_cls="PerGroupMinMaxObserver", **kw
    )


INT8_ACT = _spec(dtype="int8")
INT8_PC = _per_channel("int8")


class _TwoTied(nn.Module):
    """Two Linear layers of one shape holding one ``weight`` Parameter (biases their own)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _inputs() -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


def _quantized(b_weight: QuantizationSpec | None, bake: bool = False, round_method: str = "half_even") -> nn.Module:
    """``_TwoTied`` with int8 per-channel weights and int8 inputs; ``b_weight``: layer b's weight spec instead
    (``layer_quant_config``). Calibrated and frozen."""
    model = _TwoTied()
    layers = {} if b_weight is None else {"b": QuantizationConfig(weight=b_weight, input_tensors=INT8_ACT)}
    config = Config(
        global_quant_config=QuantizationConfig(
            weight=_per_channel("int8", round_method=round_method), input_tensors=INT8_ACT
        ),
        layer_quant_config=layers,
    )
    ModelQuantizer(config).quantize_model(model, [_inputs()])
    return ModelQuantizer.freeze(model, bake_weights=bake)


def _round_trip(model: nn.Module, tmp_path: Path, mode: str, fresh: nn.Module) -> nn.Module:
    path = export_safetensors(model, tmp_path, custom_mode=MODES[mode])
    return import_model_from_safetensors(fresh, tmp_path, filename=path.name)


def _effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight the layer computes with: its weight quantizer's output."""
    with torch.no_grad():
        return layer._weight_quantizer(layer.weight).clone()


def _torch_int8_per_channel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """torch's own int8 per-channel fake quantization (half to even), the independent reference."""
    zero = torch.zeros(scale.shape, dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(weight.detach(), scale.detach().float(), zero, 0, -128, 127)


def _torch_int4_per_group(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """torch's fake quantization of each group of ``group`` inputs as one channel (int4: -8..7)."""
    out, inp = weight.shape
    rows = weight.detach().reshape(out * inp // group, group)
    flat = scale.detach().float().reshape(-1)
    zero = torch.zeros(flat.shape, dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(rows, flat, zero, 0, -8, 7).reshape(out, inp)


def _assert_same_outputs(restored: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        expected, got = model(x), restored(x)
    assert torch.equal(got, expected), f"max diff {float((got - expected).abs().max())}"


# ----------------------------------------------------------------------------------------------- same quantized values
@pytest.mark.parametrize("bake", [False, True], ids=["frozen", "baked"])
@pytest.mark.parametrize("round_method", ["half_even", "floor"])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_layers_with_one_quantized_weight_keep_the_tie(
    mode: str, round_method: str, bake: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Equal specs give equal quantized values: the imported Parameter holds them once, still tied, and both layers
    pass it through (nothing re-quantizes it at each forward)."""
    x = _inputs()
    model = _quantized(None, bake, round_method)
    expected = _effective_weight(model.a)
    assert torch.equal(_effective_weight(model.b), expected)
    with caplog.at_level(logging.WARNING, logger=TIED_LOGGER):
        restored = _round_trip(model, tmp_path, mode, _TwoTied(seed=5))
    assert restored.a.weight is restored.b.weight
    assert torch.equal(restored.a.weight, expected)  # the Parameter holds the quantized values
    assert isinstance(restored.a._weight_quantizer, BakedFakeQuantize)  # passed through, as an untied import's
    assert isinstance(restored.b._weight_quantizer, BakedFakeQuantize)
    assert torch.equal(_effective_weight(restored.a), expected) and torch.equal(_effective_weight(restored.b), expected)
    _assert_same_outputs(restored, model, x)
    assert not [r for r in caplog.records if r.name == TIED_LOGGER]


def test_the_quantized_weight_is_torchs_int8_per_channel(tmp_path: Path) -> None:
    """The kept tie holds torch's fake quantization of the exporting model's float weight with its scales."""
    model = _quantized(None)
    reference = _torch_int8_per_channel(model.a.weight, model.a._weight_quantizer.scale)
    restored = _round_trip(model, tmp_path, "directory", _TwoTied(seed=5))
    assert torch.equal(restored.a.weight, reference)


def test_tied_bfp16_weights_reimport_exactly_from_the_single_file(tmp_path: Path) -> None:
    """bfp16 is stored as its dequantized values: the shared Parameter kept a quantizer that re-quantized them at each
    forward, which moved blocks (0.014 on the outputs); now it passes them through."""
    x = _inputs()
    model = _TwoTied()
    bfp16 = _spec(
        dtype="bfp16",
        qscheme="per_group",
        ch_axis=-1,
        group_size=8,
        observer_cls="PerBlockBFPObserver",
        symmetric=None,
        scale_type=None,
    )
    with torch.no_grad():
        model.a.weight.mul_(torch.exp(torch.randn(64, 64, generator=torch.Generator().manual_seed(2))))
    ModelQuantizer(Config(global_quant_config=QuantizationConfig(weight=bfp16))).quantize_model(model, [x])
    ModelQuantizer.freeze(model)
    expected = _effective_weight(model.a)
    restored = _round_trip(model, tmp_path, "single_file", _TwoTied(seed=5))
    assert restored.a.weight is restored.b.weight
    assert torch.equal(restored.a.weight, expected)
    _assert_same_outputs(restored, model, x)


# ----------------------------------------------------------------------------------------------- different values
DIFFERENT = {"int4_per_group": _per_group("int4"), "int8_per_tensor": _spec(dtype="int8")}


@pytest.mark.parametrize("bake", [False, True], ids=["frozen", "baked"])
@pytest.mark.parametrize("b_spec", list(DIFFERENT))
@pytest.mark.parametrize("mode", list(MODES))
def test_two_different_quantized_versions_of_one_weight_are_untied(
    mode: str, b_spec: str, bake: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """a int8 per channel, b another spec: one Parameter cannot hold both, so each layer gets its own, with the
    values it computed with in the exported model, and a warning names both layers."""
    x = _inputs()
    model = _quantized(DIFFERENT[b_spec], bake)
    a_expected, b_expected = _effective_weight(model.a), _effective_weight(model.b)
    assert not torch.equal(a_expected, b_expected)
    with caplog.at_level(logging.WARNING, logger=TIED_LOGGER):
        restored = _round_trip(model, tmp_path, mode, _TwoTied(seed=5))
    assert restored.a.weight is not restored.b.weight
    assert torch.equal(restored.a.weight, a_expected) and torch.equal(restored.b.weight, b_expected)
    assert torch.equal(_effective_weight(restored.a), a_expected)
    assert torch.equal(_effective_weight(restored.b), b_expected)
    _assert_same_outputs(restored, model, x)
    messages = [r.getMessage() for r in caplog.records if r.name == TIED_LOGGER]
    assert len(messages) == 1 and "'a' (weight) and 'b' (weight)" in messages[0] and "untied" in messages[0]


class _ThreeTied(nn.Module):
    """Three Linear layers holding one ``weight``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.weight = self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.mark.parametrize("mode", list(MODES))
def test_only_the_layer_with_other_values_is_untied(mode: str, tmp_path: Path) -> None:
    """a and c int8 per channel, b int4 per group: b gets its own Parameter, a and c keep sharing theirs."""
    x = _inputs()
    model = _ThreeTied()
    config = Config(
        global_quant_config=QuantizationConfig(weight=INT8_PC, input_tensors=INT8_ACT),
        layer_quant_config={"b": QuantizationConfig(weight=_per_group("int4"), input_tensors=INT8_ACT)},
    )
    ModelQuantizer(config).quantize_model(model, [x])
    ModelQuantizer.freeze(model)
    restored = _round_trip(model, tmp_path, mode, _ThreeTied(seed=5))
    assert restored.a.weight is restored.c.weight and restored.b.weight is not restored.a.weight
    for layer in "abc":
        assert torch.equal(getattr(restored, layer).weight, _effective_weight(getattr(model, layer))), layer
    _assert_same_outputs(restored, model, x)


def test_the_untied_weights_are_torchs_fake_quantization(tmp_path: Path) -> None:
    """Each untied layer holds torch's fake quantization of the one float weight with that layer's scales."""
    model = _quantized(DIFFERENT["int4_per_group"])
    w = model.a.weight
    a_ref = _torch_int8_per_channel(w, model.a._weight_quantizer.scale)
    b_ref = _torch_int4_per_group(w, model.b._weight_quantizer.scale)
    for mode in MODES:
        restored = _round_trip(model, tmp_path / mode, mode, _TwoTied(seed=5))
        assert torch.equal(restored.a.weight, a_ref), mode
        assert torch.equal(restored.b.weight, b_ref), mode


@pytest.mark.parametrize("b_spec", [None, "int4_per_group"], ids=["tied", "untied"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_imported_tied_model_exports_the_same_files_again(mode: str, b_spec: str | None, tmp_path: Path) -> None:
    model = _quantized(None if b_spec is None else DIFFERENT[b_spec])
    first = export_safetensors(model, tmp_path / "a", custom_mode=MODES[mode])
    restored = import_model_from_safetensors(_TwoTied(seed=5), tmp_path / "a", filename=first.name)
    second = export_safetensors(restored, tmp_path / "b", custom_mode=MODES[mode])
    a, b = _tensors(first), _tensors(second)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class _ThreeWay(nn.Module):
    """A float embedding and two quantized Linear layers holding one Parameter."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, 64)
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Linear(64, 64, bias=False)
        self.a.weight = self.b.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.embed(ids))))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_float_holder_keeps_the_tie_with_float_values(mode: str, tmp_path: Path) -> None:
    """With a float embedding holding the Parameter too, it keeps the float values and each quantized layer keeps
    quantizing them with its own stored qparams (int8 per channel, int4 per group)."""
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    model = _ThreeWay()
    config = Config(
        global_quant_config=QuantizationConfig(weight=INT8_PC),
        layer_quant_config={"b": QuantizationConfig(weight=_per_group("int4"))},
    )
    ModelQuantizer(config).quantize_model(model, [ids])
    ModelQuantizer.freeze(model)
    floats = model.embed.weight.detach().clone()
    restored = _round_trip(model, tmp_path, mode, _ThreeWay(seed=5))
    assert restored.a.weight is restored.embed.weight and restored.b.weight is restored.embed.weight
    assert torch.equal(restored.embed.weight, floats)
    assert torch.equal(_effective_weight(restored.a), _effective_weight(model.a))
    assert torch.equal(_effective_weight(restored.b), _effective_weight(model.b))
    with torch.no_grad():
        assert torch.equal(restored(ids), model(ids))


@pytest.mark.parametrize("off", ["a", "b"])
def test_a_holder_with_fake_quant_off_keeps_the_float_values_in_the_single_file(off: str, tmp_path: Path) -> None:
    """One layer's weight quantizer switched off (the single file stores that weight in float, as it computes with
    it): the tie holds the float values, which the other layer quantizes. With ``a`` switched off, b's decoded
    values were written last and ``a`` computed with them."""
    x = _inputs()
    model = _quantized(None)
    getattr(model, off)._weight_quantizer.disable_fake_quant()
    floats = model.a.weight.detach().clone()
    restored = _round_trip(model, tmp_path, "single_file", _TwoTied(seed=5))
    assert restored.a.weight is restored.b.weight and torch.equal(restored.a.weight, floats)
    assert getattr(restored, off)._weight_quantizer is None
    _assert_same_outputs(restored, model, x)


# ----------------------------------------------------------------------------------------------- ONNX
def test_onnx_stores_each_layers_codes_of_a_shared_weight(tmp_path: Path) -> None:
    """Different specs: each layer's DequantizeLinear reads its own codes (int8 [64, 64] and int4 [64, 64]), which
    dequantize to the model's quantized weights bit for bit; onnxruntime computes the model's outputs."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    x = _inputs()
    model = _quantized(DIFFERENT["int4_per_group"])
    proto = onnx.load(str(export_onnx(model, tmp_path, x)))
    inits = {i.name: i for i in proto.graph.initializer}
    dequant = {n.input[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    for layer, dtype in (("a", onnx.TensorProto.INT8), ("b", onnx.TensorProto.INT4)):
        codes_name = f"{layer}.weight_quantized"
        assert inits[codes_name].data_type == dtype and list(inits[codes_name].dims) == [64, 64]
        node = dequant[codes_name]
        codes = torch.from_numpy(numpy_helper.to_array(inits[codes_name]).astype("int32")).float()
        scale = torch.from_numpy(numpy_helper.to_array(inits[node.input[1]]).copy())
        per_input = scale.repeat_interleave(32, dim=1) if scale.ndim == 2 else scale[:, None]
        assert torch.equal(codes * per_input, _effective_weight(getattr(model, layer))), layer
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(
        str(tmp_path / "quark_model.onnx"), options, disabled_optimizers=["WeightBiasQuantization"]
    )
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        expected = model(x)
    # the outputs are not quantized: the graph's float sums against torch's, float noise only
    assert float((torch.from_numpy(got) - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


# ----------------------------------------------------------------------------------------------- Hugging Face
def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


EMBEDDING_SPECS = {"same_as_lm_head": INT8_PC, "int4_per_group": _per_group("int4")}


@pytest.mark.parametrize("embedding", list(EMBEDDING_SPECS))
@pytest.mark.parametrize("mode", list(MODES))
def test_a_tied_llama_with_quantized_embeddings_and_lm_head(
    mode: str, embedding: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``tie_word_embeddings=True``, ``lm_head`` int8 per channel and the input embedding quantized by name (it is
    quantized only when named): the same spec keeps the tie, another unties with a warning; logits bit for bit."""
    model = _tiny_llama()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    config = Config(
        global_quant_config=QuantizationConfig(weight=INT8_PC, input_tensors=INT8_ACT),
        layer_quant_config={"model.embed_tokens": QuantizationConfig(weight=EMBEDDING_SPECS[embedding])},
    )
    ModelQuantizer(config).quantize_model(model, [ids])
    ModelQuantizer.freeze(model)
    head, embed = _effective_weight(model.lm_head), _effective_weight(model.model.embed_tokens)
    with caplog.at_level(logging.WARNING, logger=TIED_LOGGER):
        restored = _round_trip(model, tmp_path, mode, _tiny_llama())
    same = embedding == "same_as_lm_head"
    assert (restored.lm_head.weight is restored.model.embed_tokens.weight) == same
    assert torch.equal(restored.lm_head.weight, head) and torch.equal(restored.model.embed_tokens.weight, embed)
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, model(ids).logits)
    warned = [r.getMessage() for r in caplog.records if r.name == TIED_LOGGER]
    assert len(warned) == (0 if same else 1)
    assert restored.config.tie_word_embeddings == same  # tie_weights() would not tie the two versions again
    if same:
        assert isinstance(restored.lm_head._weight_quantizer, BakedFakeQuantize)
    else:
        assert "'model.embed_tokens' (weight) and 'lm_head' (weight)" in warned[0] and "'lm_head.weight'" in warned[0]


@pytest.mark.parametrize("embedding", [*EMBEDDING_SPECS, "float"])
def test_config_json_unties_embeddings_stored_as_two_quantized_versions(
    embedding: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """amd-quark's directory is a Hugging Face checkpoint: with the embedding int4 per group and the lm_head int8 per
    channel, config.json says ``tie_word_embeddings: false`` (a loader that ties them would load one version into
    both), and ``import_model_from_safetensors(None, dir)`` builds them untied, with no warning; logits bit for bit.
    The same spec keeps ``true`` and the tie, and so does a float embedding (the tie of a float tensor)."""
    pytest.importorskip("transformers")
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    embedding_entry = (
        {} if embedding == "float" else {"model.embed_tokens": QuantizationConfig(weight=EMBEDDING_SPECS[embedding])}
    )
    config = Config(
        global_quant_config=QuantizationConfig(weight=INT8_PC, input_tensors=INT8_ACT),
        layer_quant_config=embedding_entry,
    )
    ModelQuantizer(config).quantize_model(model, [ids])
    ModelQuantizer.freeze(model)
    export_safetensors(model, tmp_path)
    same = embedding != "int4_per_group"
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is same
    assert model.config.tie_word_embeddings  # the exported model is left as it was
    with caplog.at_level(logging.WARNING, logger=TIED_LOGGER):
        restored = import_model_from_safetensors(None, tmp_path, device="cpu")
    assert not [r for r in caplog.records if r.name == TIED_LOGGER]
    assert (restored.lm_head.weight is restored.model.embed_tokens.weight) == same
    with torch.no_grad():
        assert torch.equal(restored(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------------------------- calibration's report
def _float_use_warnings(model: nn.Module, config: Config, batch: torch.Tensor) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ModelQuantizer(config).quantize_model(model, [batch])
    return [str(w.message) for w in caught if "also used outside the layer" in str(w.message)]


def test_calibration_does_not_call_a_weight_two_quantized_layers_share_float() -> None:
    """The weight reaches F.linear inside layer a, which quantizes it: the report said it was used float outside
    layer b (it knew one holder per Parameter)."""
    config = Config(global_quant_config=QuantizationConfig(weight=INT8_PC, input_tensors=INT8_ACT))
    assert _float_use_warnings(_TwoTied(), config, _inputs()) == []


class _TiedAndRaw(_TwoTied):
    """``_TwoTied`` whose forward also feeds the shared weight to F.linear outside both layers (float there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.nn.functional.linear(x, self.a.weight)


def test_calibration_still_reports_a_float_use_of_a_shared_quantized_weight() -> None:
    config = Config(global_quant_config=QuantizationConfig(weight=INT8_PC, input_tensors=INT8_ACT))
    (message,) = _float_use_warnings(_TiedAndRaw(), config, _inputs())
    assert "'weight' (linear)" in message


def test_a_streamed_export_unties_the_same_embeddings_as_the_in_memory_one(tmp_path: Path) -> None:
    """``stream_quantize`` writes the config.json ``export_quark_dir`` writes: ``tie_word_embeddings`` false for an
    int4 per-group embedding and an int8 per-channel lm_head, the same tensors bit for bit."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from quark.torch.streaming import stream_quantize

    _tiny_llama().save_pretrained(tmp_path / "checkpoint")
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    config = Config(
        global_quant_config=QuantizationConfig(weight=INT8_PC),
        layer_quant_config={"model.embed_tokens": QuantizationConfig(weight=_per_group("int4"))},
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint").eval()
    ModelQuantizer(config).quantize_model(model, [{"input_ids": ids}])
    export_safetensors(model, tmp_path / "memory")
    streamed = stream_quantize(tmp_path / "checkpoint", config, [{"input_ids": ids}], tmp_path / "stream")
    documents = [json.loads((d / "config.json").read_text()) for d in (tmp_path / "memory", streamed)]
    assert documents[0]["tie_word_embeddings"] is False and documents[0] == documents[1]
    memory = load_file(str(tmp_path / "memory" / "model.safetensors"))
    stream = {k: v for f in sorted(streamed.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert sorted(memory) == sorted(stream)
    assert all(memory[k].dtype == stream[k].dtype and torch.equal(memory[k], stream[k]) for k in memory)
