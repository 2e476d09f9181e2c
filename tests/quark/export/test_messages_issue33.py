"""Issue 33, messages: crafted amd-quark ``config.json`` files and safetensors headers are refused with a ValueError
naming the key / tensor and the field (before: AttributeError, KeyError, TypeError), and amd-quark's directory import
refuses what the single-file import refuses, with the same message (one rule for the model's tensors)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export import export_safetensors, import_model_from_safetensors  # noqa: E402
from quark.torch.export.quark_format import to_quark_dict  # noqa: E402
from quark.torch.quantization.config.config import (  # noqa: E402
    FP8E4M3PerTensorSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    QConfig,
    QLayerConfig,
)

INT8 = QLayerConfig(
    weight=Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec(),
    input_tensors=Int8PerTensorSpec(symmetric=True).to_quantization_spec(),
)
FP8 = QLayerConfig(
    weight=FP8E4M3PerTensorSpec().to_quantization_spec(), input_tensors=FP8E4M3PerTensorSpec().to_quantization_spec()
)


def _fresh() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)).eval()


def _export(directory: Path, layer: QLayerConfig, custom_mode: str | None) -> Path:
    """A calibrated, frozen two-layer model written to ``directory`` (amd-quark's directory or the single file)."""
    model = ModelQuantizer(QConfig(global_quant_config=layer)).quantize_model(_fresh(), [torch.randn(4, 16)])
    ModelQuantizer.freeze(model)
    return export_safetensors(model, directory, custom_mode=custom_mode)


@pytest.fixture(scope="module")
def quark_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("int8"), INT8, "quark").parent


def _with_config(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(src, dst)
    document = json.loads((dst / "config.json").read_text())
    edit(document["quantization_config"])
    (dst / "config.json").write_text(json.dumps(document))
    return dst


# ----------------------------------------------------------------------------------------------- config.json
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda q: q.__setitem__("global_quant_config", "x"),
            r"quantization_config\.global_quant_config must be a mapping, found str 'x'",
        ),
        (
            lambda q: q.__setitem__("layer_quant_config", {"fc1": 5}),
            r"quantization_config\.layer_quant_config\.fc1 must be a mapping, found int 5",
        ),
        (lambda q: q.pop("global_quant_config"), r"quantization_config\.global_quant_config is missing"),
        (
            lambda q: q["global_quant_config"].__setitem__("weight", 3),
            r"quantization_config\.global_quant_config\.weight must be a mapping",
        ),
        (
            lambda q: q["global_quant_config"]["weight"].__setitem__("dtype", "nope"),
            r"quantization_config\.global_quant_config\.weight: QuantizationSpec\.dtype='nope' is not a valid Dtype",
        ),
        (lambda q: q.__setitem__("exclude", "fc1"), r"quantization_config\.exclude must be a list of layer names"),
        (lambda q: q.__setitem__("export", [1]), r"quantization_config\.export must be a mapping"),
        (
            lambda q: q["export"].__setitem__("pack_method", "evil"),
            r"quantization_config\.export\.pack_method='evil'; allowed: \['reorder', 'order'\]",
        ),
    ],
    ids=[
        "global_str",
        "layer_int",
        "global_missing",
        "spec_int",
        "dtype_unknown",
        "exclude_str",
        "export_list",
        "pack_method",
    ],
)
def test_a_crafted_quark_config_is_a_value_error_naming_the_key(
    edit, message: str, quark_dir: Path, tmp_path: Path
) -> None:
    crafted = _with_config(quark_dir, tmp_path / "crafted", edit)
    model = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"config\.json: {message}"):
        import_model_from_safetensors(model, crafted)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_architecture_that_is_no_model_class_is_a_value_error_naming_the_key(tmp_path: Path) -> None:
    """``architectures: ["AutoModelForCausalLM"]`` (a name transformers has, but a factory): refused by key, where
    the skeleton builder called ``AutoModelForCausalLM._from_config`` (AttributeError)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).to_dict()
    config["architectures"] = ["AutoModelForCausalLM"]
    config["quantization_config"] = to_quark_dict(QConfig(global_quant_config=INT8))
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"config\.json: architectures\[0\]='AutoModelForCausalLM' is not a model class of transformers",
    ):
        import_model_from_safetensors(None, tmp_path)


# ----------------------------------------------------------------------------------------------- safetensors header
def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """The file with its JSON header edited (the data bytes kept)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("data_offsets", ["0", "64"], r"data_offsets=\['0', '64'\] must be two integers"),
        ("data_offsets", [0], r"data_offsets=\[0\] must be two integers"),
        ("shape", ["16"], r"shape=\['16'\] must be a list of integers"),
        ("dtype", ["F32"], r"dtype=\['F32'\] must be a safetensors dtype name"),
    ],
)
def test_a_header_field_of_the_wrong_type_is_a_value_error_naming_tensor_and_field(
    field: str, value: object, message: str, quark_dir: Path, tmp_path: Path
) -> None:
    crafted = tmp_path / "crafted"
    shutil.copytree(quark_dir, crafted)
    _rewrite_header(crafted / "model.safetensors", lambda h: h["0.bias"].__setitem__(field, value))
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '0\.bias': {message}"):
        import_model_from_safetensors(_fresh(), crafted)


# ----------------------------------------------------------------------------------------------- one rule for both imports
def _tampered(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize(
    ("layer", "edit", "message"),
    [
        (
            INT8,
            lambda t: t.__setitem__("0.bias", t["0.bias"].double()),
            r"tensor '0\.bias': expected a float tensor of dtype float32 or float16 or bfloat16, found float64 of shape \[16\]",
        ),
        (
            FP8,
            lambda t: t.__setitem__("0.weight_zero_point", torch.zeros((), dtype=torch.int8)),
            r"tensor '0\.weight_zero_point': expected only tensors of the model and of its quantized layers, found "
            r"'0\.weight_zero_point' that belongs to none",
        ),
        (
            INT8,
            lambda t: t.__setitem__("2.bias", t["2.bias"][:4].clone()),
            r"tensor '2\.bias': expected a float tensor of shape \[8\], found float32 of shape \[4\]",
        ),
    ],
    ids=["float64_bias", "fp8_weight_zero_point", "bias_shape"],
)
@pytest.mark.parametrize("custom_mode", ["quark", None], ids=["directory", "single_file"])
def test_both_imports_refuse_the_same_tampering_with_the_same_message(
    custom_mode: str | None, layer: QLayerConfig, edit, message: str, tmp_path: Path
) -> None:
    path = _export(tmp_path, layer, custom_mode)
    _tampered(path, edit)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message}"):
        import_model_from_safetensors(_fresh(), tmp_path)
