"""The export front end: one registry of formats by name (quark, safetensors, onnx), ``export_model`` dispatching
through it, unknown formats refused before anything is written, each format re-imported (where it has an importer)
to the exported model's outputs, and a model's ``export_module`` rooting amd-quark's directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer, export_safetensors, import_model_from_safetensors
from quark.torch.export import (
    EXPORT_FORMATS,
    ExportFormat,
    export_formats,
    export_model,
    get_format,
    import_model,
    register_format,
)
from quark.torch.quantization.config.config import Config, Int8PerChannelSpec, Int8PerTensorSpec, QLayerConfig

pytest.importorskip("safetensors")

INT8 = QLayerConfig(
    weight=Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec(),
    input_tensors=Int8PerTensorSpec(symmetric=True).to_quantization_spec(),
)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _quantized(model: nn.Module, config: Config | None = None) -> nn.Module:
    """``model`` quantized (int8 weights per channel, int8 inputs per tensor) on fixed random batches, in eval mode."""
    torch.manual_seed(1)
    return ModelQuantizer(config or Config(global_quant_config=INT8)).quantize_model(model, [torch.randn(8, 16)]).eval()


def test_registry_lists_the_formats() -> None:
    assert export_formats() == ("safetensors", "onnx", "quark") == EXPORT_FORMATS
    for name in export_formats():
        fmt = get_format(name)
        assert fmt.name == name and fmt.description and "\n" not in fmt.description
    assert get_format("quark").read is not None and get_format("safetensors").read is not None
    assert get_format("onnx").read is None and get_format("onnx").needs_example


def test_unknown_format_names_the_allowed_ones_and_writes_nothing(tmp_path: Path) -> None:
    model = _quantized(_mlp())
    with pytest.raises(ValueError, match=r"\['tflite'\] are not known; allowed: \['safetensors', 'onnx', 'quark'\]"):
        export_model(model, tmp_path / "out", ["safetensors", "tflite"])
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"allowed: \['safetensors', 'onnx', 'quark'\]"):
        get_format("gguf")


def test_onnx_needs_an_example_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['onnx'\] need an example input"):
        export_model(_quantized(_mlp()), tmp_path / "out", ["safetensors", "onnx"])
    assert not (tmp_path / "out").exists()


def test_a_name_registers_once() -> None:
    with pytest.raises(ValueError, match="'quark' is already registered"):
        register_format(ExportFormat("quark", "again", lambda model, out, example: {}))


def test_a_format_without_importer_says_which_have_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'onnx' has no importer; importable formats: \['safetensors', 'quark'\]"):
        import_model(_mlp(), tmp_path, "onnx")


@pytest.mark.parametrize("fmt", ["safetensors", "quark"])
def test_each_importable_format_round_trips(tmp_path: Path, fmt: str) -> None:
    model = _quantized(_mlp())
    report = export_model(model, tmp_path, [fmt])
    info = report[fmt]
    assert set(report) == {fmt} and Path(info["path"]).exists()
    weights = Path(info.get("weights", info["path"]))
    assert info["file_bytes"] == weights.stat().st_size
    x = torch.randn(5, 16)
    restored = import_model(_mlp(), tmp_path, fmt)
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))


def test_quark_is_what_export_safetensors_writes(tmp_path: Path) -> None:
    """The ``quark`` format is amd-quark's directory: the same files as amd-quark's ``export_safetensors`` writes."""
    model = _quantized(_mlp())
    info = export_model(model, tmp_path / "front", ["quark"])["quark"]
    export_safetensors(model, tmp_path / "amd")
    assert Path(info["path"]) == tmp_path / "front" / "quark"
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "front" / "quark" / name).read_bytes() == (tmp_path / "amd" / name).read_bytes()
    x = torch.randn(3, 16)
    with torch.no_grad():  # amd-quark's public import reads it
        assert torch.equal(import_model_from_safetensors(_mlp(), info["path"])(x), model(x))


def test_safetensors_is_the_single_file(tmp_path: Path) -> None:
    model = _quantized(_mlp())
    info = export_model(model, tmp_path / "front", ["safetensors"])["safetensors"]
    written = export_safetensors(model, tmp_path / "ours", custom_mode=None)
    assert Path(info["path"]).name == written.name == "model.safetensors"
    assert _contents(Path(info["path"])) == _contents(
        written
    )  # the writer orders its metadata freely: compare contents


def _contents(path: Path) -> tuple[dict[str, str], dict[str, tuple[str, list[int], bytes]]]:
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
        metadata = f.metadata()
    return metadata, {
        k: (str(t.dtype), list(t.shape), t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        for k, t in tensors.items()
    }


def test_onnx_through_export_model(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    model = _quantized(_mlp())
    info = export_model(model, tmp_path, ["onnx"], torch.randn(2, 16))["onnx"]
    assert Path(info["path"]).name == "quark_model.onnx"
    onnx.checker.check_model(onnx.load(info["path"]))
    assert info["file_bytes"] == Path(info["path"]).stat().st_size


class Wrapper(nn.Module):
    """A task module holding the model to ship under ``inner`` (as a LightningModule holds a Hugging Face model)."""

    export_module = "inner"

    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_quark_writes_the_export_module_with_relative_names(tmp_path: Path) -> None:
    config = Config(global_quant_config=INT8, exclude=["head", "inner.2"])
    model = _quantized(Wrapper(), config)
    info = export_model(model, tmp_path, ["quark"])["quark"]
    assert info["module"] == "inner"
    stored = json.loads((Path(info["path"]) / "config.json").read_text())["quantization_config"]
    assert stored["exclude"] == ["2"]  # relative to inner; head (outside it) dropped
    assert not hasattr(model.inner, "quant_config") or model.inner.quant_config is not config  # restored after
    assert "quant_config" not in vars(model.inner)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(import_model_from_safetensors(_mlp(), info["path"])(x), model.inner(x))
