"""A model re-imported from either safetensors export computes the exporting model's outputs bit for bit, for every
round method and weight format, frozen or baked; a quantizer with fake quant switched off is exported as what the
model computes (codes when the weight is on its grid), or refused by amd-quark's directory with a ValueError.

The references are the exporting model's own outputs and codes computed here with torch ops (``torch.round`` /
``torch.floor`` of ``w / scale``), never the exporters' encoders."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.config.config import Config, GPTQConfig, QuantizationConfig, QuantizationSpec

pytest.importorskip("safetensors")

warnings.filterwarnings("ignore", message=".*TracerWarning.*")

ROUND_METHODS = ["half_even", "round", "floor"]
MODES = {"directory": "quark", "single_file": None}


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


def _mx(element: str) -> QuantizationSpec:
    return _spec(
        dtype="mx",
        mx_element_dtype=element,
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        observer_cls="PerBlockMXObserver",
    )


def _block(dtype: str, group: int, observer: str = "PerBlockMXObserver") -> QuantizationSpec:
    return _spec(
        dtype=dtype,
        qscheme="per_group",
        ch_axis=-1,
        group_size=group,
        observer_cls=observer,
        symmetric=None,
        scale_type=None,
    )


INT8_ACT = _spec(dtype="int8")
INT_WEIGHTS = {  # integer weight specs (round_method set per test), each with a layout in both exports
    "int8_per_channel": lambda rm: _per_channel("int8", round_method=rm),
    "uint8_asym_per_tensor": lambda rm: _spec(dtype="uint8", symmetric=False, round_method=rm),
    "int4_per_channel": lambda rm: _per_channel("int4", round_method=rm),
    "uint4_asym_per_group": lambda rm: _per_group("uint4", symmetric=False, round_method=rm),
    "int8_per_group": lambda rm: _per_group("int8", round_method=rm),
    "int3_per_channel": lambda rm: _per_channel("int3", round_method=rm),
}
OTHER_WEIGHTS = {  # formats without a round method of their own
    "fp8_e4m3": _spec(dtype="fp8_e4m3"),
    "fp8_e5m2_per_channel": _per_channel("fp8_e5m2"),
    "fp4_per_channel": _per_channel("fp4"),
    "mxfp4": _mx("fp4"),
    "mxfp6_e2m3": _mx("fp6_e2m3"),
    "mxfp8_e4m3": _mx("fp8_e4m3"),
    "mx6": _block("mx6", 16),
    "mx9": _block("mx9", 16),
    "bf16": _spec(
        dtype="bfloat16", qscheme=None, observer_cls=None, symmetric=None, round_method=None, scale_type=None
    ),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


def _inputs() -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(1))


def _quantized(weight: QuantizationSpec, x: torch.Tensor, bake: bool | None = False, **qc: Any) -> nn.Module:
    """The MLP calibrated on ``x`` with ``weight`` (and int8 inputs); frozen (``bake``: with baked weights) or, for
    ``bake=None``, only calibrated."""
    model = _mlp()
    ModelQuantizer(
        Config(global_quant_config=QuantizationConfig(weight=weight, **({"input_tensors": INT8_ACT} | qc)))
    ).quantize_model(model, [x])
    return model if bake is None else ModelQuantizer.freeze(model, bake_weights=bake)


def _round_trip(model: nn.Module, tmp_path: Path, mode: str, fresh: nn.Module | None = None) -> nn.Module:
    path = export_safetensors(model, tmp_path, custom_mode=MODES[mode])
    return import_model_from_safetensors(fresh if fresh is not None else _mlp(), tmp_path, filename=path.name)


def _assert_same_outputs(restored: nn.Module, model: nn.Module, *inputs: torch.Tensor) -> None:
    with torch.no_grad():
        expected, got = model(*inputs), restored(*inputs)
    assert torch.equal(got, expected), f"max diff {float((got - expected).abs().max())}"


# ----------------------------------------------------------------------------------------------- every round method
@pytest.mark.parametrize("bake", [False, True], ids=["frozen", "baked"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("round_method", ROUND_METHODS)
@pytest.mark.parametrize("name", list(INT_WEIGHTS))
def test_integer_weights_reimport_exactly_for_every_round_method(
    name: str, round_method: str, mode: str, bake: bool, tmp_path: Path
) -> None:
    """Floor rounding dropped a code one step: the imports re-quantized the decoded (on-grid) weights with it."""
    x = _inputs()
    model = _quantized(INT_WEIGHTS[name](round_method), x, bake)
    _assert_same_outputs(_round_trip(model, tmp_path, mode), model, x)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OTHER_WEIGHTS))
def test_other_weight_formats_reimport_exactly(name: str, mode: str, tmp_path: Path) -> None:
    x = _inputs()
    model = _quantized(OTHER_WEIGHTS[name], x)
    _assert_same_outputs(_round_trip(model, tmp_path, mode), model, x)


def test_bfp16_weights_reimport_exactly_from_the_single_file(tmp_path: Path) -> None:
    """bfp16 (no directory layout) is stored as its dequantized values: re-quantizing them could move a block's step."""
    x = _inputs()
    model = _quantized(_block("bfp16", 8, "PerBlockBFPObserver"), x)
    _assert_same_outputs(_round_trip(model, tmp_path, "single_file"), model, x)


