"""Fused MoE experts of transformers 5 (Mixtral, Qwen2-MoE, Qwen3-MoE) get a quantized twin, found by structure:

- the twin shares the stacked Parameters (state_dict keys and objects unchanged) and, with every quantizer off,
  computes exactly the float module's eager forward (and grouped_mm's within float tolerance);
- a module of another class with the same structure gets a twin too; GPT-OSS's and Llama4's layouts stay float with a
  reason naming what differs; routers stay float with the router reason; Qwen2-MoE's shared expert is quantized;
- W8A8 quantizes at least 99% of the weights (model_size_bits);
- after PTQ every expert's gate, up and down weight lies on its own grid: per tensor one scale per expert and
  projection, per channel its rows, per group its groups, as torch's own fake-quantize kernels compute them from
  that expert's weights alone.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from moe_models import (
    FAMILIES,
    HIDDEN,
    W8A8,
    build,
    eval_ids,
    experts_layers,
    token_batches,
    transformers,
    weight_share,
)
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.nn.modules import QuantFusedExperts, QuantLinear
from quark.torch.quantization.nn.modules.quant_experts import MOE_ROUTER_REASON
from quark.torch.quantization.state import paused_quantizers
from quark_lightning.tasks.recipes import INT8_PER_TENSOR_ACT

pytestmark = pytest.mark.filterwarnings("ignore:.*stay float")

_INT8 = {"dtype": "int8", "symmetric": True, "is_dynamic": False, "scale_type": "float", "round_method": "half_even"}
WEIGHT_SPECS = {
    "per_tensor": {**_INT8, "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver"},
    "per_channel": {**_INT8, "qscheme": "per_channel", "ch_axis": 0, "observer_cls": "PerChannelMinMaxObserver"},
    "per_group": {
        **_INT8,
        "qscheme": "per_group",
        "ch_axis": 1,
        "group_size": 16,
        "observer_cls": "PerGroupMinMaxObserver",
    },
}


def quantized(family: str, config: dict | None = None) -> nn.Module:
    model = build(family)
    ModelQuantizer(config or W8A8).quantize_model(model, token_batches())
    return model


# ----------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("family", FAMILIES)
def test_each_experts_module_gets_a_twin_sharing_its_parameters(family) -> None:
    model = build(family)
    originals = experts_layers(model)
    params = {n: p for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    ModelQuantizer(W8A8).prepare(model)

    for name, original in originals.items():
        twin = model.get_submodule(name)
        assert isinstance(twin, QuantFusedExperts) and isinstance(twin, type(original)), name
        assert twin.gate_up_proj is original.gate_up_proj and twin.down_proj is original.down_proj
        weights = [s for s in twin.quant_slots if s.role == "weight"]
        inputs = [s for s in twin.quant_slots if s.role == "input_tensors"]
        assert len(weights) == 3 * original.num_experts and len(inputs) == 2 * original.num_experts
    assert {n: p for n, p in model.named_parameters()} == params  # the same objects, under the same names
    assert {k for k in model.state_dict() if "_quantizer." not in k} == keys


def test_a_module_of_another_class_with_the_structure_gets_a_twin() -> None:
    """Found by structure: a class of this test's, not transformers', with the stacked Parameters, act_fn and the
    routed forward (transformers' eager loop written out)."""

    class MyExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(3, 2 * 8, HIDDEN) / 8)
            self.down_proj = nn.Parameter(torch.randn(3, HIDDEN, 8) / 3)
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
            out = torch.zeros_like(hidden_states)
            for e in range(3):
                token, pos = torch.where(top_k_index == e)
                gate, up = F.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[token, pos, None]
                out.index_add_(0, token, y)
            return out

    class Box(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = MyExperts()

        def forward(self, x, idx, w):  # noqa: ANN001, ANN201
            return self.experts(x, idx, w)

    torch.manual_seed(0)
    box = Box()
    x, idx = torch.randn(10, HIDDEN), torch.randint(0, 3, (10, 2))
    w = torch.rand(10, 2)
    expected = box(x, idx, w)
    ModelQuantizer(W8A8).quantize_model(box, forward_loop=lambda m: m(x, idx, w))
    assert isinstance(box.experts, QuantFusedExperts) and isinstance(box.experts, MyExperts)
    with torch.no_grad(), paused_quantizers(box, fake_quant=True):
        torch.testing.assert_close(box(x, idx, w), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(box(x, idx, w), expected, rtol=1e-6, atol=1e-6)  # quantized


def test_other_layouts_stay_float_with_a_reason_naming_the_layout() -> None:
    gpt_oss = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(
            vocab_size=128,
            hidden_size=HIDDEN,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    class Llama4Box(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = Llama4TextMoe(
                transformers.Llama4TextConfig(
                    hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4, num_attention_heads=4, head_dim=16
                )
            )

    reasons = {}
    for model in (gpt_oss, Llama4Box()):
        reasons.update({f.name: f.reason for f in ModelQuantizer(W8A8).float_layers(model)})
    gpt = reasons["model.layers.0.mlp.experts"]
    assert gpt.startswith("fused MoE experts in a layout the experts twin does not handle")
    assert "expert biases" in gpt and "transposed" in gpt and "interleaved gate/up" in gpt
    llama4 = reasons["moe.experts"]
    assert "forward(hidden_states) runs every expert on every token" in llama4
    assert reasons["model.layers.0.mlp.router"] == MOE_ROUTER_REASON == reasons["moe.router"]


@pytest.mark.parametrize("family", FAMILIES)
def test_routers_stay_float_with_their_reason_and_the_shared_expert_is_quantized(family) -> None:
    model = build(family)
    floats = {f.name: f.reason for f in ModelQuantizer(W8A8).float_layers(model)}
    for i in range(2):
        assert floats[f"model.layers.{i}.mlp.gate"] == MOE_ROUTER_REASON
        assert f"model.layers.{i}.mlp.experts" not in floats
    ModelQuantizer(W8A8).prepare(model)
    if family == "qwen2_moe":
        for p in ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj", "shared_expert_gate"):
            assert isinstance(model.get_submodule(f"model.layers.0.mlp.{p}"), QuantLinear), p


# ----------------------------------------------------------------------------------------------- float function
@pytest.mark.parametrize("family", FAMILIES)
def test_twin_with_quantizers_off_equals_the_float_eager_forward(family) -> None:
    model = build(family)
    eager, grouped = copy.deepcopy(model), copy.deepcopy(model)
    eager.set_experts_implementation("eager")
    grouped.set_experts_implementation("grouped_mm")
    ModelQuantizer(W8A8).quantize_model(model, token_batches())
    ids = eval_ids()
    with torch.no_grad():
        expected_eager, expected_grouped = eager(ids).logits, grouped(ids).logits
        with paused_quantizers(model, fake_quant=True):
            out = model(ids).logits
            for name, float_experts in experts_layers(eager).items():  # the module on its own, routed inputs
                x = torch.randn(12, HIDDEN)
                idx = torch.randint(0, 4, (12, 2))
                w = torch.rand(12, 2)
                assert torch.equal(model.get_submodule(name)(x, idx, w), float_experts(x, idx, w)), name
        quantized_out = model(ids).logits
    assert torch.equal(out, expected_eager)
    torch.testing.assert_close(out, expected_grouped, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(quantized_out, expected_eager, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("family", FAMILIES)
def test_w8a8_quantizes_at_least_99_percent_of_the_weights(family) -> None:
    baseline = weight_share(build(family))  # nothing prepared: no weight is quantized
    model = quantized(family)
    assert baseline == 0.0
    assert weight_share(model) >= 0.99
    routers = sum(model.get_submodule(f"model.layers.{i}.mlp.gate").weight.numel() for i in range(2))
    total = sum(p.numel() for p in model.parameters() if p.ndim >= 2) - model.get_input_embeddings().weight.numel()
    assert weight_share(model) == pytest.approx(1 - routers / total)  # everything but the routers


# ----------------------------------------------------------------------------------------------- grids per expert
def _reference(block: torch.Tensor, qscheme: str) -> torch.Tensor:
    """``block`` [out, in] fake-quantized to int8 by torch's kernels with the symmetric min-max scale of that block
    alone: amax / 127.5 (the convention of amd-quark's observers) per tensor, per output row, or per group of 16
    inputs of a row."""
    eps = torch.finfo(torch.float32).eps
    if qscheme == "per_tensor":
        scale = torch.clamp(block.abs().amax() / 127.5, min=eps)
        return torch.fake_quantize_per_tensor_affine(block, float(scale), 0, -128, 127)
    rows = block if qscheme == "per_channel" else block.reshape(-1, 16)
    scale = torch.clamp(rows.abs().amax(dim=1) / 127.5, min=eps)
    zero = torch.zeros(rows.shape[0], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(rows, scale, zero, 0, -128, 127).reshape(block.shape)


@pytest.mark.parametrize("qscheme", list(WEIGHT_SPECS))
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_every_expert_weight_lies_on_its_own_grid_after_ptq(family, qscheme) -> None:
    model = build(family)
    before = {
        n: (m.gate_up_proj.detach().clone(), m.down_proj.detach().clone()) for n, m in experts_layers(model).items()
    }
    config = {"global_quant_config": {"weight": WEIGHT_SPECS[qscheme], "input_tensors": INT8_PER_TENSOR_ACT}}
    ModelQuantizer(config).quantize_model(model, token_batches())
    ModelQuantizer.freeze(model, bake_weights=True)  # the Parameters now hold what the forward computes with

    for name, (gate_up, down) in before.items():
        twin = model.get_submodule(name)
        inter = down.shape[-1]
        for e in range(gate_up.shape[0]):
            blocks = {
                "gate": (gate_up[e, :inter], twin.gate_up_proj[e, :inter]),
                "up": (gate_up[e, inter:], twin.gate_up_proj[e, inter:]),
                "down": (down[e], twin.down_proj[e]),
            }
            for proj, (float_block, baked) in blocks.items():
                expected = _reference(float_block, qscheme)
                assert torch.equal(baked.detach(), expected), f"{name} expert {e} {proj}"
                assert not torch.equal(expected, float_block)
                scale, _ = getattr(twin, f"_e{e}_{proj}_weight_quantizer").calculate_qparams()
                assert scale.numel() == {"per_tensor": 1, "per_channel": float_block.shape[0]}.get(
                    qscheme, float_block.numel() // 16
                )
        # scales are each expert's own: the same projection of two experts has different ones
        s0 = twin._e0_gate_weight_quantizer.calculate_qparams()[0]
        s1 = twin._e1_gate_weight_quantizer.calculate_qparams()[0]
        assert not torch.equal(s0, s1)


def test_weight_only_config_quantizes_the_experts_without_data() -> None:
    model = build("mixtral")
    config = {"global_quant_config": {"weight": WEIGHT_SPECS["per_channel"]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no unreached-expert warning without activation quantizers
        warnings.filterwarnings("ignore", ".*stay float")
        ModelQuantizer(config).quantize_model(model)
    assert weight_share(model) >= 0.99
