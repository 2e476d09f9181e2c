"""Issue 33, the bugs found on models nobody here wrote: weight-norm convs (Wav2Vec2 / HuBERT positional conv) in
PTQ and export, in-place Dropout and ``aten.where.ScalarOther`` (Gemma2) in graph mode."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils import weight_norm as old_weight_norm
from torch.nn.utils.parametrizations import weight_norm

from quark.torch import ModelQuantizer, export_onnx, export_safetensors, import_model_from_safetensors
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.nn.modules import QuantConv1d, QuantMixin
from quark.torch.quantization.tensor_quantize import BakedFakeQuantize, FrozenScaledFakeQuantize

warnings.filterwarnings("ignore", message=".*LeafSpec.*")
warnings.filterwarnings("ignore", message=".*torch.nn.utils.weight_norm.*is deprecated")

SYM8 = {
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "symmetric": True,
    "round_method": "half_even",
    "scale_type": "float",
    "is_dynamic": False,
}
W8 = {**SYM8, "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"}


def w8a8(**extra: object) -> Config:
    return Config.from_dict({"global_quant_config": {"input_tensors": SYM8, "weight": W8}, **extra})


# ----------------------------------------------------------------------------------------------- weight norm
def norm_weight(g: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """weight_norm's weight, written out: ``g * v / ||v||``, the norm over every dimension but ``dim``."""
    dims = [d for d in range(v.ndim) if d != dim]
    return g * v / v.pow(2).sum(dims, keepdim=True).sqrt()


