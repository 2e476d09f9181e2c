"""Graph mode (quant_mode=fx_graph_mode): placement on captured graphs, BatchNorm folding, CLE, QAT, errors, ONNX."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.graph import (
    QUANTIZERS,
    GraphModeError,
    QuantActivation,
    QuantConvBn2d,
    SharedFakeQuantize,
    capture,
    freeze_bn_stats,
)
from quark.torch.quantization.nn.modules import QuantConv2d, iter_quantizers

warnings.filterwarnings("ignore", message=".*LeafSpec.*")

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
TQT4 = {**SYM8, "dtype": "int4", "scale_type": "pof2", "qat_spec": {"method": "tqt", "threshold_init_meth": "_3SD"}}
TQT8 = {**TQT4, "dtype": "int8"}


def graph_config(**extra: object) -> Config:
    return Config.from_dict(
        {"global_quant_config": {"input_tensors": SYM8, "weight": W8}, "quant_mode": "fx_graph_mode", **extra}
    )


class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + x)


class Inverted(nn.Module):
    """A MobileNet-V2 inverted residual block: expand, depthwise, project (ReLU6, BatchNorm)."""

    def __init__(self, c: int, t: int = 4, act: type = nn.ReLU6) -> None:
        super().__init__()
        h = c * t
        self.expand = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), act())
        self.dw = nn.Sequential(nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), nn.BatchNorm2d(h), act())
        self.project = nn.Sequential(nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.dw(self.expand(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.blocks = nn.Sequential(Block(8), Inverted(8))
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.pool(self.stem(x)))
        x = torch.cat([x.mean((2, 3)), F.adaptive_avg_pool2d(x, 1).flatten(1)], 1)
        return self.fc(x)


def trained_bn(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """Give the BatchNorms non-trivial statistics and affine parameters, then eval."""
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.3, 0.3)
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    return model.eval()


@pytest.fixture
def net_and_data() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(32, 1, 8, 8)
    return trained_bn(Net(), x), x


def calibrated(model: nn.Module, x: torch.Tensor, config: Config | None = None) -> fx.GraphModule:
    gm = capture(model, (x[:4],))
    return ModelQuantizer(config or graph_config()).quantize_model(gm, [x[:16], x[16:]])  # type: ignore[return-value]


def consumers_read_quantized(gm: fx.GraphModule, targets: tuple[object, ...]) -> list[str]:
    """Ops among ``targets`` with a float-tensor input that does not come from a quantizer node."""
    bad = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            args = node.args[0] if node.target is torch.ops.aten.cat.default else node.args[:2]
            for a in args:
                if isinstance(a, fx.Node) and not (a.op == "call_module" and str(a.target).startswith(QUANTIZERS)):
                    bad.append(f"{node.name} <- {a.name}")
    return bad


# ----------------------------------------------------------------------------------------------- placement
def test_whole_graph_placement(net_and_data: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = net_and_data
    gm = ModelQuantizer(graph_config()).prepare(capture(model, (x[:4],)))
    aten = torch.ops.aten
    assert (
        consumers_read_quantized(
            gm, (aten.add.Tensor, aten.cat.default, aten.mean.dim, aten.adaptive_avg_pool2d.default)
        )
        == []
    )
    # conv + BN + ReLU is one unit: the twin's output goes straight into the ReLU, the quantizer comes after it
    units = {
        n.target: n
        for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), QuantConvBn2d)
    }
    assert set(units) == {
        "stem.0",
        "blocks.0.c1",
        "blocks.0.c2",
        "blocks.1.expand.0",
        "blocks.1.dw.0",
        "blocks.1.project.0",
    }
    relu = next(iter(units["blocks.0.c1"].users))
    assert relu.target is aten.relu.default and len(relu.users) == 1
    assert isinstance(gm.get_submodule(next(iter(relu.users)).target), QuantActivation)
    # each compute input is read from a quantizer (the fc through the cat's shared grid)
    for target in units:
        arg = next(n for n in gm.graph.nodes if n.target == target).args[0]
        assert str(arg.target).startswith(QUANTIZERS), target
    # max pool keeps the ReLU's grid: a shared quantizer, not a new observer
    pool = next(n for n in gm.graph.nodes if n.target is aten.max_pool2d.default)
    after = gm.get_submodule(next(iter(pool.users)).target)._output_quantizer
    before = gm.get_submodule(pool.args[0].target)._output_quantizer
    assert isinstance(after, SharedFakeQuantize) and after.source is before
    # cat inputs share one quantizer (one observer for both)
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    assert len({a.target for a in cat.args[0]}) == 1
    # the user's model and the captured graph are untouched; Parameters are shared, not copied
    assert not any(isinstance(m, QuantConv2d) for m in model.modules())
    assert gm.get_submodule("stem.0").weight is model.stem[0].weight


def test_layer_names_and_exclude(net_and_data: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = net_and_data
    w4 = {**W8, "dtype": "int4"}
    config = graph_config(layer_quant_config={"blocks.0.c1": {"weight": w4, "input_tensors": SYM8}}, exclude=["fc"])
    quantizer = ModelQuantizer(config)
    gm = quantizer.prepare(capture(model, (x[:4],)))
    assert gm.get_submodule("blocks.0.c1")._weight_quantizer.spec.dtype.name == "int4"
    assert gm.get_submodule("blocks.0.c2")._weight_quantizer.spec.dtype.name == "int8"
    assert not isinstance(gm.get_submodule("fc"), nn.Linear) or not hasattr(gm.get_submodule("fc"), "_weight_quantizer")
    floats = {f.name: f.reason for f in quantizer.float_layers(gm)}
    assert floats == {"fc": "excluded by Config.exclude"}
    plans = {p.name: p.source for p in quantizer.resolve(gm)}
    assert plans["blocks.0.c1"]["weight"] == "layer 'blocks.0.c1'"


# ----------------------------------------------------------------------------------------------- numerics
def test_bit_exact_against_integer_reference() -> None:
    """conv + BN + ReLU + residual add, power-of-two scales (so float32 holds every integer product exactly): the
    simulated graph equals fold -> quantize -> integer conv -> rescale + bias -> requantize, computed here."""
    torch.manual_seed(0)
    x = torch.randn(16, 4, 6, 6)

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return F.relu(self.bn(self.conv(t))) + t

    model = trained_bn(Small(), x)
    pof2 = {**SYM8, "scale_type": "pof2"}
    config = Config.from_dict(
        {
            "global_quant_config": {"input_tensors": pof2, "weight": {**W8, "scale_type": "pof2"}},
            "quant_mode": "fx_graph_mode",
        }
    )
    gm = ModelQuantizer.freeze(calibrated(model, x, config))

    def pof2_scale(amax: torch.Tensor) -> torch.Tensor:  # Quark: amax / ((qmax - qmin) / 2), held as 2^round(log2)
        return torch.exp2(torch.round(torch.log2(amax / 127.5)))

    def q(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(t / scale), -128, 127)

    bn, conv = model.bn, model.conv
    s = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # fold (Jacob et al. 2018, eq. 8)
    w = (conv.weight * s.reshape(-1, 1, 1, 1)).detach()
    b = (bn.bias + (conv.bias - bn.running_mean) * s).detach()
    w_scale = pof2_scale(w.abs().amax((1, 2, 3))).reshape(1, -1, 1, 1)
    x_scale = pof2_scale(x.abs().max())
    acc = F.conv2d(q(x, x_scale), q(w, w_scale.reshape(-1, 1, 1, 1)), padding=1)  # integers, exact in float32
    y = F.relu(acc * (x_scale * w_scale) + b.reshape(1, -1, 1, 1))
    y_float = F.relu(F.conv2d(x, w, b, padding=1))  # calibration observes the float function (fake quant off)
    y_scale, add_scale = pof2_scale(y_float.max()), pof2_scale((y_float + x).abs().max())
    ref = q(q(y, y_scale) * y_scale + q(x, x_scale) * x_scale, add_scale) * add_scale
    got = gm(x)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} values differ"
    assert len(torch.unique(got)) > 50  # not a degenerate grid


def test_cle_keeps_float_function_and_user_weights(net_and_data: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = net_and_data
    before = {k: v.clone() for k, v in model.state_dict().items()}
    per_tensor = {"global_quant_config": {"input_tensors": SYM8, "weight": SYM8}, "quant_mode": "fx_graph_mode"}
    folded = calibrated(model, x, Config.from_dict(per_tensor))
    gm = calibrated(
        model, x, Config.from_dict({**per_tensor, "pre_quant_opt_config": [{"name": "cle", "iterations": 10}]})
    )
    assert not [n for n in gm.graph.nodes if "clamp" in n.name]  # ReLU6 stays ReLU6: no per-channel clamp
    for _, q in iter_quantizers(gm):
        q.disable_fake_quant()
    assert torch.allclose(gm(x), model(x), atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the ReLU6 pairs (expand -> dw -> project) are left alone: their folded weights are those without CLE
    for name in ("blocks.1.expand.0", "blocks.1.dw.0"):
        assert torch.equal(gm.get_submodule(name).weight, folded.get_submodule(name).weight), name


def test_cle_improves_per_tensor_weights() -> None:
    """Per-tensor int8 weights (weight-only, so the error is the weights') on a depthwise block with ReLU and very
    unequal channel ranges: CLE lowers the output error (by ~1.8x here, the residual adds exact float values)."""
    torch.manual_seed(0)
    x = torch.randn(32, 4, 8, 8)
    block = trained_bn(nn.Sequential(Inverted(4, t=6, act=nn.ReLU)), x)
    with torch.no_grad():
        block[0].dw[0].weight.mul_(torch.logspace(-2, 1, 24).reshape(-1, 1, 1, 1))
    block = trained_bn(block, x)
    per_tensor = {"global_quant_config": {"weight": SYM8}, "quant_mode": "fx_graph_mode"}
    plain = calibrated(block, x, Config.from_dict(per_tensor))
    cle = calibrated(
        block, x, Config.from_dict({**per_tensor, "pre_quant_opt_config": [{"name": "cle", "iterations": 10}]})
    )
    ref = block(x)
    assert (cle(x) - ref).pow(2).mean() < 0.7 * (plain(x) - ref).pow(2).mean()


# ----------------------------------------------------------------------------------------------- QAT
def test_qat_simulated_folding_then_freeze(net_and_data: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = net_and_data
    y = torch.randint(0, 5, (32,))
    config = Config.from_dict(
        {"global_quant_config": {"weight": TQT4, "input_tensors": TQT8}, "quant_mode": "fx_graph_mode"}
    )
    gm = ModelQuantizer(config).prepare(capture(model.train(), (x[:4],)))
    gm.train()
    optimizer = torch.optim.SGD(gm.parameters(), lr=0.01)
    bn = gm.get_submodule("blocks.0.b1")
    mean0 = bn.running_mean.clone()
    for _ in range(3):
        loss = F.cross_entropy(gm(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not torch.equal(bn.running_mean, mean0)  # statistics still updated while training
    assert freeze_bn_stats(gm) == 6
    mean1 = bn.running_mean.clone()
    F.cross_entropy(gm(x), y).backward()
    assert torch.equal(bn.running_mean, mean1)  # frozen
    gm.eval()
    with torch.no_grad():
        before = gm(x)
    frozen = ModelQuantizer.freeze(gm)
    assert not any(isinstance(m, QuantConvBn2d | nn.BatchNorm2d) for m in frozen.modules())
    assert type(frozen.get_submodule("blocks.0.c1")) is QuantConv2d
    assert torch.equal(frozen(x), before)  # freeze = the folded conv QAT evaluated


# ----------------------------------------------------------------------------------------------- errors
def test_data_dependent_control_flow_is_named() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            y = self.fc(t)
            if y.sum() > 0:
                return y
            return -y

    with pytest.raises(GraphModeError, match=r"data-dependent.*if y.sum\(\) > 0.*eager_mode"):
        capture(Branchy(), (torch.randn(2, 4),))


def test_op_without_rule_is_named() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return torch.cumprod(self.fc(t), 1)

    gm = capture(Odd(), (torch.randn(2, 4),))
    with pytest.raises(GraphModeError, match=r"aten.cumprod.default \(node 'cumprod'.*eager_mode"):
        ModelQuantizer(graph_config()).prepare(gm)


def test_plain_module_needs_capture_or_data() -> None:
    with pytest.raises(GraphModeError, match="capture it first"):
        ModelQuantizer(graph_config()).prepare(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="eager_mode only"):
        graph_config(pre_quant_opt_config=[{"name": "smoothquant"}])
    with pytest.raises(ValueError, match="needs quant_mode=fx_graph_mode"):
        Config.from_dict({"global_quant_config": {"weight": W8}, "pre_quant_opt_config": [{"name": "cle"}]})


def test_quantize_model_captures_a_plain_module(net_and_data: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = net_and_data
    gm = ModelQuantizer(graph_config()).quantize_model(model, [x[:16], x[16:]])
    assert isinstance(gm, fx.GraphModule) and gm(x[:3]).shape == (3, 5)  # dynamic batch


# ----------------------------------------------------------------------------------------------- export
def test_onnx_integer_qdq_graph(tmp_path, net_and_data: tuple[nn.Module, torch.Tensor]) -> None:  # noqa: ANN001
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from quark.torch.export.onnx import export_onnx

    model, x = net_and_data
    gm = calibrated(model, x)
    path = export_onnx(gm, tmp_path, x[:2])
    proto = onnx.load(str(path))
    producers = {o: n.op_type for n in proto.graph.node for o in n.output}
    constants = {i.name for i in proto.graph.initializer} | {
        o for n in proto.graph.node if n.op_type == "Constant" for o in n.output
    }
    ops = [n for n in proto.graph.node if n.op_type in ("Add", "Mul", "Concat", "MatMul", "Conv", "Gemm")]
    assert {n.op_type for n in ops} >= {"Add", "Concat", "Conv", "Gemm"}
    for n in ops:
        activations = n.input[:2] if n.op_type in ("Conv", "Gemm") else n.input
        for name in activations:
            assert name in constants or producers.get(name) == "DequantizeLinear", (
                n.op_type,
                name,
                producers.get(name),
            )
    expected = ModelQuantizer.freeze(gm)(x).detach()
    got = torch.from_numpy(ort.InferenceSession(str(path)).run(None, {"input": x.numpy()})[0])
    step = gm.get_submodule(QUANTIZERS).cat_inputs._output_quantizer.scale  # the fc reads the cat's grid
    bound = step * model.fc.weight.abs().sum(1).max()  # one step of the fc's input changes its output by at most this
    assert (got - expected).abs().max() <= bound


def test_capture_with_keyword_arguments_keeps_the_batch_dynamic() -> None:
    """A forward called with keywords (as Hugging Face models are): dynamic_shapes by parameter name, so the
    captured graph takes another batch size; non-tensor keywords (use_cache) are constants."""
    from quark.torch.quantization.graph.capture import capture

    class Kw(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(
            self, input_ids: torch.Tensor | None = None, use_cache: bool = False, **extra: torch.Tensor
        ) -> torch.Tensor:
            return self.fc(input_ids) + sum(extra.values())

    torch.manual_seed(0)
    model, x, bias = Kw(), torch.randn(2, 4), torch.randn(2, 3)
    y = torch.randn(5, 4)
    by_name = capture(model, (), {"input_ids": x, "use_cache": False})
    torch.testing.assert_close(by_name(input_ids=y, use_cache=False), model(y))
    mixed = capture(model, (x,), {"use_cache": False})
    torch.testing.assert_close(mixed(y, use_cache=False), model(y))
    # extra keywords into **kwargs: captured at the example's shapes (torch.export takes no dynamic_shapes for them)
    gm = capture(model, (x,), {"use_cache": False, "bias": bias})
    torch.testing.assert_close(gm(x, use_cache=False, bias=bias), model(x, bias=bias))


# ----------------------------------------------------------------------------------------------- transformers
def _quantizer_inputs(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes whose values an activation quantizer reads."""
    return {
        n.args[0].name
        for n in gm.graph.nodes
        if n.op == "call_module"
        and str(n.target).startswith(QUANTIZERS)
        and isinstance(n.args[0], fx.Node)
        and n.args[0].op != "get_attr"
    }


def test_float_arithmetic_is_not_quantized_the_data_path_is() -> None:
    """An add / mul whose operands are all on the activation path (a residual add) is quantized; one with an operand
    from float math (a sigmoid gate, a norm's rsqrt, a Parameter read directly: a norm's weight) is not, and the
    layer that reads its result quantizes its input."""

    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
            self.gain = nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + self.b(x)  # residual-style add of two layer outputs: quantized
            g = h * torch.sigmoid(self.b(h))  # gated: float math
            n = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain  # an RMSNorm
            return self.out(n)

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    model = Gated()
    quantizer = ModelQuantizer(graph_config())
    gm = quantizer.quantize_model(capture(model, (x,)), [x])
    # the layers' inputs and outputs, the residual add, and the norm's result (as the input of `out`): nothing of
    # the gate (mul), the norm's statistics (pow, mean, add of eps, rsqrt) or its scaling (mul_1, mul_2 by the gain)
    assert _quantizer_inputs(gm) == {"x", "a", "b", "add", "mul_2"}
    out = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "out")
    assert out.args[0].args[0].name == "mul_2"  # `out` reads the quantized norm output
    assert [f.reason for f in quantizer.float_layers(gm)] == [
        "aten.mul.Tensor runs in float (graph mode quantizes conv/linear/matmul/embedding weights)"
    ]
    assert (gm(x) - model(x)).abs().max() < 0.1


