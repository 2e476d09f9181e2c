"""Graph mode names, for each layer it leaves float, the op that computes with the layer's Parameters: never a
bookkeeping op of the captured graph (``_assert_tensor_metadata``, ``_assert_scalar``, ``sym_size``), which Gemma2's
``self.weight.float()`` put first before."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config

transformers = pytest.importorskip("transformers")
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
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}
#: the op each family's RMSNorm computes with its weight: Gemma2 ``x * (1.0 + self.weight.float())``, LLaMA
#: ``self.weight * x.to(input_dtype)``
MODELS = {
    "gemma2": (
        lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SMALL, head_dim=16, sliding_window=8)),
        "Gemma2RMSNorm",
        "aten.add.Tensor",
    ),
    "llama": (
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)),
        "LlamaRMSNorm",
        "aten.mul.Tensor",
    ),
}
FLOAT_OP = re.compile(r"^(?P<ops>aten\.\S+(?:, aten\.\S+)*) runs? in float ")


def _returns_a_tensor(name: str) -> bool:
    """Whether the aten overload ``name`` (``aten.add.Tensor``) computes a tensor: a compute op, not bookkeeping."""
    _, packet, overload = name.split(".")
    schema = getattr(getattr(torch.ops.aten, packet), overload)._schema
    return bool(schema.returns) and str(schema.returns[0].type) == "Tensor"


@pytest.mark.parametrize("family", list(MODELS))
def test_every_float_layer_is_named_with_an_op_that_computes(family: str) -> None:
    build, norm_type, norm_op = MODELS[family]
    torch.manual_seed(0)
    model = build().eval()
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    quantizer = ModelQuantizer(
        Config.from_dict({"global_quant_config": {"input_tensors": SYM8, "weight": W8}, "quant_mode": "fx_graph_mode"})
    )
    gm = quantizer.quantize_model(model, [batch])
    floats = quantizer.float_layers(gm)
    norms = {n for n, m in model.named_modules() if type(m).__name__ == norm_type}
    assert len(norms) >= 3 and norms <= {
        f.name for f in floats
    }  # Gemma2: four per decoder layer, LLaMA two (+ the final)
    for layer in floats:
        assert "assert" not in layer.reason and "sym_" not in layer.reason, (layer.name, layer.reason)
        found = FLOAT_OP.match(layer.reason)
        if found is None:  # a reason that names no op (an excluded layer, an embedding)
            continue
        ops = found["ops"].split(", ")
        assert all(_returns_a_tensor(op) for op in ops), (layer.name, layer.reason)
        if layer.name in norms:
            assert ops == [norm_op], (layer.name, layer.reason)


def test_a_parameter_cast_before_use_is_named_by_the_op_using_it() -> None:
    """``w.float()`` before the arithmetic: the cast and its metadata assert are passed through to the add."""

    class CastScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * (1.0 + self.scale.float())

    from quark.torch.quantization.graph import capture

    x = torch.randn(4, 8)
    quantizer = ModelQuantizer(
        Config.from_dict({"global_quant_config": {"input_tensors": SYM8, "weight": W8}, "quant_mode": "fx_graph_mode"})
    )
    gm = quantizer.quantize_model(capture(CastScale(), (x,)), [x])
    assert [(f.name, f.reason.split(" runs")[0]) for f in quantizer.float_layers(gm)] == [("", "aten.add.Tensor")]