@pytest.mark.parametrize("mode", list(MODES))
def test_an_imported_floor_model_exports_the_same_codes_again(mode: str, tmp_path: Path) -> None:
    """Export -> import -> export is a fixed point: the imported model's weights give their codes back."""
    x = _inputs()
    model = _quantized(_per_channel("int8", round_method="floor"), x)
    first = export_safetensors(model, tmp_path / "a", custom_mode=MODES[mode])
    restored = import_model_from_safetensors(_mlp(), tmp_path / "a", filename=first.name)
    second = export_safetensors(restored, tmp_path / "b", custom_mode=MODES[mode])
    a, b = _tensors(first), _tensors(second)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_stored_floor_codes_are_the_floor_of_w_over_scale(tmp_path: Path) -> None:
    """The codes on disk are floor(w / scale) of the exporting model (an independent reference), and the imported
    weight is their dequantized value exactly."""
    x = _inputs()
    model = _quantized(_per_channel("int8", round_method="floor"), x, bake=None)
    with torch.no_grad():
        scale = model[0]._weight_quantizer.scale.detach()
        codes = torch.floor(model[0].weight * torch.reciprocal(scale)[:, None]).clamp(-128, 127)
    restored = _round_trip(model, tmp_path, "directory")
    stored = _tensors(tmp_path / "model.safetensors")
    assert torch.equal(stored["0.weight"].float(), codes)
    assert torch.equal(restored[0].weight, codes * scale[:, None])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class _TiedLM(nn.Module):
    """An embedding and an output projection sharing one weight (``tie_word_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 32)
        self.head = nn.Linear(32, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(ids)))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_floor_rounded_head_tied_to_a_float_embedding_reimports_exactly(mode: str, tmp_path: Path) -> None:
    """The tied weight holds the embedding's float values after import: its quantizer must keep quantizing them."""
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(1))
    model = _TiedLM()
    ModelQuantizer(
        Config(global_quant_config=QuantizationConfig(weight=_per_channel("int8", round_method="floor")))
    ).quantize_model(model, [ids])
    ModelQuantizer.freeze(model, bake_weights=True)
    restored = _round_trip(model, tmp_path, mode, _TiedLM())
    assert restored.head.weight is restored.embed.weight
    _assert_same_outputs(restored, model, ids)