def test_a_mode_switch_around_a_weighted_layer_is_refused() -> None:
    """torch.export wraps a ``torch.no_grad()`` block in a higher-order op; its body is not quantized, so a Linear
    inside it has no rule (named), while a body of plain math (the rotary embedding's) runs in float."""

    class NoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                y = self.fc(x)
            return self.head(y)

    gm = capture(NoGrad(), (torch.randn(2, 4),))
    with pytest.raises(GraphModeError, match=r"wrap_with_set_grad_enabled .*body has weighted ops.*linear"):
        ModelQuantizer(graph_config()).prepare(gm)

    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("freq", torch.rand(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                angle = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * self.freq
            return self.fc(x) * angle.cos()

    model, x = Rotary(), torch.randn(3, 4)
    quantized = ModelQuantizer(graph_config()).quantize_model(capture(model, (x,), dynamic_batch=False), [x])
    assert (quantized(x) - model(x)).abs().max() < 0.05


def test_hf_llama_in_graph_mode_with_its_default_config() -> None:
    """A LlamaForCausalLM as transformers builds it (use_cache on, sdpa attention, rotary embedding, mask building
    from integer ops) is captured from dict batches, quantized W8A8 on every projection and lm_head, and follows
    the float model on ragged, padded batches of other sizes; norms are named float; the config is left as it was."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    assert model.config.use_cache

    def batch(n: int, t: int) -> dict[str, torch.Tensor]:
        mask = torch.ones(n, t, dtype=torch.long)
        mask[0, : t // 3] = 0  # left padding
        return {"input_ids": torch.randint(0, 128, (n, t)), "attention_mask": mask}

    batches = [batch(4, 16), batch(3, 16), batch(2, 12), batch(1, 20)]
    quantizer = ModelQuantizer(graph_config())
    gm = quantizer.quantize_model(model, batches[:2])
    assert model.config.use_cache
    assert (
        gm.config is model.config
    )  # kept through capture and prepare: the amd-quark export writes config.json from it
    plans = {(p.name, role) for p in quantizer.resolve(gm) for role in p.source}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 15 and plans == {(n, r) for n in linears for r in ("weight", "input_tensors")}
    floats = {f.name: f.reason for f in quantizer.float_layers(gm)}
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert set(floats) == {"model.embed_tokens", *norms}
    for b in batches:  # other batch sizes and lengths than the capture's
        ref = model(**b).logits
        err = (gm(**b).logits - ref).pow(2).mean() / ref.pow(2).mean()
        assert float(err) < 2e-3


class OwnWeightNet(nn.Module):
    """A Parameter fed to F.linear by the model itself: graph mode quantizes it as a functional weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.fc(x)), self.w)


