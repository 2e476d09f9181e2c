"""No silent float: layers that stay float are named with the reason, quantizers no forward reaches are reported,
and the size report counts only what really runs quantized."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from specs import int_spec
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.api import uncalibrated_layers
from quark.torch.quantization.config.config import Config, LSQSpec, QuantizationConfig, TQTSpec
from quark.torch.quantization.config.type import ScaleType
from quark.torch.quantization.observer.observer import PerChannelMinMaxObserver
from quark.torch.quantization.report import model_size_bits

W8A8 = QuantizationConfig(
    weight=int_spec(qscheme="per_channel", observer_cls=PerChannelMinMaxObserver, ch_axis=0), input_tensors=int_spec()
)


class RawLinear(nn.Module):
    """A user's layer holding its own Parameters and calling F.linear on them."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FunctionalNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.raw = RawLinear(16, 16)
        self.head = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.raw(torch.relu(self.fc(x)))))


class BypassNet(nn.Module):
    """``tied`` is a Linear whose weight is also used through F.linear (as tied embeddings are); ``skip`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tied = nn.Linear(8, 8)
        self.skip = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.fc(x), self.tied.weight)


def _messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record]


def test_a_layer_using_f_linear_on_its_own_parameters_is_listed_as_float_once() -> None:
    model = FunctionalNet()
    quantizer = ModelQuantizer(Config(global_quant_config=W8A8))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        quantizer.quantize_model(model, [torch.randn(4, 16)])
    float_warnings = [m for m in _messages(record) if "stay float" in m]
    assert len(float_warnings) == 1, _messages(record)
    assert "raw (RawLinear)" in float_warnings[0] and "norm (LayerNorm)" in float_warnings[0]
    assert "fc (" not in float_warnings[0] and "head (" not in float_warnings[0]
    listed = {f.name: f for f in quantizer.float_layers(model)}
    assert set(listed) == {"raw", "norm"}
    assert "'weight' (linear)" in listed["raw"].reason and "used functionally" in listed["raw"].reason
    table = quantizer.summary(model)
    assert "raw" in table.split("float layer")[1] and "RawLinear" in table


def test_the_size_report_counts_a_functional_layer_as_float() -> None:
    model = FunctionalNet()
    ModelQuantizer(Config(global_quant_config=W8A8)).quantize_model(model, [torch.randn(4, 16)])
    quantized_bits, float_bits = model_size_bits(model)
    int8_weights = 16 * 16 + 4 * 16  # fc and head weights, 8 bits each
    float_params = sum(p.numel() for p in model.parameters()) - int8_weights
    assert quantized_bits == int8_weights * 8 + float_params * 32
    assert float_bits == sum(p.numel() for p in model.parameters()) * 32


def test_a_quantized_layer_no_forward_reaches_is_reported_and_counted_float() -> None:
    model = BypassNet()
    with pytest.warns(UserWarning) as record:
        ModelQuantizer(Config(global_quant_config=W8A8)).quantize_model(model, [torch.randn(4, 8)])
    messages = _messages(record)
    unreached = [m for m in messages if "no forward reached" in m]
    assert len(unreached) == 1 and "'tied'" in unreached[0] and "'skip'" in unreached[0] and "'fc'" not in unreached[0]
    tied = [m for m in messages if "also used outside the layer" in m]
    assert len(tied) == 1 and "tied (QuantLinear)" in tied[0] and "'weight' (linear)" in tied[0]
    quantized_bits, float_bits = model_size_bits(model)
    assert float_bits - quantized_bits == 8 * 8 * (32 - 8)  # only fc's weight is really int8


def test_a_model_without_float_layers_warns_nothing() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ModelQuantizer(Config(global_quant_config=W8A8)).quantize_model(model, [torch.randn(4, 8)])
    assert ModelQuantizer(Config(global_quant_config=W8A8)).float_layers(model) == []


def test_running_an_unreached_layer_later_errors_with_its_name() -> None:
    model = BypassNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ModelQuantizer(Config(global_quant_config=W8A8)).quantize_model(model, [torch.randn(4, 8)])
    with pytest.raises(RuntimeError, match=r"layer 'skip' \(Linear, input_tensors\)"):
        model.skip(torch.randn(2, 8))


class TiedLM(nn.Module):
    """An input embedding tied to the output projection (GPT-2's wte / lm_head): both uses run every forward."""

    def __init__(self, vocab: int = 32, dim: int = 8, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.mid(self.embed(ids))))