def channel_scale(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per-output-channel scale (amax / 127.5), as PerChannelMinMaxObserver computes it."""
    return w.detach().reshape(w.shape[0], -1).abs().amax(1) / 127.5


def fake_quant(t: torch.Tensor, scale: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """int8 fake quantization by torch's own kernels (zero point 0)."""
    if axis is None:
        return torch.fake_quantize_per_tensor_affine(t, float(scale), 0, -128, 127)
    zp = torch.zeros(scale.numel(), dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(t, scale.reshape(-1), zp, axis, -128, 127)


def wn_conv(style: Callable[..., nn.Module], seed: int = 0) -> nn.Sequential:
    """A Wav2Vec2-style positional conv (grouped, weight_norm over the kernel dimension, dim=2) before a Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(style(nn.Conv1d(4, 6, 3, padding=1, groups=2), name="weight", dim=2), nn.Linear(5, 3))


def gv(conv: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, v) of either weight_norm style."""
    if parametrize.is_parametrized(conv):
        return conv.parametrizations.weight.original0, conv.parametrizations.weight.original1
    return conv.weight_g, conv.weight_v


def conv_weight_codes(path: object) -> torch.Tensor:
    """The int8 initializer that the ONNX graph's Conv dequantizes as its weight."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    producers = {out: node for node in graph.node for out in node.output}
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    conv = next(n for n in graph.node if n.op_type == "Conv")
    dq = producers[conv.input[1]]
    assert dq.op_type == "DequantizeLinear" and dq.input[0] in inits, "the weight is not stored as codes"
    return torch.from_numpy(inits[dq.input[0]].copy())


STYLES = [pytest.param(weight_norm, id="parametrizations"), pytest.param(old_weight_norm, id="old_style")]


@pytest.mark.parametrize("style", STYLES)
def test_weight_norm_conv_is_quantized_through_its_computed_weight(style: Callable[..., nn.Module]) -> None:
    """PTQ quantizes a weight-norm conv (before: 'QuantConv1d' object has no attribute 'weight' for the
    parametrization; the old-style hook's weight was observed as it was at the last forward): the weight quantizer
    sees the weight g * v / ||v|| of the current g and v, on every forward, and the output is the float conv on the
    fake-quantized computed weight. No part of it is reported float."""
    model = wn_conv(style)
    conv = model[0]
    g, v = gv(conv)
    with torch.no_grad():
        g.mul_(1.5)  # a training step since the last forward: the old-style hook's stored weight is stale
    x = torch.randn(2, 4, 5)
    quantizer = ModelQuantizer(w8a8())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stays float: no warning
        quantizer.quantize_model(model, [x])
    layer = model[0]
    assert isinstance(layer, QuantConv1d) and isinstance(layer, QuantMixin)
    assert gv(layer) == (g, v)  # the same Parameters
    assert quantizer.float_layers(model) == []
    w = norm_weight(g, v, 2).detach()
    torch.testing.assert_close(layer._weight_quantizer.scale, channel_scale(w), rtol=1e-6, atol=0)

    def expected() -> torch.Tensor:
        xq = fake_quant(x, layer._input_quantizer.scale)
        wq = fake_quant(norm_weight(g, v, 2), layer._weight_quantizer.scale, 0)
        return F.conv1d(xq, wq, conv.bias, padding=1, groups=2)

    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected(), rtol=1e-6, atol=1e-6)
        v.add_(0.1 * torch.randn_like(v))  # new g / v (QAT): the next forward quantizes the new computed weight
        torch.testing.assert_close(layer(x), expected(), rtol=1e-6, atol=1e-6)
    if parametrize.is_parametrized(conv):
        assert parametrize.is_parametrized(layer, "weight")
        assert type(layer.to_float()) is type(conv)  # back to the parametrized float class
    # training through the twin reaches g and v
    model.train()
    model(x).sum().backward()
    assert g.grad is not None and v.grad is not None


@pytest.mark.parametrize("style", STYLES)
def test_weight_norm_conv_freeze_and_exports(tmp_path, style: Callable[..., nn.Module]) -> None:  # noqa: ANN001
    """A frozen weight-norm conv exports to ONNX with its computed weight's codes (before, the old style's non-leaf
    weight stopped the deep copy) and to both safetensors layouts, from which a fresh model imports to the same
    outputs; baking writes nothing it cannot write (the weight is computed at each forward: its frozen quantizer stays)."""
    model = wn_conv(style)
    x = torch.randn(2, 4, 5)
    ModelQuantizer(w8a8()).quantize_model(model, [x])
    ModelQuantizer.freeze(model)
    ref = model(x).detach()
    model(x).sum().backward()  # the old-style hook leaves a non-leaf weight behind

    ort = pytest.importorskip("onnxruntime")
    path = export_onnx(model, tmp_path / "onnx", x)
    codes = conv_weight_codes(path)  # the computed weight's codes, stored (not recomputed from g and v in the graph)
    layer = model[0]
    with torch.no_grad():
        scale = layer._weight_quantizer.scale.view(-1, 1, 1)
        used = layer._weight_quantizer(layer.weight)  # the fake-quantized weight the torch model runs with
    assert torch.equal(codes.float() * scale, used)
    session = ort.InferenceSession(str(path))
    out = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    # two runtimes: a conv output on a rounding tie of the next layer's input quantizer may move one step
    torch.testing.assert_close(torch.from_numpy(out), ref, rtol=0, atol=1e-2)

    for mode in (None, "quark"):
        folder = tmp_path / f"st-{mode}"
        export_safetensors(model, folder, custom_mode=mode)
        imported = import_model_from_safetensors(wn_conv(style, seed=1), folder)
        torch.testing.assert_close(imported(x), ref, rtol=0, atol=1e-6)

    ModelQuantizer.freeze(model, bake_weights=True)
    assert (
        type(model[0]._weight_quantizer) is FrozenScaledFakeQuantize
        and type(model[1]._weight_quantizer) is BakedFakeQuantize
    )
    torch.testing.assert_close(model(x), ref, rtol=0, atol=1e-6)


def test_weight_norm_conv_excluded_is_named_float() -> None:
    """An excluded weight-norm conv is reported once, as the layer (not as its parametrization's ParametrizationList),
    even without a bias of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(weight_norm(nn.Conv1d(4, 4, 3, padding=1, bias=False), dim=2), nn.Linear(5, 3))
    quantizer = ModelQuantizer(w8a8(exclude=["0"]))
    quantizer.quantize_model(model, [torch.randn(2, 4, 5)])
    floats = quantizer.float_layers(model)
    assert [(f.name, f.reason) for f in floats] == [("0", "excluded by Config.exclude")]


def test_hf_wav2vec2_positional_conv_is_quantized() -> None:
    """transformers' Wav2Vec2 (weight_norm on its positional conv) goes through PTQ with that conv quantized and
    stays close to the float model."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(cfg).eval()
    conv = model.encoder.pos_conv_embed.conv
    assert parametrize.is_parametrized(conv, "weight")
    x = torch.randn(2, 400)
    with torch.no_grad():
        ref = model(x).last_hidden_state
    quantizer = ModelQuantizer(w8a8())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # norms and masked_spec_embed stay float (named)
        quantizer.quantize_model(model, [x])
    layer = model.encoder.pos_conv_embed.conv
    assert isinstance(layer, QuantConv1d)
    w = norm_weight(*gv(layer), 2).detach()
    torch.testing.assert_close(layer._weight_quantizer.scale, channel_scale(w), rtol=1e-6, atol=0)
    assert not any("pos_conv" in f.name for f in quantizer.float_layers(model))
    with torch.no_grad():
        out = model(x).last_hidden_state
    assert float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-2


# ----------------------------------------------------------------------------------------------- graph mode
def graph_w8a8() -> Config:
    return w8a8(quant_mode="fx_graph_mode")


def fake_quant_enabled(model: nn.Module, enabled: bool) -> None:
    """Every quantizer on or off (off: the graph computes the float function)."""
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

    for q in model.modules():
        if isinstance(q, FakeQuantizeBase):
            q.enable_fake_quant() if enabled else q.disable_fake_quant()


class InPlaceHead(nn.Module):
    """torchvision's MobileNetV3 / EfficientNet head as those models build it: in-place Hardswish, ReLU and ReLU6, an
    in-place Dropout between the classifier's Linears, another before the last one (EfficientNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.Hardswish(inplace=True),
            nn.Conv2d(8, 8, 1),
            nn.ReLU6(inplace=True),
            nn.Conv2d(8, 8, 1),
            nn.ReLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(8, 16),
            nn.Hardswish(inplace=True),
            nn.Dropout(p=0.5, inplace=True),
            nn.Linear(16, 16),
            nn.Dropout(p=0.2, inplace=True),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


@pytest.mark.parametrize("captured_in", ["eval", "train"])
def test_graph_mode_in_place_dropout(captured_in: str) -> None:
    """Graph mode takes in-place Dropout (before: 'no quantization rule for aten.dropout_.default'): it stays the
    model's dropout (active in train(), identity in eval()), every Linear and conv is quantized, and with the
    quantizers off the graph is the float model in both modes (same dropout masks from the same seed)."""
    from quark.torch.quantization.graph import capture

    torch.manual_seed(0)
    model = InPlaceHead().train(captured_in == "train")
    x = torch.randn(8, 3, 8, 8)
    quantizer = ModelQuantizer(graph_w8a8())
    gm = quantizer.quantize_model(capture(model, (x[:4],)), [x])
    layers = {p.name for p in quantizer.resolve(gm)}
    assert layers == {"features.0", "features.2", "features.4", "classifier.0", "classifier.3", "classifier.5"}
    dropouts = [m for m in gm.modules() if isinstance(m, nn.Dropout)]
    assert sorted(d.p for d in dropouts) == [0.2, 0.5] and all(d.inplace for d in dropouts)
    fake_quant_enabled(gm, False)
    for mode in (False, True):
        gm.train(mode)
        model.train(mode)
        torch.manual_seed(1)
        ref = model(x.clone())
        torch.manual_seed(1)
        torch.testing.assert_close(gm(x.clone()), ref, rtol=1e-5, atol=1e-6)
    gm.train()
    assert not torch.equal(gm(x), gm(x))  # dropout is live in train()
    fake_quant_enabled(gm, True)
    gm.eval()
    model.eval()
    ref = model(x)
    out = gm(x)
    assert not torch.equal(out, ref)
    assert float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-2


def test_graph_mode_hf_gemma2() -> None:
    """A tiny Gemma2ForCausalLM (its mask building uses ``aten.where.ScalarOther``; before: 'no quantization rule')
    goes through graph mode: with the quantizers off it computes the float model, quantized it stays close on ragged
    batches of other sizes than the calibration's."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=8,
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()

    def batch(n: int, t: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(n, t, dtype=torch.long)
        mask[0, : t // 3] = 0  # left padding
        return {"input_ids": torch.randint(0, 128, (n, t)), "attention_mask": mask}

    batches = [batch(4, 16), batch(3, 16), batch(2, 12)]
    quantizer = ModelQuantizer(graph_w8a8())
    gm = quantizer.quantize_model(model, batches[:2])
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    planned = {p.name for p in quantizer.resolve(gm)}
    assert linears <= planned and all(n.endswith("self_attn") for n in planned - linears)  # + attention matmuls
    with torch.no_grad():
        for b in batches:
            ref = model(**b).logits
            fake_quant_enabled(gm, False)
            torch.testing.assert_close(gm(**b).logits, ref, rtol=1e-4, atol=1e-5)
            fake_quant_enabled(gm, True)
            err = (gm(**b).logits - ref).pow(2).mean() / ref.pow(2).mean()
            assert 0 < float(err) < 1e-2


def test_graph_mode_weight_norm_conv_quantizes_its_computed_weight() -> None:
    """Graph mode on a weight-norm conv (before: 'no quantization rule for aten._weight_norm'): the weight computed
    from g and v gets a weight quantizer before the conv (its qparams those of the computed weight), and nothing is
    reported float; the output is the conv of the quantized input and computed weight."""
    model = wn_conv(weight_norm)
    x = torch.randn(4, 4, 5)
    quantizer = ModelQuantizer(graph_w8a8())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no float layer named
        gm = quantizer.quantize_model(model, [x])
    assert quantizer.float_layers(gm) == []
    from quark.torch.quantization.graph import QuantFunctionalWeight

    holders = [m for m in gm.modules() if isinstance(m, QuantFunctionalWeight)]
    assert len(holders) == 1
    g, v = gv(model[0])
    w = norm_weight(g, v, 2).detach()
    torch.testing.assert_close(holders[0]._weight_quantizer.scale, channel_scale(w), rtol=1e-6, atol=0)
    with torch.no_grad():
        ref = model(x)
        out = gm(x)
    assert not torch.equal(out, ref)
    assert float((out - ref).pow(2).mean() / ref.pow(2).mean()) < 1e-3


def test_graph_of_hf_causal_lm_takes_labels() -> None:
    """A graph captured from ``model(input_ids=...)`` (or with ``labels=None``) takes ``labels=`` as the model does
    (before: TypeError 'unexpected keyword argument'): the float graph's loss is the model's own loss, the quantized
    graph's loss is the next-token cross entropy of its logits, and it trains the weights."""
    transformers = pytest.importorskip("transformers")
    from quark.torch.quantization.graph import capture

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (3, 8))
    expected = model(input_ids=ids, labels=ids).loss
    for example in ({"input_ids": ids}, {"input_ids": ids, "labels": None}):
        gm = capture(model, (), example)
        out = gm(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
        assert gm(input_ids=ids).loss is None  # no labels: no loss, as the model
    quantized = ModelQuantizer(graph_w8a8()).quantize_model(gm, [{"input_ids": ids}])
    quantized.train()
    out = quantized(input_ids=ids, labels=ids)
    reference = F.cross_entropy(out.logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, reference, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None
