"""Real-quantized safetensors: packing, the stored forms, bit-exact re-import, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export import export_safetensors, import_model_from_safetensors  # noqa: E402
from quark.torch.export.packing import pack_nibbles, unpack_nibbles  # noqa: E402
from quark_lightning.tasks.digits import DigitsCNN  # noqa: E402
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT, recipe  # noqa: E402


def _int(dtype: str, qscheme: str, **extra: Any) -> dict[str, Any]:
    observer = {
        "per_tensor": "PerTensorMinMaxObserver",
        "per_channel": "PerChannelMinMaxObserver",
        "per_group": "PerGroupMinMaxObserver",
    }
    spec = {
        "dtype": dtype,
        "qscheme": qscheme,
        "observer_cls": observer[qscheme],
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "is_dynamic": False,
    }
    if qscheme == "per_channel":
        spec["ch_axis"] = 0
    spec.update(extra)
    return spec


CONFIGS = {
    "int8_per_channel_w8a8": recipe("w8a8_int8"),
    "int4_per_group": recipe("w4_int4_g32"),
    "fp8_e4m3_w8a8": recipe("w8a8_fp8_e4m3"),
    "mxfp4": recipe("mxfp4"),
    "uint4_asym_per_channel": {
        "global_quant_config": {
            "weight": _int("uint4", "per_channel", symmetric=False),
            "input_tensors": INT8_PER_TENSOR_ACT,
        }
    },
    "int3_per_tensor": {"global_quant_config": {"weight": _int("int3", "per_tensor")}},
    "int6_per_channel": {"global_quant_config": {"weight": _int("int6", "per_channel")}},
    "int12_per_channel": {"global_quant_config": {"weight": _int("int12", "per_channel")}},
    "fp4_per_channel": {
        "global_quant_config": {
            "weight": {
                "dtype": "fp4",
                "qscheme": "per_channel",
                "ch_axis": 0,
                "observer_cls": "PerChannelMinMaxObserver",
                "is_dynamic": False,
            }
        }
    },
    "mxint8": {
        "global_quant_config": {
            "weight": {"dtype": "mx", "mx_element_dtype": "int8", "ch_axis": 1, "group_size": 32, "is_dynamic": True}
        }
    },
    "bf16": {
        "global_quant_config": {
            "weight": {"dtype": "bfloat16", "observer_cls": "PlaceholderObserver", "is_dynamic": False}
        }
    },
    "mx6": {
        "global_quant_config": {
            "weight": {"dtype": "mx6", "qscheme": "per_group", "ch_axis": 1, "group_size": 16, "is_dynamic": True}
        }
    },
}


def _quantized(config: Any) -> tuple[DigitsCNN, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.rand(16, 1, 8, 8)
    model = DigitsCNN(width=32).eval()
    ModelQuantizer(config).quantize_model(model, [x])
    return model, x


@pytest.mark.parametrize("odd", [1, 7, 33, 1001])
@pytest.mark.parametrize("signed", [True, False])
def test_nibble_packing_round_trips_odd_sizes(odd: int, signed: bool) -> None:
    low, high = (-8, 8) if signed else (0, 16)
    codes = torch.randint(low, high, (odd,), generator=torch.Generator().manual_seed(odd))
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == (odd + 1) // 2
    assert torch.equal(unpack_nibbles(packed, odd, signed), codes.to(torch.int32))


def test_nibble_layout_is_low_nibble_first() -> None:
    assert pack_nibbles(torch.tensor([1, 2, -1])).tolist() == [0x21, 0x0F]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_is_bit_exact(name: str, tmp_path: Path) -> None:
    model, x = _quantized(CONFIGS[name])
    with torch.no_grad():
        reference = model(x)
    export_safetensors(model, tmp_path, custom_mode=None)
    restored = import_model_from_safetensors(DigitsCNN(width=32), tmp_path)
    with torch.no_grad():
        assert torch.equal(restored(x), reference)
    frozen = ModelQuantizer.freeze(model)  # the frozen model exports the same file content
    export_safetensors(frozen, tmp_path / "frozen", custom_mode=None)
    with torch.no_grad():
        assert torch.equal(import_model_from_safetensors(DigitsCNN(width=32), tmp_path / "frozen")(x), reference)


def _stored(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_stored_forms_are_real_quantized(tmp_path: Path) -> None:
    model, _ = _quantized(CONFIGS["int4_per_group"])
    tensors, meta = _stored(export_safetensors(model, tmp_path, custom_mode=None))
    assert (
        meta["quant_method"] == "quark"
        and json.loads(meta["quantization_config"])["global_quant_config"]["weight"]["dtype"] == "int4"
    )
    fc1 = model.fc1.weight
    assert (
        tensors["fc1.weight"].dtype == torch.uint8 and tensors["fc1.weight"].numel() == fc1.numel() // 2
    )  # two per byte
    assert tuple(tensors["fc1.weight_scale"].shape) == (fc1.shape[0], fc1.shape[1] // 32)
    assert tensors["conv1.weight"].dtype == torch.int8  # pinned int8 layer: one byte per weight
    assert tensors["fc1.bias"].dtype == torch.float32
    # the int4 codes are the integers round(w / s) of the quantizer, recomputed independently
    scale = tensors["fc1.weight_scale"].repeat_interleave(32, dim=1)
    codes = unpack_nibbles(tensors["fc1.weight"], fc1.numel(), signed=True).reshape(fc1.shape)
    expected = torch.clamp(torch.round(fc1.detach() * (1.0 / scale)), -8, 7).to(
        torch.int32
    )  # torch's kernels: x * (1/s)
    assert torch.equal(codes, expected)

    model, _ = _quantized(CONFIGS["fp8_e4m3_w8a8"])
    tensors, _ = _stored(export_safetensors(model, tmp_path / "fp8", custom_mode=None))
    assert tensors["fc1.weight"].dtype == torch.float8_e4m3fn and "fc1.input_scale" in tensors

    model, _ = _quantized(CONFIGS["mxfp4"])
    tensors, _ = _stored(export_safetensors(model, tmp_path / "mx", custom_mode=None))
    assert tensors["fc1.weight"].dtype == torch.uint8 and tensors["fc1.weight"].numel() == model.fc1.weight.numel() // 2
    assert tensors["fc1.weight_scale"].dtype == torch.uint8  # E8M0 per block of 32
    assert tensors["fc1.weight_scale"].numel() == model.fc1.weight.numel() // 32


def test_file_is_smaller_than_fp32(tmp_path: Path) -> None:
    sizes = {}
    for name in ("int8_per_channel_w8a8", "int4_per_group", "mxfp4"):
        model, _ = _quantized(CONFIGS[name])
        sizes[name] = export_safetensors(model, tmp_path / name, custom_mode=None).stat().st_size
    fp32 = sum(p.numel() * 4 for p in DigitsCNN(width=32).parameters())
    assert (
        sizes["int8_per_channel_w8a8"] < 0.3 * fp32
        and sizes["int4_per_group"] < 0.22 * fp32
        and sizes["mxfp4"] < 0.17 * fp32
    )


def test_interrupted_write_leaves_no_file_under_the_final_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch as st

    model, _ = _quantized(CONFIGS["int8_per_channel_w8a8"])
    export_safetensors(model, tmp_path, custom_mode=None)
    before = (tmp_path / "model.safetensors").read_bytes()

    def broken(tensors: dict, path: str, metadata: dict | None = None) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(st, "save_file", broken)
    model2, _ = _quantized(CONFIGS["int4_per_group"])
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(model2, tmp_path, custom_mode=None)
    assert (tmp_path / "model.safetensors").read_bytes() == before  # the earlier export is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temporary left behind
    with pytest.raises(OSError, match="disk full"):
        export_safetensors(model2, tmp_path / "fresh", custom_mode=None)
    assert not (tmp_path / "fresh" / "model.safetensors").exists()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a model prepared by ModelQuantizer"):
        export_safetensors(DigitsCNN(), tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_model_from_safetensors(DigitsCNN(), tmp_path / "nothing")
    model, _ = _quantized(CONFIGS["int8_per_channel_w8a8"])
    export_safetensors(model, tmp_path, custom_mode=None)
    with pytest.raises((ValueError, RuntimeError)):
        import_model_from_safetensors(DigitsCNN(width=16), tmp_path)  # another architecture


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path) -> None:  # noqa: ANN001
    """The temporary mkstemp makes is 0600; the file under its final name follows the umask, as save_pretrained's."""
    import os
    import stat

    from quark.torch.export.files import write_atomically

    old = os.umask(0o022)
    try:
        path = write_atomically(tmp_path, "config.json", lambda tmp: open(tmp, "w").write("{}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


class _WithSpare(torch.nn.Module):
    """Two experts, only the first ever called (an MoE expert no calibration or training batch was routed to)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[0](x)


@pytest.mark.filterwarnings("ignore:.*no forward reached.*", "ignore:.*run in float.*", "ignore:.*stay float.*")
@pytest.mark.parametrize("frozen", [False, True])
def test_a_layer_no_calibration_reached_is_stored_float_and_excluded(frozen: bool, tmp_path: Path) -> None:
    """Before, the frozen model's file could not be re-imported (its layer had no input qparams), and a QAT model's
    stored int8 codes with a placeholder input scale of 1.0, which the import then applied."""
    torch.manual_seed(0)
    model = ModelQuantizer(recipe("w8a8_int8")).quantize_model(_WithSpare(), [torch.randn(4, 16)])
    if frozen:
        ModelQuantizer.freeze(model)
    with pytest.warns(UserWarning, match=r"exported in float and excluded .*\['experts.1'\]"):
        path = export_safetensors(model, tmp_path, custom_mode=None)
    stored, metadata = _stored(path)
    assert "experts.1" in json.loads(metadata["quantization_config"])["exclude"]
    assert stored["experts.1.weight"].dtype == torch.float32 and "experts.1.input_scale" not in stored
    assert stored["experts.0.weight"].dtype == torch.int8 and "experts.0.input_scale" in stored
    restored = import_model_from_safetensors(_WithSpare(), tmp_path)
    x = torch.randn(3, 16)
    assert torch.equal(
        restored.experts[1](x), torch.nn.functional.linear(x, model.experts[1].weight, model.experts[1].bias)
    )
    ModelQuantizer.freeze(model)
    assert torch.equal(restored(x), model(x))
