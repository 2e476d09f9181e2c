"""Low-bit ONNX export: int4 / uint4 weights (per channel, per group) stored as INT4 / UINT4 codes read by
DequantizeLinear (opset 21, ``block_size`` for groups), fp8 weights and activations as FLOAT8 Q/DQ; onnxruntime
computes what the frozen torch model (the simulation) computes, and what ONNX cannot express fails before any work."""

from __future__ import annotations

import copy
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, numpy_helper  # noqa: E402

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export import check_onnx_exportable, export_onnx  # noqa: E402
from quark.torch.quantization.nn.modules import QuantMixin  # noqa: E402
from quark_lightning.tasks.recipes import (  # noqa: E402
    FP8_PER_TENSOR,
    INT4_G32_WEIGHT,
    INT8_PER_CHANNEL_WEIGHT,
    INT8_PER_TENSOR_ACT,
    MXFP4,
)

warnings.filterwarnings("ignore", message=".*TracerWarning.*")
U4_G32 = {**INT4_G32_WEIGHT, "dtype": "uint4", "symmetric": False}
INT8_G32 = {**INT4_G32_WEIGHT, "dtype": "int8"}
INT4_PER_CHANNEL = {**INT8_PER_CHANNEL_WEIGHT, "dtype": "int4"}
E5M2 = {**FP8_PER_TENSOR, "dtype": "fp8_e5m2"}
BASIC, ALL = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
# The weights are bit-exact (checked code by code below) and every Q/DQ rounds as torch does, so what is left between
# onnxruntime and torch is float32 summation order inside Conv / Gemm: a few ulps of the output (measured <= 4e-7 of
# max|y|). 1e-5 of max|y| (~80 ulps) is far below what one wrong code moves an output (a weight scale times an input).
FLOAT_NOISE = 1e-5


class ConvNet(nn.Module):
    """Conv2d and Linear layers whose input widths (64, 32, 64) are multiples of the group size 32."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 32, 3, padding=1)
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv(x)).mean((2, 3))
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 32), nn.ReLU(), nn.Linear(32, 8))


MODELS = {"convnet": (ConvNet, "fc2", (64, 64, 6, 6)), "mlp": (_mlp, "4", (64, 64))}


def _config(weight: dict, act: dict | None = None, last: str | None = None, output: dict | None = None) -> dict:
    """Every layer: ``weight`` (+ ``act`` inputs); ``last`` also quantizes its output (a whole entry, so that either
    resolution rule, amd-quark's or inherit_roles, gives the same layers)."""
    layer = {"weight": weight, "input_tensors": act}
    config: dict = {"global_quant_config": layer}
    if output is not None:
        config["layer_quant_config"] = {last: {**layer, "output_tensors": output}}
    return config


def _quantized(kind: str, config: dict) -> tuple[nn.Module, str, torch.Tensor]:
    torch.manual_seed(0)
    build, last, shape = MODELS[kind]
    model, x = build().eval(), torch.randn(shape)
    ModelQuantizer(config).quantize_model(model, [x[:32], x[32:]])
    return model, last, x


def _simulation(model: nn.Module, x: torch.Tensor) -> np.ndarray:
    """The frozen torch model's output: what the ONNX graph must compute."""
    with torch.no_grad():
        return ModelQuantizer.freeze(copy.deepcopy(model))(x).numpy()


def _run(path: Path, x: torch.Tensor, level: ort.GraphOptimizationLevel = BASIC) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x.numpy()})[0]


