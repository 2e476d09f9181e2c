"""Issue 33, messages: onnxruntime's default WeightBiasQuantization rewrite (graph optimization level BASIC and up)
quantizes a float weight to int8 per tensor and rounds float biases to int32 between Q/DQ, so the integer codes of
an exported graph-mode model change; the exporter says so once, naming the nodes and the session options that run
the graph as written, and with those options onnxruntime gives the quantized model's codes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from quark.torch import ModelQuantizer  # noqa: E402
from quark.torch.export.onnx import Constants, export_onnx  # noqa: E402
from quark.torch.quantization.graph import capture  # noqa: E402
from quark_lightning.tasks.recipes import INT8_PER_CHANNEL_WEIGHT, INT8_PER_TENSOR_ACT  # noqa: E402


class _TwoConvs(nn.Module):
    """A quantized conv with a bias, then a conv whose weight stays float (channels of very different sizes), its
    input and output quantized: onnxruntime rewrites both."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.c2 = nn.Conv2d(16, 16, 3, padding=1)
        with torch.no_grad():
            self.c2.weight.mul_(torch.logspace(-2, 0, 16).view(-1, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x)))


ACT = INT8_PER_TENSOR_ACT
CONFIG = {
    "global_quant_config": {"weight": INT8_PER_CHANNEL_WEIGHT, "input_tensors": ACT, "output_tensors": ACT},
    "layer_quant_config": {"c2": {"weight": None, "input_tensors": ACT, "output_tensors": ACT}},
    "quant_mode": "fx_graph_mode",
}
OPTIONS = {
    "defaults": ({}, {}),
    "disable_quant_qdq": ({"session.disable_quant_qdq": "1"}, {}),
    "disabled_optimizers": ({}, {"disabled_optimizers": ["WeightBiasQuantization"]}),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, pytest.WarningsRecorder]:
    torch.manual_seed(0)
    data = [torch.randn(8, 3, 10, 10) for _ in range(3)]
    model = ModelQuantizer.freeze(ModelQuantizer(CONFIG).quantize_model(capture(_TwoConvs().eval(), (data[0],)), data))
    with pytest.warns(UserWarning, match="WeightBiasQuantization") as record:
        path = export_onnx(model, tmp_path_factory.mktemp("onnx"), data[0])
    return path, model, record


def _codes(path: Path, x: torch.Tensor, option: str) -> np.ndarray:
    """The output's int8 codes as onnxruntime computes them under ``option`` (the output is DQ(Q(.)): its values
    divided by the output scale are the codes exactly)."""
    entries, kwargs = OPTIONS[option]
    options = ort.SessionOptions()
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"], **kwargs)
    return np.rint(session.run(None, {"input": x.numpy()})[0] / _output_scale(path)).astype(np.int64)


def _output_scale(path: Path) -> np.ndarray:
    graph = onnx.load(str(path)).graph
    last = next(n for n in reversed(graph.node) if n.op_type == "DequantizeLinear")
    return Constants(graph).value(last.input[1])


def _torch_codes(path: Path, model: nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return np.rint(model(x).numpy() / _output_scale(path)).astype(np.int64)


def test_the_export_warns_once_naming_the_nodes_and_the_session_options(exported) -> None:  # noqa: ANN001
    path, _, record = exported
    messages = [str(w.message) for w in record if "WeightBiasQuantization" in str(w.message)]
    assert len(messages) == 1
    assert str(path) in messages[0]
    assert "(its float weight quantized to int8 per tensor)" in messages[0]  # c2
    assert "(its bias rounded to int32 multiples of input scale x weight scale)" in messages[0]  # c1
    assert 'add_session_config_entry("session.disable_quant_qdq", "1")' in messages[0]
    assert 'disabled_optimizers=["WeightBiasQuantization"]' in messages[0]


def test_onnxruntime_defaults_change_the_codes_and_the_named_options_keep_them(exported) -> None:  # noqa: ANN001
    """Codes are compared as integers. Across runtimes a code can sit on a rounding tie that float accumulation
    order decides: with the options at most one code apart, on at most 0.5% of the elements (seen: none); with the
    defaults 10% of them move."""
    path, model, _ = exported
    x = torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    reference = _torch_codes(path, model, x)
    off = np.abs(_codes(path, x, "defaults") - reference)
    assert (off > 0).mean() > 0.02  # seen: 10% of the codes one step off
    for option in ("disable_quant_qdq", "disabled_optimizers"):
        off = np.abs(_codes(path, x, option) - reference)
        assert off.max() <= 1 and (off > 0).mean() <= 0.005, option
