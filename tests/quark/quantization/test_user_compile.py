"""A quantized model inside the user's own ``torch.compile``: one graph, no break per quantizer (the switches are
host values dynamo specializes on, the NaN / Inf checks are read after the graph), the eager model's numbers, and
the switches still obeyed when they change between compiled steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.state import paused_quantizers
from quark.torch.quantization.tensor_quantize import FakeQuantizeBase
from quark_lightning.tasks.recipes import FP8_PER_TENSOR, INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT, MXFP4

MXFP8 = {**MXFP4, "mx_element_dtype": "fp8_e4m3"}
TQT = {"symmetric": True, "is_dynamic": False, "round_method": "half_even", "scale_type": "pof2"}
TQT_WEIGHT = {
    **TQT,
    "dtype": "int8",
    "qscheme": "per_tensor",
    "observer_cls": "PerTensorMinMaxObserver",
    "qat_spec": {"method": "tqt"},
}
LSQ_WEIGHT = {**INT8_PER_CHANNEL_WEIGHT, "scale_type": "float", "qat_spec": {"method": "lsq"}}
LSQ_ACT = {**INT8_PER_TENSOR_ACT, "scale_type": "float", "qat_spec": {"method": "lsq"}}
#: learned thresholds / step sizes: their compiled backward sums the scale's gradient in inductor's or dynamo's order
LEARNED = {
    "tqt": {"weight": TQT_WEIGHT, "input_tensors": TQT_WEIGHT},
    "lsq": {"weight": LSQ_WEIGHT, "input_tensors": LSQ_ACT},
}
CONFIGS = {
    "int8": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": INT8_PER_TENSOR_ACT},
    "fp8": {"weight": FP8_PER_TENSOR, "input_tensors": FP8_PER_TENSOR},
    "mx": {"weight": MXFP4, "input_tensors": MXFP8},
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 96), nn.Linear(96, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _quantizers(model: nn.Module) -> list[FakeQuantizeBase]:
    return [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]


def _observers(model: nn.Module, on: bool) -> None:
    for q in _quantizers(model):
        q.enable_observer(on)


def _statistics(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for q in _quantizers(model) for n, t in q.named_buffers() if n.startswith("observer.")]


def _observes(model: nn.Module, run: Any) -> bool:
    """Whether a forward of ``run`` (``model`` compiled) on a batch far past the ranges seen moves the statistics."""
    before = _statistics(model)
    run(torch.randn(4, 64) * 100)
    return any(not torch.equal(a, b) for a, b in zip(before, _statistics(model), strict=True))


def _prepared(name: str) -> nn.Module:
    torch.manual_seed(0)
    config = Config.from_dict({"global_quant_config": {**CONFIGS, **LEARNED}[name]})
    return ModelQuantizer(config).prepare(MLP().train())


def _fit(model: Any, steps: int, seed: int, lr: float = 1e-2) -> list[torch.Tensor]:
    """``steps`` Adam steps on fixed random batches; the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 64, generator=gen), torch.randint(0, 10, (8,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_qat_in_one_graph_gives_the_eager_numbers_and_obeys_the_observer_switch(name: str) -> None:
    eager = _prepared(name)
    model = copy.deepcopy(eager)
    # fullgraph: any graph break raises; the eager backend runs the traced ops as they are, so the bits are eager's
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    for phase, observe in enumerate((True, False, True)):
        _observers(eager, observe)
        _observers(model, observe)
        before = _statistics(model)
        assert torch.equal(torch.stack(_fit(compiled, 3, phase)), torch.stack(_fit(eager, 3, phase)))
        after = _statistics(model)
        for a, b in zip(after, _statistics(eager), strict=True):
            assert torch.equal(a, b)
        moved = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert moved == observe  # observers off: the statistics stay as they were, though the graph traced them on
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)


def test_inductor_compiled_qat_follows_the_eager_model() -> None:
    eager = _prepared("int8")
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, fullgraph=True)
    for phase, observe in enumerate((True, False)):
        _observers(eager, observe)
        _observers(model, observe)
        torch.testing.assert_close(torch.stack(_fit(compiled, 2, phase)), torch.stack(_fit(eager, 2, phase)))
    for a, b in zip(_statistics(model), _statistics(eager), strict=True):
        torch.testing.assert_close(a, b)


def test_a_nan_batch_in_a_compiled_forward_is_refused_after_the_graph() -> None:
    model = _prepared("int8")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(torch.randn(4, 64))
    before = _statistics(model)
    bad = torch.randn(4, 64)
    bad[1, 3] = float("nan")
    compiled(bad)  # no host read inside the graph: the check is folded there
    for a, b in zip(before, _statistics(model), strict=True):
        assert torch.equal(a, b)  # the batch was not folded into the running statistics
    with pytest.raises(ValueError, match=r"layer 'fc1' \(Linear, input_tensors\).*NaN or Inf"):
        model.fc1._input_quantizer.read_late_checks()
    with pytest.raises(ValueError, match=r"layer 'fc2' \(Linear, input_tensors\).*NaN or Inf"):
        model.fc2._input_quantizer.read_late_checks()  # the NaN went on through fc1
    for q in _quantizers(model):
        q.read_late_checks()  # each read once: nothing left