def _load(path: Path) -> onnx.ModelProto:
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _opset(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _weight_dequantizers(proto: onnx.ModelProto, model: nn.Module) -> dict[str, onnx.NodeProto]:
    """layer name -> the DequantizeLinear that reads its stored weight codes."""
    dequant = {n.input[0]: n for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    layers = [name for name, m in model.named_modules() if isinstance(m, QuantMixin)]
    return {name: dequant[f"{name}.weight_quantized"] for name in layers}


def _assert_no_float_weight(proto: onnx.ModelProto, model: nn.Module) -> None:
    """No float copy of a quantized weight, original or fake-quantized, in any layout (values compared sorted)."""
    frozen = ModelQuantizer.freeze(copy.deepcopy(model))
    copies = [
        np.sort(t.detach().numpy().reshape(-1))
        for m in frozen.modules()
        if isinstance(m, QuantMixin)
        for name, q in m.param_quantizers()
        for t in (getattr(m, name), q(getattr(m, name)))
    ]
    floats = [
        np.sort(numpy_helper.to_array(i).reshape(-1))
        for i in proto.graph.initializer
        if i.data_type == TensorProto.FLOAT
    ]
    assert not any(f.shape == c.shape and np.array_equal(f, c) for f in floats for c in copies)


def _dequantize(
    codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | int, axis: int, block: int
) -> np.ndarray:
    """DequantizeLinear per the ONNX spec, in numpy (scale / zero point repeated over their blocks along ``axis``)."""
    if block:
        scale = np.repeat(scale, block, axis=axis)
        zero_point = np.repeat(zero_point, block, axis=axis) if np.ndim(zero_point) else zero_point
    else:
        shape = [1] * codes.ndim
        shape[axis] = -1
        scale, zero_point = scale.reshape(shape), np.reshape(zero_point, shape) if np.ndim(zero_point) else zero_point
    return ((codes.astype(np.int32) - np.asarray(zero_point).astype(np.int32)) * scale).astype(np.float32)


def _assert_close_to_fp8_simulation(out: np.ndarray, reference: np.ndarray, scale: float) -> None:
    """Nearly every output equal to the simulation's (float noise); the rest at most one e4m3 step of the output
    quantizer at the largest output. onnxruntime sums in another order, so an activation next to an fp8 rounding
    boundary may round the other way; that moves outputs by about its own step times a weight, which stays below the
    coarsest output step in use (it may exceed the finer step of a small output: fp8 steps grow with the value)."""
    coarsest = 2.0 ** (np.floor(np.log2(np.abs(reference).max() / scale)) - 3) * scale  # e4m3: 3 mantissa bits
    diff = np.abs(out - reference)
    assert diff.max() <= coarsest * 1.0001 and (diff > FLOAT_NOISE * np.abs(reference).max()).mean() < 0.05, diff.max()


# ----------------------------------------------------------------------------------------------- (a) per-group weights
@pytest.mark.parametrize(
    ("spec", "onnx_type", "bits"),
    [(INT4_G32_WEIGHT, TensorProto.INT4, 4), (U4_G32, TensorProto.UINT4, 4), (INT8_G32, TensorProto.INT8, 8)],
    ids=["int4_sym", "uint4_asym", "int8_sym"],
)
@pytest.mark.parametrize("kind", ["convnet", "mlp"])
def test_per_group_weights_are_stored_as_codes(
    kind: str, spec: dict, onnx_type: int, bits: int, tmp_path: Path
) -> None:
    model, _, x = _quantized(kind, _config(spec))
    path = export_onnx(model, tmp_path, x[:2])
    reference = _simulation(model, x)
    for level in (BASIC, ALL):  # the graph as written, and as onnxruntime's default session optimizes it
        assert np.abs(_run(path, x, level) - reference).max() <= FLOAT_NOISE * np.abs(reference).max()
    proto = _load(path)
    assert _opset(proto) == 21  # DequantizeLinear's block_size and INT4 / UINT4: chosen automatically
    inits = {i.name: i for i in proto.graph.initializer}
    frozen = dict(ModelQuantizer.freeze(copy.deepcopy(model)).named_modules())
    for name, dq in _weight_dequantizers(proto, model).items():
        layer, codes = frozen[name], inits[dq.input[0]]
        weight = layer.weight
        assert codes.data_type == onnx_type and tuple(codes.dims) == tuple(weight.shape)
        assert len(codes.raw_data) == math.ceil(weight.numel() * bits / 8)  # two 4-bit codes a byte
        assert _attrs(dq) == {"axis": 1, "block_size": 32}
        scale = numpy_helper.to_array(inits[dq.input[1]])
        assert scale.shape == (weight.shape[0], weight.shape[1] // 32, *weight.shape[2:])
        if spec["symmetric"]:
            assert len(dq.input) == 2  # zero point 0: not written
            zero_point: np.ndarray | int = 0
        else:
            assert inits[dq.input[2]].data_type == onnx_type and tuple(inits[dq.input[2]].dims) == scale.shape
            zero_point = numpy_helper.to_array(inits[dq.input[2]])
        values = _dequantize(numpy_helper.to_array(codes), scale, zero_point, 1, 32)
        assert np.array_equal(
            values, layer._weight_quantizer(weight).detach().numpy()
        )  # bit-exact: the simulation's weight
    _assert_no_float_weight(proto, model)


# ----------------------------------------------------------------------------------------------- (b) W4A8
@pytest.mark.parametrize("kind", ["convnet", "mlp"])
def test_int4_per_channel_weights_with_int8_activations(kind: str, tmp_path: Path) -> None:
    last = MODELS[kind][1]
    model, _, x = _quantized(kind, _config(INT4_PER_CHANNEL, INT8_PER_TENSOR_ACT, last, INT8_PER_TENSOR_ACT))
    path = export_onnx(model, tmp_path, x[:2])
    reference = _simulation(model, x)
    out = _run(path, x)
    # an int8 activation next to a rounding boundary may land one step away in onnxruntime (another summation order),
    # which moves an output by at most one step of the last layer's output quantizer
    step = float(dict(model.named_modules())[last]._output_quantizer.calculate_qparams()[0])
    diff = np.abs(out - reference)
    assert diff.max() <= step * 1.0001 and (diff > 1e-6).mean() < 0.2, (diff.max(), step)
    proto = _load(path)
    assert _opset(proto) == 21
    inits = {i.name: i for i in proto.graph.initializer}
    dequantizers = _weight_dequantizers(proto, model)
    for name, dq in dequantizers.items():
        codes = inits[dq.input[0]]
        assert codes.data_type == TensorProto.INT4 and _attrs(dq) == {"axis": 0} and len(dq.input) == 2
        assert tuple(codes.dims) == tuple(dict(model.named_modules())[name].weight.shape)
    # activations stay int8 QuantizeLinear -> DequantizeLinear, computed at run time
    quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantize) == len(dequantizers) + 1  # every input and the last output
    producers = {o: n for n in proto.graph.node for o in n.output}
    zero_points = [inits.get(q.input[2]) or producers[q.input[2]].attribute[0].t for q in quantize]
    assert {z.data_type for z in zero_points} == {TensorProto.INT8}
    _assert_no_float_weight(proto, model)


# ----------------------------------------------------------------------------------------------- (c) fp8
@pytest.mark.parametrize("kind", ["convnet", "mlp"])
def test_fp8_e4m3_weights_and_activations(kind: str, tmp_path: Path) -> None:
    last = MODELS[kind][1]
    model, _, x = _quantized(kind, _config(FP8_PER_TENSOR, FP8_PER_TENSOR, last, FP8_PER_TENSOR))
    path = export_onnx(model, tmp_path, x[:2])
    reference = _simulation(model, x)
    # the fp8 weights are exact; QuantizeLinear rounds x / scale to the nearest e4m3 value, saturating, as torch's
    # float8 cast does, so only summation order is left
    scale = float(dict(model.named_modules())[last]._output_quantizer.calculate_qparams()[0])
    for level in (BASIC, ALL):  # ALL: onnxruntime's default, which runs ReluQuantRewrite (see the opset 19 test)
        _assert_close_to_fp8_simulation(_run(path, x, level), reference, scale)
    proto = _load(path)
    assert _opset(proto) == 21  # fp8 needs 19; 21 so that QuantizeLinear takes output_dtype instead of a zero point
    inits = {i.name: i for i in proto.graph.initializer}
    for name, dq in _weight_dequantizers(proto, model).items():
        codes, weight = inits[dq.input[0]], dict(model.named_modules())[name].weight
        assert codes.data_type == TensorProto.FLOAT8E4M3FN and tuple(codes.dims) == tuple(weight.shape)
        assert len(codes.raw_data) == weight.numel()  # one byte a weight
    quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantize) == len(_weight_dequantizers(proto, model)) + 1  # every layer input and the last output
    assert all(_attrs(q) == {"output_dtype": TensorProto.FLOAT8E4M3FN} and len(q.input) == 2 for q in quantize)
    _assert_no_float_weight(proto, model)


def test_fp8_at_opset_19_uses_a_float8_zero_point(tmp_path: Path) -> None:
    """Opsets 19 and 20 have only the zero point to make QuantizeLinear produce fp8. onnxruntime 1.32 then removes a
    Relu in front of it at level EXTENDED and up (ReluQuantRewrite knows only int8 / uint8 zero points): warned."""
    model, _, x = _quantized("mlp", _config(FP8_PER_TENSOR, FP8_PER_TENSOR, "4", FP8_PER_TENSOR))
    with pytest.warns(UserWarning, match=r"4\.input: at opset 19 .*ReluQuantRewrite"):
        path = export_onnx(model, tmp_path, x[:2], opset_version=19)
    proto = _load(path)
    assert _opset(proto) == 19
    inits = {i.name: i for i in proto.graph.initializer}
    quantize = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    assert len(quantize) == 4
    for q in quantize:
        zero_point = inits[q.input[2]]
        assert zero_point.data_type == TensorProto.FLOAT8E4M3FN and list(zero_point.dims) == []
    reference = _simulation(model, x)
    scale = float(model[4]._output_quantizer.calculate_qparams()[0])
    _assert_close_to_fp8_simulation(_run(path, x), reference, scale)
    session = ort.InferenceSession(
        str(path), providers=["CPUExecutionProvider"], disabled_optimizers=["ReluQuantRewrite"]
    )
    _assert_close_to_fp8_simulation(session.run(None, {"input": x.numpy()})[0], reference, scale)


def test_a_bias_onnxruntime_would_overflow_is_warned_about(tmp_path: Path) -> None:
    """onnxruntime's WeightBiasQuantization rewrites a Conv / Gemm bias between Q/DQ as int32 bias / (input scale *
    weight scale); small fp8 scales take that past 2^31. The export warns, and the remedy it names gives the right output."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), 1e-3 * torch.randn(32, 16)
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
        model[0].bias.fill_(0.25)
    ModelQuantizer(_config(FP8_PER_TENSOR, FP8_PER_TENSOR)).quantize_model(model, [x])
    with pytest.warns(UserWarning, match=r"/0/Gemm: onnxruntime's WeightBiasQuantization .* past the int32 range"):
        path = export_onnx(model, tmp_path, x[:2])
    reference = _simulation(model, x)
    session = ort.InferenceSession(
        str(path), providers=["CPUExecutionProvider"], disabled_optimizers=["WeightBiasQuantization"]
    )
    assert np.abs(session.run(None, {"input": x.numpy()})[0] - reference).max() <= FLOAT_NOISE * np.abs(reference).max()


# ----------------------------------------------------------------------------------------------- opset and flags
def test_an_explicit_opset_too_old_for_a_layer_is_refused(tmp_path: Path) -> None:
    model, _, x = _quantized("mlp", _config(INT4_G32_WEIGHT))
    with pytest.raises(
        ValueError, match=r"layer '0' \(weight\), int4, per_group, ch_axis=1 .* needs opset 21; got opset_version=20"
    ):
        export_onnx(model, tmp_path, x[:2], opset_version=20)
    model, _, x = _quantized("mlp", _config(FP8_PER_TENSOR, FP8_PER_TENSOR))
    with pytest.raises(
        ValueError, match=r"layer '0' \(input_tensors\), fp8_e4m3, per_tensor .* needs opset 19; got opset_version=18"
    ):
        export_onnx(model, tmp_path, x[:2], opset_version=18)
    assert not list(tmp_path.iterdir())


def test_int8_models_keep_opset_17_and_may_ask_for_21(tmp_path: Path) -> None:
    model, last, x = _quantized("mlp", _config(INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT, "4", INT8_PER_TENSOR_ACT))
    assert _opset(_load(export_onnx(model, tmp_path / "a", x[:2]))) == 17
    path = export_onnx(model, tmp_path / "b", x[:2], opset_version=21)  # beyond the TorchScript exporter: converted
    assert _opset(_load(path)) == 21
    step = float(dict(model.named_modules())[last]._output_quantizer.calculate_qparams()[0])
    assert np.abs(_run(path, x) - _simulation(model, x)).max() <= step * 1.0001


def test_uint4_int4_flag(tmp_path: Path) -> None:
    """amd-quark's switch declares a 4-bit model: accepted for one (the file is the same), refused for an 8-bit one."""
    model, _, x = _quantized("mlp", _config(U4_G32))
    plain = export_onnx(model, tmp_path / "a", x[:2]).read_bytes()
    assert export_onnx(model, tmp_path / "b", (x[:2],), None, [], [], uint4_int4_flag=True).read_bytes() == plain
    model, _, x = _quantized("mlp", _config(INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT))
    with pytest.raises(
        ValueError, match="uint4_int4_flag=True declares an int4/uint4 model, but no quantizer is int4 or uint4"
    ):
        export_onnx(model, tmp_path / "c", x[:2], uint4_int4_flag=True)
    assert not (tmp_path / "c").exists()


def test_tied_int4_weights_share_one_initializer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first = nn.Linear(32, 32)
    second = nn.Linear(32, 32)
    second.weight = first.weight
    model, x = nn.Sequential(first, nn.ReLU(), second).eval(), torch.randn(16, 32)
    ModelQuantizer(_config(INT4_G32_WEIGHT)).quantize_model(model, [x])
    path = export_onnx(model, tmp_path, x[:2])
    proto = _load(path)
    assert len([i for i in proto.graph.initializer if i.data_type == TensorProto.INT4 and len(i.dims) == 2]) == 1
    reference = _simulation(model, x)
    assert np.abs(_run(path, x) - reference).max() <= FLOAT_NOISE * np.abs(reference).max()


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 32, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


@pytest.mark.filterwarnings("ignore:.*stay float.*")
@pytest.mark.parametrize("build", [_Encoder, _LSTM], ids=["transformer_encoder_layer", "lstm"])
def test_attention_and_lstm_int4_group_weights(build: type[nn.Module], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = build().eval(), torch.randn(3, 5, 32)
    ModelQuantizer(_config(INT4_G32_WEIGHT)).quantize_model(model, [x])
    path = export_onnx(model, tmp_path, x, dynamic_batch=False)
    reference = _simulation(model, x)
    assert np.abs(_run(path, x) - reference).max() <= FLOAT_NOISE * np.abs(reference).max()
    proto = _load(path)
    weights = [
        q for m in model.modules() if isinstance(m, QuantMixin) for s, q in m.quantizer_slots() if s.role == "weight"
    ]
    assert len([i for i in proto.graph.initializer if i.data_type == TensorProto.INT4]) == len(weights)
    _assert_no_float_weight(proto, model)


# ----------------------------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize(
    ("config", "where", "got"),
    [
        ({"global_quant_config": {"weight": {**MXFP4, "ch_axis": 1}}}, r"layer '0' \(weight\)", "mx, "),
        (
            _config(INT8_PER_CHANNEL_WEIGHT, {**INT8_PER_TENSOR_ACT, "is_dynamic": True}),
            r"layer '0' \(input_tensors\)",
            r"int8, per_tensor, dynamic \(an activation\)",
        ),
        (
            _config(INT4_G32_WEIGHT, {**INT8_PER_TENSOR_ACT, "dtype": "int4"}),
            r"layer '0' \(input_tensors\)",
            r"int4, per_tensor \(an activation\)",
        ),
        (
            {
                "global_quant_config": {"weight": INT4_G32_WEIGHT},
                "layer_quant_config": {"2": {"weight": {**INT4_G32_WEIGHT, "ch_axis": 0}}},
            },
            r"layer '2' \(weight\)",
            r"int4, per_group, ch_axis=0 \(a tensor of rank 2\)",
        ),
        (
            _config({**U4_G32, "zero_point_type": "float32"}),
            r"layer '0' \(weight\)",
            "uint4, per_group, ch_axis=1, float zero point",
        ),
        (
            _config(INT4_G32_WEIGHT, {**FP8_PER_TENSOR, "is_dynamic": True}),
            r"layer '0' \(input_tensors\)",
            "fp8_e4m3, per_tensor, dynamic",
        ),
        (_config(E5M2, E5M2), r"layer '0' \(input_tensors\)", r"fp8_e5m2, per_tensor \(an activation\)"),
    ],
    ids=[
        "mx_weight",
        "dynamic_int8_input",
        "int4_input",
        "int4_group_on_axis_0",
        "float_zero_point",
        "dynamic_fp8_input",
        "fp8_e5m2",
    ],
)
def test_unsupported_formats_fail_before_any_work(
    config: dict, where: str, got: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer, the slot, what is supported and the format it got, before the model is copied or traced."""
    model, _, x = _quantized("mlp", config)
    message = (
        f"{where}: ONNX QDQ export supports static int8/uint8 .* int4/uint4 per tensor or per channel .*; got {got}"
    )

    def traced(*args: object, **kwargs: object) -> None:
        raise AssertionError("the exporter ran")

    monkeypatch.setattr(torch.onnx, "export", traced)
    with pytest.raises(ValueError, match=message):
        export_onnx(model, tmp_path, x[:2])
    with pytest.raises(ValueError, match=message):
        check_onnx_exportable(model)  # what the app calls before training
    assert not list(tmp_path.iterdir())
