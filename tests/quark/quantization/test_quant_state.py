"""``QuantState``: the one record the engine and the callback keep on a model they prepared. Nothing else is added
to the user's model object (no loose ``_quant_*`` / ``_graph_*`` attributes read back with getattr elsewhere), and
the record carries what later steps read: functional uses found by calibration, the graph plans, the unreached
layers (on the twins themselves), and the callback's float-checkpoint flags."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization import graph
from quark.torch.quantization.config.config import Config, QuantizationConfig, QuantizationSpec
from quark.torch.quantization.state import QuantState, quant_state

ROOT = Path(__file__).resolve().parents[3]


def _config(**kwargs) -> Config:
    spec = QuantizationSpec.from_dict(
        {
            "dtype": "int8",
            "qscheme": "per_tensor",
            "symmetric": True,
            "is_dynamic": False,
            "round_method": "half_even",
            "scale_type": "float",
            "observer_cls": "PerTensorMinMaxObserver",
        }
    )
    return Config(global_quant_config=QuantizationConfig(input_tensors=spec, weight=spec), **kwargs)


class TiedHead(nn.Module):
    """A user's model whose head reuses the first layer's weight through F.linear, plus a branch no input reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(self.fc(x)), self.fc.weight)


def _engine_attributes(model: nn.Module) -> set[str]:
    """Attributes of the model object itself that look like something a quantizer added."""
    return {k for k in vars(model) if re.match(r"_(quant|graph|quark)_", k)}


def test_eager_calibration_leaves_one_record_holding_functional_uses_and_unreached_twins() -> None:
    torch.manual_seed(0)
    model = TiedHead()
    quantizer = ModelQuantizer(_config())
    before = _engine_attributes(model)
    quantizer.quantize_model(model, [torch.randn(4, 6) for _ in range(2)])
    assert before == set() and _engine_attributes(model) == {"_quark_state"}
    state = quant_state(model)
    assert isinstance(state, QuantState)
    assert state.functional_uses == {"fc": ["'weight' (linear)"]}
    assert model.unused.unreached and not model.fc.unreached
    reasons = {f.name: f.reason for f in quantizer.float_layers(model)}
    assert "used functionally" in reasons["fc"] or any("weight" in r for r in reasons.values())
    # a model the engine never saw has no record, and asking does not add one
    fresh = TiedHead()
    assert quant_state(fresh) is None and _engine_attributes(fresh) == set()


def test_graph_preparation_records_its_plans_on_the_prepared_module_only() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    captured = graph.capture(model, (torch.randn(2, 6),))
    quantizer = ModelQuantizer(_config(quant_mode="fx_graph_mode"))
    prepared = quantizer.prepare(captured)
    state = quant_state(prepared)
    assert state is not None and state.graph_units is not None
    assert quant_state(captured) is None  # the captured graph passed in is left as it was
    assert [p.name for p in quantizer.resolve(prepared)] == [p.name for p in quantizer.resolve(captured)]
    assert len(quantizer.resolve(prepared)) == 2


def test_no_module_reads_a_loose_engine_attribute_with_getattr() -> None:
    pattern = re.compile(r"""(getattr|hasattr|__dict__\.(get|pop))\([^)]*["']_(quant|graph)_""")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("quark", "callbacks", "quark_lightning")
        for path in (ROOT / package).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