def test_weight_only_graph_mode_observes_functional_weights_from_the_data() -> None:
    """A functional weight reaches its quantizer only through the forward: weight-only calibration runs the data too
    (it used to skip it, leaving that quantizer without qparams and freeze refusing the model)."""
    config = Config.from_dict({"global_quant_config": {"weight": W8}, "quant_mode": "fx_graph_mode"})
    model = ModelQuantizer(config).quantize_model(OwnWeightNet(), [torch.randn(4, 8)])
    functional = [q for role, q in iter_quantizers(model) if role == "weight" and q is not model.fc._weight_quantizer]
    assert functional and all(bool(q.initialized) for q in functional)
    expected_w = functional[0](model.w).detach()
    ModelQuantizer.freeze(model)
    x = torch.randn(2, 8)
    assert torch.equal(model(x), F.linear(torch.relu(model.fc(x)), expected_w))
    assert not torch.equal(expected_w, model.w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cle", [False, True])
def test_graph_mode_ptq_runs_on_cuda(net_and_data: tuple[nn.Module, torch.Tensor], cle: bool) -> None:
    """A graph captured on the GPU gets its inserted quantizers there too (they hold no Parameters to place them):
    PTQ (BN folding, CLE, calibration) and freeze run on CUDA and give the CPU's result to float noise."""
    model, x = net_and_data
    extra = {"pre_quant_opt_config": [{"name": "cle", "iterations": 5}]} if cle else {}
    config = Config.from_dict(
        {"global_quant_config": {"input_tensors": SYM8, "weight": SYM8}, "quant_mode": "fx_graph_mode", **extra}
    )
    results = {}
    for device in ("cpu", "cuda"):
        m, xd = copy.deepcopy(model).to(device), x.to(device)
        gm = ModelQuantizer.freeze(calibrated(m, xd, config))
        assert {t.device.type for t in itertools.chain(gm.parameters(), gm.buffers())} == {device}
        results[device] = gm(xd).cpu()
    step = (results["cpu"].abs().max() / 127).item()  # a one-step difference where a value sits on a rounding edge
    assert (results["cuda"] - results["cpu"]).abs().max() <= 2 * step
