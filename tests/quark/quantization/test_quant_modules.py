"""Quantized layer twins: the float op between hand-applied fake quantization, shared Parameters, embeddings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from specs import int_spec
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.nn.modules.quant_modules import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantEmbedding,
    QuantEmbeddingBag,
    QuantLinear,
    QuantMixin,
)
from quark.torch.quantization.observer.observer import PerChannelMinMaxObserver
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase


def per_channel(ch_axis: int = 0, **overrides: Any) -> QuantizationSpec:
    return int_spec(qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=ch_axis, **overrides)


def fq_tensor(t: torch.Tensor, q: FakeQuantizeBase) -> torch.Tensor:
    """Per-tensor int8 fake quantization by torch's kernel with the quantizer's own qparams."""
    scale, zp = q.calculate_qparams()
    return torch.fake_quantize_per_tensor_affine(t, scale.reshape(()), zp.reshape(()).to(torch.int32), -128, 127)


def fq_channel(t: torch.Tensor, q: FakeQuantizeBase, axis: int) -> torch.Tensor:
    scale, zp = q.calculate_qparams()
    return torch.fake_quantize_per_channel_affine(t, scale.reshape(-1), zp.reshape(-1).to(torch.int32), axis, -128, 127)


def channel_scale(w: torch.Tensor, axis: int) -> torch.Tensor:
    """Symmetric int8 scale of each slice: amax / 127.5, at least eps (an all-zero row such as a padding_idx)."""
    amax = w.detach().movedim(axis, 0).reshape(w.shape[axis], -1).abs().amax(dim=1)
    return torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)


FULL = QuantizationConfig(input_tensors=int_spec(), output_tensors=int_spec(), weight=per_channel(0), bias=int_spec())

# (float layer factory, input shape, quantized class, the float functional op with the layer's hyper-parameters)
LAYER_CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], type, Callable[..., torch.Tensor]]] = [
    ("linear", lambda: nn.Linear(8, 6), (5, 8), QuantLinear, lambda m, x, w, b: F.linear(x, w, b)),
    (
        "conv1d",
        lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2),
        (2, 4, 9),
        QuantConv1d,
        lambda m, x, w, b: F.conv1d(x, w, b, stride=2, padding=1, dilation=1, groups=2),
    ),
    (
        "conv2d",
        lambda: nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2),
        (2, 4, 7, 7),
        QuantConv2d,
        lambda m, x, w, b: F.conv2d(x, w, b, stride=1, padding=2, dilation=2, groups=2),
    ),
    (
        "conv3d",
        lambda: nn.Conv3d(2, 4, 3, stride=(1, 2, 1), padding=1),
        (1, 2, 4, 5, 4),
        QuantConv3d,
        lambda m, x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=1),
    ),
    (
        "convtranspose1d",
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        (2, 4, 7),
        QuantConvTranspose1d,
        lambda m, x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
    ),
    (
        "convtranspose2d",
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1),
        (2, 4, 5, 5),
        QuantConvTranspose2d,
        lambda m, x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1, groups=2),
    ),
]


@pytest.mark.parametrize("name, factory, shape, qcls, op", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_quantized_forward_is_the_float_op_between_fake_quantizers(
    name: str, factory: Callable[[], nn.Module], shape: tuple[int, ...], qcls: type, op: Callable[..., torch.Tensor]
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(factory())
    float_layer = model[0]
    weight, bias = float_layer.weight, float_layer.bias
    x = torch.randn(*shape)
    float_out = float_layer(x).detach()

    ModelQuantizer(Config(global_quant_config=FULL)).quantize_model(model, [x])
    layer = model[0]
    assert type(layer) is qcls
    assert isinstance(layer, type(float_layer)) and isinstance(layer, QuantMixin)
    assert layer.weight is weight and layer.bias is bias  # the same Parameter objects, not copies

    # the observers saw the calibration batch and the weight (symmetric int8: amax / 127.5)
    assert torch.equal(layer._input_quantizer.scale, x.abs().max() / 127.5)
    assert torch.equal(layer._weight_quantizer.scale, channel_scale(weight, 0))

    with torch.no_grad():
        out = layer(x)
        xq = fq_tensor(x, layer._input_quantizer)
        wq = fq_channel(weight, layer._weight_quantizer, 0)
        bq = fq_tensor(bias, layer._bias_quantizer)
        expected = fq_tensor(op(layer, xq, wq, bq), layer._output_quantizer)
    assert torch.equal(out, expected)
    assert not torch.equal(out, float_out)  # quantization is really applied


@pytest.mark.parametrize(
    "cls, qcls, fn",
    [
        (nn.ConvTranspose1d, QuantConvTranspose1d, F.conv_transpose1d),
        (nn.ConvTranspose2d, QuantConvTranspose2d, F.conv_transpose2d),
    ],
)
def test_conv_transpose_honours_output_size(cls: type, qcls: type, fn: Callable[..., torch.Tensor]) -> None:
    torch.manual_seed(1)
    dims = 1 if cls is nn.ConvTranspose1d else 2
    model = nn.Sequential(cls(3, 4, 3, stride=2, padding=1))
    x = torch.randn(2, 3, *([5] * dims))
    ModelQuantizer(Config(global_quant_config=FULL)).quantize_model(model, [x])
    layer = model[0]
    assert type(layer) is qcls
    with torch.no_grad():
        out = layer(x, output_size=[10] * dims)  # needs output_padding=1
        xq = fq_tensor(x, layer._input_quantizer)
        wq = fq_channel(layer.weight, layer._weight_quantizer, 0)
        bq = fq_tensor(layer.bias, layer._bias_quantizer)
        expected = fq_tensor(fn(xq, wq, bq, 2, 1, 1), layer._output_quantizer)
    assert out.shape[2:] == (10,) * dims
    assert torch.equal(out, expected)


def test_layer_without_bias_gets_no_bias_quantizer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    x = torch.randn(3, 8)
    (plan,) = ModelQuantizer(Config(global_quant_config=FULL)).resolve(model)
    assert plan.qconfig.bias is None and "bias" not in plan.source  # and no bias row in the summary
    ModelQuantizer(Config(global_quant_config=FULL)).quantize_model(model, [x])
    layer = model[0]
    assert layer._bias_quantizer is None and layer._weight_quantizer is not None
    with torch.no_grad():
        expected = fq_tensor(
            F.linear(fq_tensor(x, layer._input_quantizer), fq_channel(layer.weight, layer._weight_quantizer, 0)),
            layer._output_quantizer,
        )
        assert torch.equal(layer(x), expected)


# ----------------------------------------------------------------------------------------------- embeddings
class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=0)
        self.bag = nn.EmbeddingBag(12, 8, mode="sum")
        self.fc = nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1) + self.bag(idx))


GLOBAL_ONLY = QuantizationConfig(input_tensors=int_spec(), weight=per_channel(0))


def test_embeddings_are_not_quantized_by_the_global_config_alone() -> None:
    torch.manual_seed(0)
    model = Embedder()
    idx = torch.randint(0, 12, (3, 5))
    ModelQuantizer(Config(global_quant_config=GLOBAL_ONLY)).quantize_model(model, [idx])
    assert type(model.emb) is nn.Embedding and type(model.bag) is nn.EmbeddingBag
    assert type(model.fc) is QuantLinear


def test_embedding_named_by_layer_and_bag_by_type() -> None:
    torch.manual_seed(0)
    model = Embedder()
    emb_w, bag_w = model.emb.weight, model.bag.weight
    idx = torch.randint(0, 12, (3, 5))
    cfg = Config(
        global_quant_config=GLOBAL_ONLY,
        layer_quant_config={"emb": QuantizationConfig(output_tensors=int_spec())},
        layer_type_quant_config={nn.EmbeddingBag: QuantizationConfig()},  # named: every role falls back to global
        inherit_roles=True,
    )
    ModelQuantizer(cfg).quantize_model(model, [idx])
    emb, bag = model.emb, model.bag
    assert type(emb) is QuantEmbedding and isinstance(emb, nn.Embedding) and emb.weight is emb_w
    assert type(bag) is QuantEmbeddingBag and isinstance(bag, nn.EmbeddingBag) and bag.weight is bag_w
    # integer indices: no input quantizer even though the global config has one
    assert emb._input_quantizer is None and bag._input_quantizer is None
    assert emb._output_quantizer is not None and bag._output_quantizer is None
    assert torch.equal(emb._weight_quantizer.scale, channel_scale(emb_w, 0))

    with torch.no_grad():
        wq = fq_channel(emb_w, emb._weight_quantizer, 0)
        expected = fq_tensor(F.embedding(idx, wq, padding_idx=0), emb._output_quantizer)
        assert torch.equal(emb(idx), expected)
        assert not torch.equal(emb(idx), F.embedding(idx, emb_w, padding_idx=0))

        flat = torch.randint(0, 12, (7,))
        offsets = torch.tensor([0, 3])
        psw = torch.rand(7)
        bq = fq_channel(bag_w, bag._weight_quantizer, 0)
        expected_bag = F.embedding_bag(flat, bq, offsets, mode="sum", per_sample_weights=psw)
        assert torch.equal(bag(flat, offsets, per_sample_weights=psw), expected_bag)


def test_from_float_shares_parameters_and_to_float_undoes_the_swap() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    twin = QuantLinear.from_float(linear, QuantizationConfig(weight=per_channel(0)))
    assert twin.weight is linear.weight and twin.bias is linear.bias
    assert [id(p) for p in twin.parameters()] == [id(p) for p in linear.parameters()]  # quantizers add no Parameter
    assert "_weight_quantizer" not in linear._modules  # the float module is left as it was
    plain = twin.to_float()
    assert type(plain) is nn.Linear and plain.weight is linear.weight
    assert not any(isinstance(m, FakeQuantizeBase) for m in plain.modules())
