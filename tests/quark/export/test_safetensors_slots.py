"""Safetensors export of quantized layers with several quantizers of one role (slots): every weight-like tensor
under its own name, every static activation slot under its attribute's name, re-imported bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export import export_safetensors, import_model_from_safetensors  # noqa: E402
from quark.torch.export.safetensors import activation_key  # noqa: E402
from quark.torch.quantization import api  # noqa: E402
from quark.torch.quantization.nn.modules import quant_modules  # noqa: E402
from quark.torch.quantization.nn.modules.quant_modules import QuantMixin, QuantSlot, register_quant_module  # noqa: E402
from quark_lightning.tasks.recipes import INT4_G32_WEIGHT, INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT  # noqa: E402


class TwoWeights(nn.Module):
    """A custom layer with two weights and a bias, none of them named ``weight``."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(cout, cin) / cin**0.5)
        self.w2 = nn.Parameter(torch.randn(cout, cin) / cin**0.5)
        self.b = nn.Parameter(torch.randn(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w1.T + x @ self.w2.T + self.b


class QuantTwoWeights(QuantMixin, TwoWeights):
    _float_class = TwoWeights

    @classmethod
    def slots_for(cls, module: nn.Module) -> tuple[QuantSlot, ...]:
        return (
            QuantSlot("input_tensors", "_input_quantizer"),
            QuantSlot("input_tensors", "_second_input_quantizer"),  # the input of the w2 product
            QuantSlot("weight", "_w1_quantizer", "w1"),
            QuantSlot("weight", "_w2_quantizer", "w2"),
            QuantSlot("bias", "_b_quantizer", "b"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self._quantize(self._w1_quantizer, self.w1), self._quantize(self._w2_quantizer, self.w2)
        x1, x2 = self._quantize(self._input_quantizer, x), self._quantize(self._second_input_quantizer, x)
        return x1 @ w1.T + x2 @ w2.T + self._quantize(self._b_quantizer, self.b)  # type: ignore[operator]


@pytest.fixture
def two_weights_twin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """QuantTwoWeights registered (configurable by type) for one test; the registries restored after it."""
    saved_map, saved_explicit = dict(quant_modules.QUANT_MODULE_MAP), set(quant_modules.EXPLICIT_ONLY)
    monkeypatch.setattr(api, "SUPPORTED_TYPE_NAMES", sorted({*api.SUPPORTED_TYPE_NAMES, "TwoWeights"}), raising=False)
    register_quant_module(TwoWeights, QuantTwoWeights, explicit_only=True)
    yield
    quant_modules.QUANT_MODULE_MAP.clear()
    quant_modules.QUANT_MODULE_MAP.update(saved_map)
    quant_modules.EXPLICIT_ONLY.clear()
    quant_modules.EXPLICIT_ONLY.update(saved_explicit)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.custom = TwoWeights(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.custom(x)))


def _fresh() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _config(weight: dict) -> dict:
    return {
        "global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT},
        "layer_type_quant_config": {"TwoWeights": {"weight": weight, "input_tensors": INT8_PER_TENSOR_ACT}},
    }


@pytest.mark.parametrize(
    "weight", [INT8_PER_CHANNEL_WEIGHT, INT4_G32_WEIGHT], ids=["int8_per_channel", "int4_per_group"]
)
def test_every_slot_is_stored_and_restored_bit_exactly(weight: dict, two_weights_twin: None, tmp_path: Path) -> None:
    model = _fresh()
    x = torch.randn(32, 64)
    ModelQuantizer(_config(weight)).quantize_model(model, [x])
    assert isinstance(model.custom, QuantTwoWeights)
    with torch.no_grad():
        reference = model(x)
    path = export_safetensors(model, tmp_path, custom_mode=None)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        stored = {k: f.get_tensor(k) for k in keys}
    custom = {k for k in keys if k.startswith("custom.")}
    assert custom == {
        "custom.w1",
        "custom.w1_scale",
        "custom.w1_zero_point",
        "custom.w2",
        "custom.w2_scale",
        "custom.w2_zero_point",
        "custom.b",
        "custom.input_scale",
        "custom.input_zero_point",
        "custom.second_input_scale",
        "custom.second_input_zero_point",
    }
    # keys of the standard layers are unchanged
    assert {k for k in keys if k.startswith("head.")} == {
        "head.weight",
        "head.weight_scale",
        "head.weight_zero_point",
        "head.bias",
        "head.input_scale",
        "head.input_zero_point",
    }
    packed = weight is INT4_G32_WEIGHT
    for name in ("w1", "w2"):  # both weights real-quantized, not float copies
        assert stored[f"custom.{name}"].dtype == (torch.uint8 if packed else torch.int8)
        assert stored[f"custom.{name}"].numel() == (32 * 64 // 2 if packed else 32 * 64)
    assert stored["custom.b"].dtype == torch.float32 and torch.equal(
        stored["custom.b"], model.custom.b.detach()
    )  # no quantizer
    scale, _ = model.custom._second_input_quantizer.calculate_qparams()
    assert torch.equal(stored["custom.second_input_scale"], scale)

    restored = import_model_from_safetensors(_fresh(), tmp_path)
    assert isinstance(restored.custom, QuantTwoWeights)
    with torch.no_grad():
        assert torch.equal(restored(x), reference)
    # each weight slot was decoded from its codes, with its own qparams (not the float weight, not another slot's)
    with torch.no_grad():
        for name in ("w1", "w2"):
            q = getattr(model.custom, f"_{name}_quantizer")
            assert torch.equal(getattr(restored.custom, name), q(getattr(model.custom, name)))
            assert not torch.equal(getattr(restored.custom, name), getattr(model.custom, name))
            assert torch.equal(getattr(restored.custom, f"_{name}_quantizer").scale, q.calculate_qparams()[0])


def test_a_missing_slot_tensor_is_named(two_weights_twin: None, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _fresh()
    x = torch.randn(32, 64)
    ModelQuantizer(_config(INT8_PER_CHANNEL_WEIGHT)).quantize_model(model, [x])
    path = export_safetensors(model, tmp_path, custom_mode=None)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    del tensors["custom.second_input_scale"]
    (tmp_path / "crafted").mkdir()
    save_file(tensors, str(tmp_path / "crafted" / "model.safetensors"), metadata=metadata)
    target = _fresh()
    with pytest.raises(ValueError, match=r"'custom\.second_input_scale'"):
        import_model_from_safetensors(target, tmp_path / "crafted")
    assert type(target.custom) is TwoWeights


def test_activation_keys() -> None:
    names = {
        "_input_quantizer": "input",
        "_output_quantizer": "output",
        "_key_input_quantizer": "key_input",
        "_value_input_quantizer": "value_input",
        "_input_quantizer_l1": "input_l1",
    }
    assert {attr: activation_key(QuantSlot("input_tensors", attr)) for attr in names} == names


def test_lstm_and_attention_round_trip(tmp_path: Path) -> None:
    """The engine's multi-weight twins: per-layer LSTM weights and inputs, attention's packed in-projection."""

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.rnn(x)
            a, _ = self.attn(h, h, h, need_weights=False)
            return self.head(a[:, -1])

    def fresh() -> Seq:
        torch.manual_seed(0)
        return Seq().eval()

    config = {
        "global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT},
        "layer_type_quant_config": {
            t: {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}
            for t in ("LSTM", "MultiheadAttention")
        },
    }
    model = fresh()
    x = torch.randn(4, 5, 8)
    ModelQuantizer(config).quantize_model(model, [x])
    with torch.no_grad():
        reference = model(x)
    path = export_safetensors(model, tmp_path, custom_mode=None)
    with safe_open(str(path), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    for name in (
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
        "rnn.weight_ih_l1",
        "rnn.weight_hh_l1",
        "attn.in_proj_weight",
        "attn.out_proj.weight",
    ):
        assert stored[name].dtype == torch.int8 and name + "_scale" in stored
    assert {
        "rnn.input_scale",
        "rnn.input_l1_scale",
        "attn.input_scale",
        "attn.key_input_scale",
        "attn.value_input_scale",
    } <= set(stored)
    assert not [k for k in stored if "_quantizer" in k]  # no quantizer state stored as a plain tensor
    with torch.no_grad():
        assert torch.equal(import_model_from_safetensors(fresh(), tmp_path)(x), reference)