# ----------------------------------------------------------------------------------------------- fake quant off
def _switched_off_on_the_grid(round_method: str) -> tuple[nn.Module, torch.Tensor]:
    """fc 0's weight replaced by its quantized values by hand, its quantizer's fake quant off (the weight is on its
    grid: what a GPTQ-style algorithm leaves)."""
    x = _inputs()
    model = _quantized(_per_channel("int8", round_method=round_method), x)
    q = model[0]._weight_quantizer
    with torch.no_grad():
        model[0].weight.copy_(q(model[0].weight))
    q.disable_fake_quant()
    return model, x


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("round_method", ROUND_METHODS)
def test_a_switched_off_weight_on_its_grid_is_stored_as_codes(round_method: str, mode: str, tmp_path: Path) -> None:
    """The directory stored the float weight while config.json said int8, and the import failed on the missing
    scale; stored as codes (nearest: the weight is on the grid), both imports compute the model's outputs."""
    model, x = _switched_off_on_the_grid(round_method)
    with torch.no_grad():
        scale = model[0]._weight_quantizer.scale.detach()
        codes = torch.round(model[0].weight / scale[:, None])
    restored = _round_trip(model, tmp_path, mode)
    _assert_same_outputs(restored, model, x)
    stored = _tensors(next(tmp_path.glob("*.safetensors")))
    assert stored["0.weight"].dtype == torch.int8 and torch.equal(stored["0.weight"].float(), codes)