def test_the_next_eager_forward_reports_a_nan_batch_seen_by_the_compiled_one() -> None:
    model = _prepared("fp8")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(torch.randn(4, 64))
    compiled(torch.full((4, 64), float("inf")))
    with pytest.raises(ValueError, match=r"NaN or Inf"):
        model(torch.randn(4, 64))


def test_switches_loaded_from_a_state_dict_reach_the_compiled_model() -> None:
    model = _prepared("int8")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(torch.randn(4, 64))
    fixed = copy.deepcopy(model)
    _observers(fixed, False)
    state = fixed.state_dict()
    assert not bool(state["fc1._input_quantizer.observer_enabled"])
    compiled(torch.randn(4, 64) * 10)  # observers on: the ranges grow
    model.load_state_dict(state)
    assert not _observes(model, compiled)


def test_a_write_straight_into_a_switch_is_seen_from_the_next_eager_forward() -> None:
    model = _prepared("int8")
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(torch.randn(4, 64))
    for q in _quantizers(model):
        q.observer_enabled.fill_(0)  # bypasses enable_observer
    model(torch.randn(4, 64))  # an eager forward reads the buffers
    assert not _observes(model, compiled)


def test_fixed_and_float_switches_made_by_the_engine_reach_the_compiled_model() -> None:
    model = _prepared("int8")
    x = torch.randn(4, 64)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    quantized = compiled(x)
    with paused_quantizers(model, observers=True, fake_quant=True):  # a float run: every switch cleared directly
        assert torch.equal(compiled(x), MLP.forward(model, x))
    _observers(model, False)
    assert torch.equal(compiled(x), quantized)  # the switches written back, the host values with them


@pytest.mark.parametrize("name", sorted(LEARNED))
def test_learned_quantizers_compile_into_one_graph_once_initialised(name: str) -> None:
    eager = _prepared(name)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="eager")
    _fit(compiled, 1, 9, 1e-4)  # the first batch initialises the learned values eagerly (one break in that graph)
    _fit(eager, 1, 9, 1e-4)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    for phase, observe in enumerate((True, False)):
        _observers(eager, observe)
        _observers(model, observe)
        torch.testing.assert_close(
            torch.stack(_fit(compiled, 3, phase, 1e-4)), torch.stack(_fit(eager, 3, phase, 1e-4))
        )
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks  # the later graphs have none
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    for q in _quantizers(model):
        q.read_late_checks()  # nothing invalid was learned


def test_an_invalid_learned_threshold_in_a_compiled_forward_is_raised_after_the_graph() -> None:
    model = _prepared("lsq")
    model(torch.randn(4, 64))  # initialised eagerly: the compiled forward is one graph from here on
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled(torch.randn(4, 64))
    with torch.no_grad():
        model.fc1._weight_quantizer.scale[0] = -1.0  # no positive step size
    compiled(torch.randn(4, 64))  # no host read in the graph
    with pytest.raises(ValueError, match=r"fc1.*step size"):
        model.fc1._weight_quantizer.read_late_checks()


def test_a_pause_keeps_the_qparams_it_fixed_for_the_compiled_model() -> None:
    """``paused_quantizers`` (a report, a validation pass) fixes the qparams of a calibration run with fake quant off
    (``initialized`` set inside it) and writes back only the two switches: the compiled model sees the qparams."""
    model = _prepared("int8").eval()
    for q in _quantizers(model):
        q.enable_fake_quant(False)
    with torch.no_grad():
        model(torch.randn(16, 64))  # calibration, in float
    with paused_quantizers(model):
        pass
    for q in _quantizers(model):
        q.enable_observer(False)
        q.enable_fake_quant(True)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 64)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x), eager(x))


def test_statistics_made_under_inference_mode_train_on_compiled() -> None:
    """A validation pass under ``inference_mode`` first makes the running statistics inference tensors: the compiled
    training forward folds into them out of place, as the eager one rebinds them."""
    first = torch.randn(4, 64)
    eager, model = _prepared("int8"), _prepared("int8")  # the same weights (not a deepcopy: it would copy out)
    with torch.inference_mode():
        eager(first)
        model(first)
    assert model.fc1._weight_quantizer.observer.min_val.is_inference()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x = torch.randn(4, 64)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    for a, b in zip(_statistics(model), _statistics(eager), strict=True):
        assert torch.equal(a, b)
