"""ONNX QDQ export: the graph holds QuantizeLinear/DequantizeLinear pairs, and onnxruntime computes what the
fake-quantized model computes (within one output quantization step)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export import export_onnx  # noqa: E402
from quark.torch.quantization.nn.modules import QuantMixin  # noqa: E402
from quark_lightning.tasks.digits import DigitsCNN  # noqa: E402
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT  # noqa: E402

warnings.filterwarnings("ignore", message=".*TracerWarning.*")
UINT8_ACT = {**INT8_PER_TENSOR_ACT, "dtype": "uint8", "symmetric": False}


def _w8a8(last: str, act: dict) -> dict:
    """W8A8 with the last layer's output quantized too, so 'one output quantization step' is defined (its entry is
    whole: a layer_quant_config entry is the layer's entire config, amd-quark's rule)."""
    layer = {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": act}
    return {
        "global_quant_config": layer,
        "layer_quant_config": {last: {**layer, "output_tensors": INT8_PER_TENSOR_ACT}},
    }


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5)).eval()


def _run(path: Path, x: torch.Tensor) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # the QDQ graph as written
    session = ort.InferenceSession(str(path), options)
    return session.run(None, {"input": x.numpy()})[0]


@pytest.mark.parametrize("act", [INT8_PER_TENSOR_ACT, UINT8_ACT], ids=["int8", "uint8"])
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_onnxruntime_agrees_with_the_fake_quant_model(kind: str, act: dict, tmp_path: Path) -> None:
    torch.manual_seed(1)
    if kind == "cnn":
        model, last, x = DigitsCNN(width=8).eval(), "fc2", torch.rand(64, 1, 8, 8)
    else:
        model, last, x = _mlp(), "4", torch.randn(64, 20)
    ModelQuantizer(_w8a8(last, act)).quantize_model(model, [x[:32]])
    with torch.no_grad():
        reference = model(x).numpy()
    path = export_onnx(model, tmp_path, x[:2])
    out = _run(path, x)  # a batch size other than the example's: the batch axis is dynamic
    step = float(dict(model.named_modules())[last]._output_quantizer.calculate_qparams()[0])
    assert np.abs(out - reference).max() <= step * 1.0001
    # most outputs identical; the rest one step apart (ORT sums in another order, so values near a rounding boundary flip)
    assert (np.abs(out - reference) > 1e-6).mean() < 0.2
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    quantized = sum(isinstance(m, QuantMixin) for m in model.modules())
    # activations: QuantizeLinear -> DequantizeLinear at run time; weights: stored as integers, DequantizeLinear only
    assert ops.count("QuantizeLinear") == quantized + 1 and ops.count("DequantizeLinear") == 2 * quantized + 1
    int_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) >= 2]
    assert len(int_weights) == quantized
    float_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 2]
    assert not float_weights  # no float copy of a weight is left in the file
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, QuantMixin))
    assert sum(len(i.raw_data) for i in int_weights) == weights  # one byte per weight


def test_per_channel_weights_keep_their_axis_and_scales(tmp_path: Path) -> None:
    model = _mlp()
    x = torch.randn(16, 20)
    ModelQuantizer(_w8a8("4", INT8_PER_TENSOR_ACT)).quantize_model(model, [x])
    graph = onnx.load(str(export_onnx(model, tmp_path, x))).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"}
    values = {**inits, **consts}
    dequant = [
        n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].ndim == 2
    ]
    scale, zero_point = model[0]._weight_quantizer.calculate_qparams()
    first = next(n for n in dequant if values[n.input[0]].shape == (64, 20))
    assert np.array_equal(values[first.input[1]].astype(np.float32), scale.numpy())
    assert next(a.i for a in first.attribute if a.name == "axis") == 0
    # the stored codes dequantize to exactly the fake-quantized weight
    codes = values[first.input[0]].astype(np.float32)
    assert np.array_equal(codes * scale.numpy()[:, None], model[0]._weight_quantizer(model[0].weight).detach().numpy())


def test_unsupported_formats_are_named(tmp_path: Path) -> None:
    model = _mlp()
    x = torch.randn(8, 20)
    group = {
        "dtype": "int4",
        "qscheme": "per_group",
        "ch_axis": 1,
        "group_size": 4,
        "observer_cls": "PerGroupMinMaxObserver",
        "symmetric": True,
        "round_method": "half_even",
        "scale_type": "float",
        "is_dynamic": False,
    }
    int4_act = {
        **INT8_PER_TENSOR_ACT,
        "dtype": "int4",
    }  # int4 group weights export now (test_onnx_lowbit); int4 inputs do not
    ModelQuantizer({"global_quant_config": {"weight": group, "input_tensors": int4_act}}).quantize_model(model, [x])
    with pytest.raises(
        ValueError,
        match=r"layer '0' \(input_tensors\): ONNX QDQ export supports static int8/uint8 .* got int4, per_tensor",
    ):
        export_onnx(model, tmp_path, x)
    assert not list(tmp_path.iterdir())  # nothing written, not even a temporary


def test_export_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    model = _mlp()
    x = torch.randn(8, 20)
    ModelQuantizer(_w8a8("4", INT8_PER_TENSOR_ACT)).quantize_model(model, [x])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(q).__name__ for m in model.modules() if isinstance(m, QuantMixin) for _, q in m.quantizers()]
    export_onnx(model, tmp_path, x)
    assert [type(q).__name__ for m in model.modules() if isinstance(m, QuantMixin) for _, q in m.quantizers()] == kinds
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_interrupted_onnx_export_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    x = torch.randn(8, 20)
    ModelQuantizer(_w8a8("4", INT8_PER_TENSOR_ACT)).quantize_model(model, [x])

    def broken(module: nn.Module, args: tuple, f: str, **kwargs: object) -> None:
        Path(f).write_bytes(b"half a graph")
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.raises(RuntimeError, match="exporter crashed"):
        export_onnx(model, tmp_path, x)
    assert not list(tmp_path.iterdir())


def test_top_level_names() -> None:
    import quark.torch

    assert quark.torch.export_onnx is export_onnx
    assert callable(quark.torch.export_safetensors) and callable(quark.torch.import_model_from_safetensors)


# ----------------------------------------------------------------------------------------------- real architectures
# The TorchScript exporter merges initializers of equal value: two per-channel layers of one width share one zero
# point tensor, read through an Identity node. Every ResNet and MobileNet has such layers.
class TwoConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: conv-BN-ReLU-conv-BN, identity or 1x1-conv-BN shortcut, add, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class InvertedResidual(nn.Module):
    """MobileNet-V2's block: 1x1 expand-BN-ReLU6, 3x3 depthwise-BN-ReLU6, 1x1 project-BN, residual add."""

    def __init__(self, channels: int, expand: int = 4) -> None:
        super().__init__()
        hidden = channels * expand
        self.conv = nn.Sequential(
            nn.Conv2d(channels, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x)


class TinyMobileNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, 2, 1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU6(inplace=True),
            InvertedResidual(8),
            InvertedResidual(8),
        )
        self.classifier = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def _randomize_batchnorm(model: nn.Module) -> nn.Module:
    """Running statistics and affine terms away from the identity, as a trained network has them."""
    generator = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(0.1 * torch.randn(n, generator=generator))
            m.running_var.copy_(0.5 + torch.rand(n, generator=generator))
            m.weight.data.copy_(0.5 + torch.rand(n, generator=generator))
            m.bias.data.copy_(0.1 * torch.randn(n, generator=generator))
    return model.eval()


