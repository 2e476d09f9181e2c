"""A model frozen with ``bake_weights=True`` exports what the same model frozen without baking exports: the same
codes, scales and config in amd-quark's directory, the single file and ONNX, and the directory imports back to a
model computing the baked model's outputs."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.report import model_size_bits

safetensors = pytest.importorskip("safetensors")

warnings.filterwarnings("ignore", message=".*TracerWarning.*")


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


def _mx(element: str) -> QuantizationSpec:
    return _spec(
        dtype="mx",
        mx_element_dtype=element,
        qscheme="per_group",
        ch_axis=-1,
        group_size=32,
        observer_cls="PerBlockMXObserver",
    )


INT8_ACT = _spec(dtype="int8")
FLOOR = QuantizationConfig(weight=_per_channel("int8", round_method="floor"), input_tensors=INT8_ACT)
FORMATS = {  # weight (and input) formats with a layout in amd-quark's directory
    "int8_per_channel_a_int8": QuantizationConfig(weight=_per_channel("int8"), input_tensors=INT8_ACT),
    "uint8_asym_per_tensor": QuantizationConfig(weight=_spec(dtype="uint8", symmetric=False)),
    "int4_per_channel": QuantizationConfig(weight=_per_channel("int4")),
    "uint4_per_group_asym": QuantizationConfig(
        weight=_spec(
            dtype="uint4",
            qscheme="per_group",
            ch_axis=1,
            group_size=32,
            symmetric=False,
            observer_cls="PerGroupMinMaxObserver",
        )
    ),
    "fp8_w_a": QuantizationConfig(weight=_spec(dtype="fp8_e4m3"), input_tensors=_spec(dtype="fp8_e4m3")),
    "mxfp4": QuantizationConfig(weight=_mx("fp4")),
    "mxfp6_e3m2": QuantizationConfig(weight=_mx("fp6_e3m2")),
    "mx6": QuantizationConfig(
        weight=_spec(
            dtype="mx6",
            qscheme="per_group",
            ch_axis=-1,
            group_size=16,
            observer_cls="PerBlockMXObserver",
            symmetric=None,
            scale_type=None,
        )
    ),
    "bf16": QuantizationConfig(
        weight=_spec(
            dtype="bfloat16", qscheme=None, observer_cls=None, symmetric=None, round_method=None, scale_type=None
        )
    ),
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)).eval()


def _frozen_pair(model: nn.Module, qc: QuantizationConfig, x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """(frozen, frozen with baked weights) of ``model`` calibrated on ``x``."""
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, [x])
    baked = copy.deepcopy(model)
    return ModelQuantizer.freeze(model), ModelQuantizer.freeze(baked, bake_weights=True)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_same_tensors(baked: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor]) -> None:
    assert sorted(baked) == sorted(frozen)
    for key, value in frozen.items():
        assert baked[key].dtype == value.dtype, key
        assert torch.equal(baked[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), (
            key
        )  # bit for bit


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


@pytest.mark.parametrize("name", list(FORMATS))
def test_baked_model_writes_the_frozen_models_directory_and_imports_back(name: str, tmp_path: Path) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, baked = _frozen_pair(_mlp(), FORMATS[name], x)
    with torch.no_grad():
        expected = baked(x)
    export_safetensors(frozen, tmp_path / "frozen")
    export_safetensors(baked, tmp_path / "baked")
    _assert_same_tensors(
        _tensors(tmp_path / "baked" / "model.safetensors"), _tensors(tmp_path / "frozen" / "model.safetensors")
    )
    config = json.loads((tmp_path / "baked" / "config.json").read_text())
    assert config == json.loads((tmp_path / "frozen" / "config.json").read_text())
    restored = import_model_from_safetensors(_mlp(), tmp_path / "baked")
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


@pytest.mark.parametrize("name", ["int8_per_channel_a_int8", "uint4_per_group_asym", "fp8_w_a", "mxfp4", "mx6", "bf16"])
def test_baked_model_writes_the_frozen_models_single_file(name: str, tmp_path: Path) -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, baked = _frozen_pair(_mlp(), FORMATS[name], x)
    with torch.no_grad():
        expected = baked(x)
    paths = {
        k: export_safetensors(m, tmp_path / k, custom_mode=None) for k, m in (("frozen", frozen), ("baked", baked))
    }
    _assert_same_tensors(_tensors(paths["baked"]), _tensors(paths["frozen"]))
    assert _metadata(paths["baked"]) == _metadata(paths["frozen"])
    restored = import_model_from_safetensors(_mlp(), tmp_path / "baked", filename=paths["baked"].name)
    with torch.no_grad():
        assert torch.equal(restored(x), expected)


def test_a_single_baked_linear_round_trips_through_the_directory(tmp_path: Path) -> None:
    """The issue's case: one Linear, int8 weights and inputs; the directory held no '0.weight_scale'."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    _, baked = _frozen_pair(nn.Sequential(nn.Linear(64, 32)), FORMATS["int8_per_channel_a_int8"], x)
    export_safetensors(baked, tmp_path)
    stored = _tensors(tmp_path / "model.safetensors")
    assert stored["0.weight"].dtype == torch.int8 and stored["0.weight_scale"].shape == (32,)
    with torch.no_grad():
        codes = torch.round(baked[0].weight / baked[0]._weight_quantizer.scale[:, None])  # independent of the exporters
    assert torch.equal(stored["0.weight"].float(), codes)
    torch.manual_seed(5)
    restored = import_model_from_safetensors(nn.Sequential(nn.Linear(64, 32)), tmp_path)
    with torch.no_grad():
        assert torch.equal(restored(x), baked(x))