def test_a_switched_off_weight_off_its_grid_is_refused_by_the_directory(tmp_path: Path) -> None:
    x = _inputs()
    model = _quantized(_per_channel("int8"), x)
    model[0]._weight_quantizer.disable_fake_quant()
    with pytest.raises(
        ValueError, match=r"layer '0' \(weight\): its quantizer's fake quant is switched off.*custom_mode=None"
    ):
        export_safetensors(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_switched_off_weight_off_its_grid_reimports_in_float_from_the_single_file(tmp_path: Path) -> None:
    x = _inputs()
    model = _quantized(_per_channel("int8"), x)
    model[0]._weight_quantizer.disable_fake_quant()
    restored = _round_trip(model, tmp_path, "single_file")
    assert restored[0]._weight_quantizer is None and torch.equal(restored[0].weight, model[0].weight)
    _assert_same_outputs(restored, model, x)


def test_a_switched_off_input_quantizer_is_refused_by_the_directory(tmp_path: Path) -> None:
    """The directory stored its input_scale and the import quantized inputs the model ran in float."""
    x = _inputs()
    model = _quantized(_per_channel("int8"), x)
    model[2]._input_quantizer.disable_fake_quant()
    with pytest.raises(ValueError, match=r"layer '2' \(input_tensors\): its quantizer's fake quant is switched off"):
        export_safetensors(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_switched_off_input_quantizer_reimports_in_float_from_the_single_file(dynamic: bool, tmp_path: Path) -> None:
    x = _inputs()
    model = _quantized(_per_channel("int8"), x, input_tensors=_spec(dtype="int8", is_dynamic=dynamic))
    model[2]._input_quantizer.disable_fake_quant()
    restored = _round_trip(model, tmp_path, "single_file")
    assert restored[2]._input_quantizer is None
    _assert_same_outputs(restored, model, x)


# ----------------------------------------------------------------------------------------------- GPTQ
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("round_method", ["half_even", "floor"])
def test_a_gptq_model_exports_its_codes_and_reimports_exactly(round_method: str, mode: str, tmp_path: Path) -> None:
    """GPTQ switches fake quant off for weights on its grid while it runs and back on after: the export stores the
    codes on GPTQ's grid (its scales, not the observer's), and the import computes the GPTQ model's outputs."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    spec = _per_group("uint4", symmetric=False, round_method=round_method)
    model = _mlp()
    config = Config(global_quant_config=QuantizationConfig(weight=spec), algo_config=[GPTQConfig()])
    ModelQuantizer(config).quantize_model(model, [x[:32], x[32:]])
    assert all(bool(model[i]._weight_quantizer.fake_quant_enabled) for i in (0, 2))
    gptq_scales = [model[i]._weight_quantizer.scale.detach().clone() for i in (0, 2)]
    restored = _round_trip(model, tmp_path, mode)
    _assert_same_outputs(restored, model, x)
    for i, scale in zip((0, 2), gptq_scales, strict=True):
        assert torch.equal(restored[i]._weight_quantizer.scale, scale)
        with torch.no_grad():
            assert torch.equal(restored[i].weight, model[i]._weight_quantizer(model[i].weight))


# ----------------------------------------------------------------------------------------------- ONNX
def _onnx_weight_codes(path: Path, shape: list[int]) -> torch.Tensor | None:
    """The integer initializer of ``shape`` a DequantizeLinear reads (a weight stored as codes), None if there is none."""
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(str(path)).graph
    dequantized = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}
    found = [
        onnx.numpy_helper.to_array(i) for i in graph.initializer if i.name in dequantized and list(i.dims) == shape
    ]
    return torch.from_numpy(found[0].copy()).float() if found else None


def _onnx_outputs(path: Path, x: torch.Tensor) -> torch.Tensor:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(path), options, disabled_optimizers=["WeightBiasQuantization"])  # as written
    return torch.from_numpy(session.run(None, {"input": x.numpy()})[0])


def _assert_close_across_runtimes(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Float outputs of onnxruntime against torch: each sums in its own order, so the last bits may differ; 1e-5 of
    the largest output is far below one quantization step here."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@pytest.mark.parametrize("round_method", ["round", "floor"])
def test_weights_rounded_other_than_half_even_export_to_onnx_as_their_codes(round_method: str, tmp_path: Path) -> None:
    """QuantizeLinear rounds half to even: a floor-rounded weight went out as a float weight through Q/DQ, whose
    codes were not the model's (only a warning said so); stored as the model's codes, the graph computes its weights."""
    from quark.torch.export import export_onnx

    x = _inputs()
    model = _quantized(_per_channel("int8", round_method=round_method), x)
    with torch.no_grad():
        scale = model[0]._weight_quantizer.scale.detach()
        v = model[0].weight * torch.reciprocal(scale)[:, None]
        codes = (torch.floor(v) if round_method == "floor" else torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(
            -128, 127
        )
        expected = model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export_onnx(model, tmp_path, x[:2])
    assert not [w for w in caught if "rounds half to even" in str(w.message)]
    stored = _onnx_weight_codes(path, [32, 64])
    assert stored is not None and torch.equal(stored, codes)
    _assert_close_across_runtimes(_onnx_outputs(path, x), expected)


@pytest.mark.parametrize("on_grid", [True, False], ids=["on_grid", "off_grid"])
def test_a_switched_off_weight_exports_to_onnx_as_the_model_computes(on_grid: bool, tmp_path: Path) -> None:
    """On its grid, the weight is stored as its codes (as both safetensors exports do); off it, as the float weight
    the model computes with."""
    from quark.torch.export import export_onnx

    if on_grid:
        model, x = _switched_off_on_the_grid("floor")
    else:
        x = _inputs()
        model = _quantized(_per_channel("int8"), x)
        model[0]._weight_quantizer.disable_fake_quant()
    with torch.no_grad():
        expected = model(x)
        codes = torch.round(model[0].weight / model[0]._weight_quantizer.scale[:, None])
    path = export_onnx(model, tmp_path, x[:2])
    stored = _onnx_weight_codes(path, [32, 64])
    assert (stored is not None and torch.equal(stored, codes)) if on_grid else stored is None
    _assert_close_across_runtimes(_onnx_outputs(path, x), expected)


# ----------------------------------------------------------------------------------------------- a Hugging Face model
def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, attn_implementation="eager"
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_floor_rounded_gpt2_reimports_to_the_same_logits(mode: str, tmp_path: Path) -> None:
    """Conv1D weights (stored as the equivalent Linear's) and an lm_head tied to the float input embeddings."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = _gpt2()
    config = Config(
        global_quant_config=QuantizationConfig(
            weight=_per_channel("int8", round_method="floor"), input_tensors=INT8_ACT
        )
    )
    ModelQuantizer(config).quantize_model(model, [{"input_ids": ids}])
    ModelQuantizer.freeze(model)
    restored = _round_trip(model, tmp_path, mode, _gpt2())
    assert restored.lm_head.weight is restored.transformer.wte.weight and restored.lm_head._weight_quantizer is not None
    with torch.no_grad():
        expected, got = model(input_ids=ids).logits, restored(input_ids=ids).logits
    assert torch.equal(got, expected), f"max diff {float((got - expected).abs().max())}"