def _check_onnxruntime_agrees(model: nn.Module, last: str, x: torch.Tensor, tmp_path: Path) -> onnx.GraphProto:
    """Quantize (W8A8 per-channel weights, per-tensor activations), export, and compare with onnxruntime."""
    ModelQuantizer(_w8a8(last, INT8_PER_TENSOR_ACT)).quantize_model(model, [x[:16], x[16:32]])
    with torch.no_grad():
        reference = model(x).numpy()
    out = _run(export_onnx(model, tmp_path, x[:2]), x)
    step = float(dict(model.named_modules())[last]._output_quantizer.calculate_qparams()[0])
    assert np.abs(out - reference).max() <= step * 1.0001
    assert (np.abs(out - reference) > 1e-6).mean() < 0.2
    graph = onnx.load(str(tmp_path / "quark_model.onnx")).graph
    twins = [m for m in model.modules() if isinstance(m, QuantMixin)]
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") == len(twins) + 1 and ops.count("DequantizeLinear") == 2 * len(twins) + 1
    int_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) >= 2]
    assert sorted(tuple(i.dims) for i in int_weights) == sorted(tuple(m.weight.shape) for m in twins)
    assert sum(len(i.raw_data) for i in int_weights) == sum(m.weight.numel() for m in twins)  # one byte per weight
    float_weights = [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 2]
    assert not float_weights  # no float copy of a weight is left in the file
    return graph


