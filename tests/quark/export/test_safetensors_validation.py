"""import_model_from_safetensors checks every tensor of a file against its Config and the target model before it
changes anything: each crafted file is refused with a ValueError naming the tensor, and the model stays as it was."""

from __future__ import annotations

import re
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
from quark.torch.quantization.nn.modules import QuantMixin  # noqa: E402
from quark_lightning.tasks.recipes import INT4_G32_WEIGHT, INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT  # noqa: E402

CONFIG = {
    "global_quant_config": {"weight": INT4_G32_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT},
    "layer_quant_config": {"conv": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}},
}


class Small(nn.Module):
    """An int8 per-channel conv, a float BatchNorm (plain state) and an int4 per-group (packed) Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 10)  # 1,280 int4 weights: 640 bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _fresh() -> Small:
    torch.manual_seed(1)
    return Small().eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    model = _fresh()
    x = torch.rand(16, 1, 4, 4)
    ModelQuantizer(CONFIG).quantize_model(model, [x])
    with torch.no_grad():
        reference = model(x)
    path = export_safetensors(model, tmp_path_factory.mktemp("export"), custom_mode=None)
    return path, x, reference


def _nan_first(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _set_first(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def mutate(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return mutate


DELETE = None
# case: (tensor key, mutation of the stored tensor: None deletes it)
CASES: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor] | None]] = {
    "truncated_packed_int4": ("fc.weight", lambda t: t[:-1]),
    "extra_packed_bytes": ("fc.weight", lambda t: torch.cat([t, t[:1]])),
    "missing_weight_scale": ("fc.weight_scale", DELETE),
    "missing_activation_scale": ("conv.input_scale", DELETE),
    "missing_zero_point": ("conv.weight_zero_point", DELETE),
    "nan_bias": ("fc.bias", _nan_first),
    "zero_scale": ("conv.weight_scale", _set_first(0.0)),
    "negative_scale": ("conv.weight_scale", _set_first(-0.5)),
    "inf_scale": ("conv.weight_scale", _set_first(float("inf"))),
    "nan_group_scale": ("fc.weight_scale", _nan_first),
    "zero_activation_scale": ("conv.input_scale", lambda t: torch.zeros_like(t)),
    "codes_wrong_dtype": ("conv.weight", lambda t: t.to(torch.int16)),
    "codes_wrong_shape": ("conv.weight", lambda t: t.reshape(8, 9)),
    "packed_codes_wrong_dtype": ("fc.weight", lambda t: t.to(torch.int8)),
    "scale_wrong_shape": ("fc.weight_scale", lambda t: t[:, :1]),
    "zero_point_out_of_range": ("conv.weight_zero_point", _set_first(200)),
    "extra_unknown_tensor": ("head.weight", lambda t: t),
    "missing_plain_tensor": ("bn.running_var", DELETE),
    "nan_plain_parameter": ("bn.weight", _nan_first),
    "plain_tensor_wrong_shape": ("bn.running_mean", lambda t: torch.zeros(9)),
}


def _craft(source: Path, out_dir: Path, key: str, mutate: Callable[[torch.Tensor], torch.Tensor] | None) -> Path:
    """A copy of an exported file with one tensor changed, deleted or added; the metadata kept."""
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata()
    if mutate is None:
        del tensors[key]
    else:
        tensors[key] = mutate(tensors.get(key, torch.zeros(3))).contiguous()
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
    return out_dir


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_untouched_file_imports(exported: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    path, x, reference = exported
    restored = import_model_from_safetensors(_fresh(), _craft(path, tmp_path / "same", "conv.weight", lambda t: t))
    assert isinstance(restored.fc, QuantMixin) and isinstance(restored.conv, QuantMixin)
    with torch.no_grad():
        assert torch.equal(restored(x), reference)


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_file_is_refused_and_the_model_is_unchanged(
    case: str, exported: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    key, mutate = CASES[case]
    directory = _craft(exported[0], tmp_path / case, key, mutate)
    model = _fresh()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        import_model_from_safetensors(model, directory)
    after = model.state_dict()
    assert sorted(after) == sorted(before)  # no quantizer state appeared: the model was not prepared
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, QuantMixin) for m in model.modules()) and "quant_config" not in model.__dict__


def test_messages_say_what_was_expected_and_found(
    exported: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    directory = _craft(exported[0], tmp_path / "truncated", "fc.weight", lambda t: t[:-1])
    with pytest.raises(
        ValueError,
        match=r"'fc\.weight': expected 1280 4-bit codes packed two per byte .* \[640\], found uint8 of shape \[639\]",
    ):
        import_model_from_safetensors(_fresh(), directory)
    directory = _craft(exported[0], tmp_path / "scale", "conv.weight_scale", _set_first(0.0))
    with pytest.raises(ValueError, match=r"'conv\.weight_scale': expected a scale > 0, found min 0\.0"):
        import_model_from_safetensors(_fresh(), directory)
    directory = _craft(exported[0], tmp_path / "missing", "bn.running_var", DELETE)
    with pytest.raises(ValueError, match=r"'bn\.running_var': expected .*, found no such tensor in the file"):
        import_model_from_safetensors(_fresh(), directory)


def test_metadata_that_disagrees_with_the_config_is_refused(
    exported: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path
) -> None:
    import json

    tensors = load_file(str(exported[0]))
    with safe_open(str(exported[0]), framework="pt") as f:
        metadata = dict(f.metadata())
    info = json.loads(metadata["quark_tensors"])
    info["fc.weight"]["group_size"] = 64  # the Config says 32
    metadata["quark_tensors"] = json.dumps(info)
    (tmp_path / "meta").mkdir()
    save_file(tensors, str(tmp_path / "meta" / "model.safetensors"), metadata=metadata)
    model = _fresh()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"'fc\.weight': expected metadata group_size=32"):
        import_model_from_safetensors(model, tmp_path / "meta")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_truncated_file_is_a_value_error(exported: tuple[Path, torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(exported[0].read_bytes()[:-100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        import_model_from_safetensors(_fresh(), tmp_path / "cut")