@pytest.mark.parametrize("tie", [True, False])
def test_a_weight_tied_to_a_float_embedding_counts_float(tie: bool) -> None:
    """The lm_head runs int8, but the embedding reads the same tensor in float: the float tensor must be kept, so the
    size report counts it at 32 bits; untied, the lm_head's own weight counts 8."""
    model = TiedLM(tie=tie)
    ModelQuantizer(Config(global_quant_config=W8A8)).quantize_model(model, [torch.randint(0, 32, (4, 6))])
    quantized_bits, float_bits = model_size_bits(model)
    assert float_bits == sum(p.numel() for p in model.parameters()) * 32
    int8_weights = 8 * 8 + (0 if tie else 32 * 8)  # mid's weight; lm_head's only when it is its own tensor
    assert float_bits - quantized_bits == int8_weights * (32 - 8)


def test_freeze_runs_layers_no_calibration_reached_in_float() -> None:
    """Weights are observed directly, inputs only by a forward: freezing names the layers whose inputs calibration
    never saw and runs them in float (the size report already counts them so); the reached layer stays quantized."""
    model = BypassNet()
    quantizer = ModelQuantizer(Config(global_quant_config=W8A8))
    with pytest.warns(UserWarning, match="no forward reached"):
        quantizer.quantize_model(model, [torch.randn(4, 8)])
    bits_before = model_size_bits(model)
    with pytest.warns(UserWarning, match=r"run in float from now on .*\['skip', 'tied'\]"):
        ModelQuantizer.freeze(model)
    assert not list(model.skip.quantizers()) and not list(model.tied.quantizers())
    assert [role for role, _ in model.fc.quantizers()] == ["input_tensors", "weight"]
    x = torch.randn(3, 8)
    assert torch.equal(model.skip(x), F.linear(x, model.skip.weight, model.skip.bias))
    assert model_size_bits(model) == bits_before


def test_freeze_refuses_a_model_never_calibrated() -> None:
    model = BypassNet()
    ModelQuantizer(Config(global_quant_config=W8A8)).prepare(model)
    with pytest.raises(ValueError, match=r"no quantizer of the model has qparams yet \(layer 'fc', ...\); calibrate"):
        ModelQuantizer.freeze(model)


class TinyMoE(nn.Module):
    """Top-1 routing written as HF's MoE blocks are: every expert is called on the tokens routed to it, an empty slice
    for an expert no token chose (expert 2 here: the router never picks it)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 3)
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        with torch.no_grad():
            self.router.bias.copy_(torch.tensor([0.0, 0.0, -1e4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (choice == i).nonzero().flatten()
            out[rows] = expert(x[rows])
        return out


def test_an_expert_called_only_on_empty_slices_counts_as_unreached_and_runs_float_after_freeze() -> None:
    model = TinyMoE()
    quantizer = ModelQuantizer(Config(global_quant_config=W8A8, exclude=["router"]))
    with pytest.warns(UserWarning, match=r"no forward reached during calibration .*\['experts.2'\]"):
        quantizer.quantize_model(model, [torch.randn(16, 8)])  # calibration itself no longer fails
    with pytest.raises(RuntimeError, match="experts.2"):
        model.experts[2](torch.randn(2, 8))  # quantizing with no qparams names the layer
    with pytest.warns(UserWarning, match=r"run in float from now on .*\['experts.2'\]"):
        ModelQuantizer.freeze(model)
    assert not list(model.experts[2].quantizers()) and list(model.experts[0].quantizers())
    x = torch.randn(2, 8)
    assert torch.equal(model.experts[2](x), F.linear(x, model.experts[2].weight, model.experts[2].bias))


def test_an_expert_no_token_reaches_does_not_stop_qat_or_the_calibrated_model() -> None:
    """QAT (observers and fake quant on from the first batch) and the calibrated model before freeze both route empty
    slices to expert 2: they pass through, and expert 2 stays without qparams until a token reaches it."""
    model = TinyMoE()
    ModelQuantizer(Config(global_quant_config=W8A8, exclude=["router"])).prepare(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    assert uncalibrated_layers(model) == {"experts.2"}
    with torch.no_grad():
        assert model(torch.randn(4, 8)).shape == (4, 8)


@pytest.mark.parametrize("qat_spec", [TQTSpec(), LSQSpec()], ids=["tqt", "lsq"])
def test_the_size_report_leaves_out_learned_thresholds(qat_spec) -> None:
    """TQT / LSQ learn their scales as Parameters of the quantizers: qparams, not part of the float model."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    floats = sum(p.numel() for p in model.parameters())
    spec = int_spec(scale_type=ScaleType.pof2, qat_spec=qat_spec)
    ModelQuantizer(Config(global_quant_config=QuantizationConfig(weight=spec, input_tensors=spec))).prepare(model)
    model(torch.randn(4, 8))
    assert sum(p.numel() for p in model.parameters()) > floats  # the learned thresholds are there
    quantized_bits, float_bits = model_size_bits(model)
    weights = 8 * 8 + 2 * 8
    assert float_bits == 32 * floats
    assert quantized_bits == 8 * weights + 32 * (floats - weights)