def test_two_convs_of_one_width(tmp_path: Path) -> None:
    torch.manual_seed(0)
    graph = _check_onnxruntime_agrees(TwoConvs().eval(), "fc", torch.randn(48, 3, 6, 6), tmp_path)
    # the case that crashed: both convs' zero points are one tensor, the second read through an Identity node
    producers = {out: n for n in graph.node for out in n.output}
    zero_points = [
        n.input[2] for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_quantized")
    ]
    assert any(producers.get(z) is not None and producers[z].op_type == "Identity" for z in zero_points)


def test_resnet_basic_blocks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _randomize_batchnorm(TinyResNet())
    graph = _check_onnxruntime_agrees(model, "fc", torch.randn(48, 3, 8, 8), tmp_path)
    assert [n.op_type for n in graph.node].count("Add") == 2  # the two residual adds


def test_mobilenet_v2_inverted_residual_blocks(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _randomize_batchnorm(TinyMobileNet())
    graph = _check_onnxruntime_agrees(model, "classifier", torch.randn(48, 3, 8, 8), tmp_path)
    depthwise = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and list(i.dims) == [32, 1, 3, 3]]
    assert len(depthwise) == 2  # both blocks' depthwise convs stored as int8


@pytest.mark.parametrize("mode", ["equal_values", "tied"])
def test_shared_or_merged_weights_are_folded(mode: str, tmp_path: Path) -> None:
    """Equal weights are merged by the exporter (the second read through Identity); a tied weight is one
    initializer read by two QuantizeLinear nodes. Both end as integers, no float copy left."""
    torch.manual_seed(0)
    first = nn.Linear(16, 16)
    second = copy.deepcopy(first)
    if mode == "tied":
        second.weight = first.weight
    model = nn.Sequential(first, nn.ReLU(), second).eval()
    x = torch.randn(32, 16)
    ModelQuantizer(_w8a8("2", INT8_PER_TENSOR_ACT)).quantize_model(model, [x])
    with torch.no_grad():
        reference = model(x).numpy()
    path = export_onnx(model, tmp_path, x[:2])
    step = float(model[2]._output_quantizer.calculate_qparams()[0])
    assert np.abs(_run(path, x) - reference).max() <= step * 1.0001
    graph = onnx.load(str(path)).graph
    assert not [i.name for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 2]
    ops = [n.op_type for n in graph.node]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 5  # weights: DequantizeLinear only
    int_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) == 2]
    assert len(int_weights) == 1  # equal weights with equal qparams: one integer tensor


class _EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class _LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