@pytest.mark.parametrize("custom_mode", ["quark", None])
def test_floor_rounded_weights_are_stored_with_the_same_codes_baked_or_not(
    custom_mode: str | None, tmp_path: Path
) -> None:
    """Codes are read back from a baked weight by nearest rounding: floor on values already on the grid could drop
    one a step (x * (1 / scale) a hair below the code)."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, baked = _frozen_pair(_mlp(), FLOOR, x)
    paths = {
        k: export_safetensors(m, tmp_path / k, custom_mode=custom_mode)
        for k, m in (("frozen", frozen), ("baked", baked))
    }
    _assert_same_tensors(_tensors(paths["baked"]), _tensors(paths["frozen"]))


def test_floor_rounded_weights_reimport_to_the_frozen_models_outputs(tmp_path: Path) -> None:
    """The imports keep decoded weights as they are (re-quantizing them with floor could drop a code one step);
    every round method and format: test_import_exactness.py."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, _ = _frozen_pair(_mlp(), FLOOR, x)
    export_safetensors(frozen, tmp_path)
    restored = import_model_from_safetensors(_mlp(), tmp_path)
    with torch.no_grad():
        assert torch.equal(restored(x), frozen(x))


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


@pytest.mark.parametrize("custom_mode", ["quark", None])
def test_a_weight_tied_to_a_float_embedding_is_not_baked(custom_mode: str | None, tmp_path: Path) -> None:
    """Baking the quantized head's weight would round the embedding's (the same Parameter) too."""
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(1))
    model = _TiedLM()
    float_weight = model.embed.weight.detach().clone()
    frozen, baked = _frozen_pair(model, QuantizationConfig(weight=_per_channel("int8")), ids)
    assert torch.equal(baked.embed.weight, float_weight)
    with torch.no_grad():
        assert torch.equal(baked(ids), frozen(ids))
    paths = {
        k: export_safetensors(m, tmp_path / k, custom_mode=custom_mode)
        for k, m in (("frozen", frozen), ("baked", baked))
    }
    _assert_same_tensors(_tensors(paths["baked"]), _tensors(paths["frozen"]))


def test_baked_weights_count_their_formats_bits() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, baked = _frozen_pair(_mlp(), FORMATS["int4_per_channel"], x)
    assert model_size_bits(baked) == model_size_bits(frozen)
    assert model_size_bits(baked)[0] < model_size_bits(baked)[1] / 4  # int4 weights, float32 biases


def test_baked_model_writes_the_frozen_models_onnx_graph(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import numpy_helper

    from quark.torch.export import export_onnx

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    frozen, baked = _frozen_pair(_mlp(), FORMATS["int8_per_channel_a_int8"], x)
    paths = {k: export_onnx(m, tmp_path / k, x[:2]) for k, m in (("frozen", frozen), ("baked", baked))}
    graphs = {k: onnx.load(str(p)).graph for k, p in paths.items()}
    inits = {k: {i.name: numpy_helper.to_array(i) for i in g.initializer} for k, g in graphs.items()}
    assert sorted(inits["baked"]) == sorted(inits["frozen"])
    for key, value in inits["frozen"].items():
        assert inits["baked"][key].dtype == value.dtype and (inits["baked"][key] == value).all(), key
    assert [n.op_type for n in graphs["baked"].node] == [n.op_type for n in graphs["frozen"].node]
    assert sum(n.op_type == "DequantizeLinear" for n in graphs["baked"].node) >= 4  # two weights, two inputs
    sessions = [ort.InferenceSession(str(p), disabled_optimizers=["WeightBiasQuantization"]) for p in paths.values()]
    outs = [s.run(None, {"input": x.numpy()})[0] for s in sessions]
    assert (outs[0] == outs[1]).all()