@pytest.mark.filterwarnings("ignore:.*stay float.*")
@pytest.mark.parametrize(
    ("build", "features"), [(_EncoderModel, 16), (_LSTMModel, 8)], ids=["transformer_encoder_layer", "lstm"]
)
def test_attention_and_lstm_export_agrees_with_onnxruntime(build, features: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(3, 5, features)
    ModelQuantizer(
        {"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT}}
    ).quantize_model(model, [x])
    with torch.no_grad():
        reference = model(x).numpy()
    path = export_onnx(model, tmp_path, x, dynamic_batch=False)
    diff = np.abs(_run(path, x) - reference)
    # onnxruntime's kernels sum in another order: an activation near a rounding boundary may land one step away
    # (the LSTM's second-layer input, inside ORT's LSTM), which moves some outputs by a fraction of that step
    steps = [
        float(q.calculate_qparams()[0])
        for m in model.modules()
        if isinstance(m, QuantMixin)
        for s, q in m.quantizer_slots()
        if s.role == "input_tensors"
    ]
    assert diff.max() < max(steps) and (diff > 1e-5).mean() < 0.5, (diff.max(), (diff > 1e-5).mean())
    graph = onnx.load(str(path)).graph
    weights = [
        q for m in model.modules() if isinstance(m, QuantMixin) for s, q in m.quantizer_slots() if s.role == "weight"
    ]
    int_weights = [i for i in graph.initializer if i.data_type == onnx.TensorProto.INT8 and len(i.dims) >= 2]
    assert len(int_weights) == len(weights)  # attention in-projection / every LSTM gate matrix stored as int8


def test_amd_quarks_export_onnx_call_runs_as_written(tmp_path) -> None:
    """export_onnx(model, output_dir, input_args, opset_version, input_names, output_names) as amd-quark 0.13 takes
    it, writing quark_model.onnx; its 4-bit switch is checked (this model has no int4/uint4 quantizer) and its dynamo
    switch refused, with the reason."""
    model, x = _mlp(), torch.randn(16, 20)
    ModelQuantizer(_w8a8("4", INT8_PER_TENSOR_ACT)).quantize_model(model, [x])
    path = export_onnx(model, tmp_path, (x[:2],), 17, ["features"], ["logits"])
    assert path == tmp_path / "quark_model.onnx"
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["features"] and [o.name for o in graph.output] == ["logits"]
    with pytest.raises(ValueError, match="uint4_int4_flag=True declares an int4/uint4 model, but no quantizer is int4"):
        export_onnx(model, tmp_path / "b", (x[:2],), uint4_int4_flag=True)
    with pytest.raises(ValueError, match="dynamo=True is not supported"):
        export_onnx(model, tmp_path / "c", (x[:2],), dynamo=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_exports_a_float32_graph_onnxruntime_loads(dtype: torch.dtype, tmp_path: Path) -> None:
    """Before, a bf16/fp16 W8A8 model wrote QuantizeLinear nodes on half inputs, which onnxruntime refuses to load,
    and int4 / fp8 weights failed in the exporter with a dtype mismatch."""
    from quark.torch.export.onnx import qdq_model

    model = _mlp().to(dtype)
    x = torch.randn(64, 20).to(dtype)
    ModelQuantizer(_w8a8("4", INT8_PER_TENSOR_ACT)).quantize_model(model, [x[:32]])
    with pytest.warns(
        UserWarning, match=f"is {str(dtype).removeprefix('torch.')}; the ONNX graph is written in float32"
    ):
        path = export_onnx(model, tmp_path, x[:2])
    out = _run(path, x.float())
    with torch.no_grad():
        reference = qdq_model(model).float()(x.float()).numpy()  # the same codes and scales, in float32
    step = float(dict(model.named_modules())["4"]._output_quantizer.calculate_qparams()[0])
    assert out.dtype == np.float32 and np.abs(out - reference).max() <= step * 1.0001
    assert next(model.parameters()).dtype == dtype  # the model itself is left as it was


def test_half_precision_int4_group_weights_export(tmp_path: Path) -> None:
    from quark.torch.export.onnx import qdq_model
    from quark_lightning.tasks.recipes import INT4_G32_WEIGHT

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4)).eval().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    ModelQuantizer({"global_quant_config": {"weight": INT4_G32_WEIGHT}}).quantize_model(model, [x])
    with pytest.warns(UserWarning, match="written in float32"):
        path = export_onnx(model, tmp_path, x)
    with torch.no_grad():
        reference = qdq_model(model).float()(x.float()).numpy()
    assert np.allclose(_run(path, x.float()), reference, atol=1e-5)


class _Logits(nn.Module):
    """A Hugging Face causal LM as a Lightning module or a deployment wrapper calls it: ids -> logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids).logits


@pytest.mark.parametrize("wrapped", [True, False], ids=["logits wrapper", "bare model"])
def test_grouped_query_attention_exports(wrapped: bool, tmp_path: Path) -> None:
    """LLaMA with fewer key/value heads than query heads calls SDPA with enable_gqa=True, which the TorchScript
    exporter cannot convert (before: an AssertionError at the end of fit); the export repeats the key/value heads.
    A bare Hugging Face model (whose output holds a KV cache the exporter cannot take) is written as its logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    lm = transformers.LlamaForCausalLM(config).eval()
    model = _Logits(lm) if wrapped else lm
    ids = torch.randint(0, 64, (2, 12))
    ModelQuantizer({"global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT}}).quantize_model(model, [ids])
    path = export_onnx(model, tmp_path, ids)
    with torch.no_grad():
        reference = _Logits(lm)(ids).numpy()
    assert np.abs(_run(path, ids) - reference).max() < 1e-5


class _Functional(nn.Module):
    """A Parameter used through ``F.linear`` in the model's own forward: graph mode gives it a weight quantizer node."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) * 0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(nn.functional.linear(x, self.w)) + x)


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_graph_mode_functional_weights_export_as_stored_codes(dtype: str, tmp_path: Path) -> None:
    """Before, an int4 functional weight was refused as "an activation" (its quantizer node has no Parameter slot)."""
    from quark.torch.quantization.graph import capture

    torch.manual_seed(0)
    weight = {**INT8_PER_CHANNEL_WEIGHT, "dtype": dtype}
    data = [torch.randn(4, 16) for _ in range(3)]
    config = {
        "global_quant_config": {"weight": weight, "input_tensors": INT8_PER_TENSOR_ACT},
        "quant_mode": "fx_graph_mode",
    }
    model = ModelQuantizer.freeze(
        ModelQuantizer(config).quantize_model(capture(_Functional().eval(), (data[0],)), data)
    )
    path = export_onnx(model, tmp_path, data[0])
    graph = onnx.load(str(path)).graph
    inits = {i.name: i for i in graph.initializer}
    (stored,) = [i for i in inits.values() if list(i.dims) == [16, 16]]  # the functional weight
    assert stored.data_type == (
        onnx.TensorProto.INT4 if dtype == "int4" else onnx.TensorProto.INT8
    )  # int4: two per byte
    (dequant,) = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] == stored.name]
    quantizer = model.get_submodule("_graph_quantizers.w_linear._weight_quantizer")
    scale = quantizer.calculate_qparams()[0].detach().numpy()
    # exact: the stored codes and scale are the model's (its fake-quantized weight is code * scale, |code| <= 127)
    assert np.array_equal(onnx.numpy_helper.to_array(inits[dequant.input[1]]), scale)
    with torch.no_grad():
        codes = torch.round(quantizer(model.w) / torch.from_numpy(scale)[:, None]).to(torch.int8).numpy()
    assert np.array_equal(onnx.numpy_helper.to_array(stored).astype(np.int8), codes)
    x = torch.randn(5, 16)
    with torch.no_grad():
        reference = model(x).numpy()
    # float32 outputs of two runtimes: onnxruntime sums in its own order (its kernels, its thread count), so the last
    # bits may differ (seen in the 7th digit under load); 1e-5 relative is far below one quantization step here
    np.testing.assert_allclose(_run(path, x), reference, rtol=1e-5, atol=1e-5 * float(np.abs(reference).max()))
