"""AWQ and SmoothQuant on fused MoE experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE):

- with the quantizers off the model computes what the float model does, and the scales went into the right blocks of
  the stacked Parameters: the norm before the experts divided by ``s``, the router's weight columns and every
  expert's gate and up columns (and Qwen2-MoE's shared expert and its gate) multiplied by it; each expert's up rows
  divided by its own ``s_e`` and its down columns multiplied by it;
- those scales come from each expert's own routed tokens (computed here from the float model with the router's
  top-k): SmoothQuant's ``max|X_e|^alpha / max|W|^(1 - alpha)``, one of AWQ's grid candidates ``mean|X_e|^ratio``;
- AWQ's output error on the calibration data is no worse than round-to-nearest's;
- the error for a layer no family fits, and for scaling_layers naming modules a layer lacks, lists its modules and
  its experts' projections, never the twin's quantizers.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import EXPERTS, TOP_K, build, eval_ids, token_batches
from moe_refs import moe_block_inputs, routed, weight_only
from torch import nn

import quark.torch.algorithm.awq as awq_module
import quark.torch.algorithm.structure as structure
from quark.torch import ModelQuantizer
from quark.torch.quantization.nn.modules import iter_quantizers

pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*reached")

INTER = 32
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
W4 = {
    "dtype": "uint4",
    "qscheme": "per_group",
    "ch_axis": 1,
    "group_size": 16,
    "symmetric": False,
    "observer_cls": "PerGroupMinMaxObserver",
    "scale_type": "float",
    "round_method": "half_even",
    "is_dynamic": False,
}
W8 = {**W4, "dtype": "int8", "qscheme": "per_channel", "ch_axis": 0, "symmetric": True}
W8.pop("group_size")
W8["observer_cls"] = "PerChannelMinMaxObserver"
A8 = {**W8, "qscheme": "per_tensor", "observer_cls": "PerTensorMinMaxObserver"}
A8.pop("ch_axis")
ALPHA = 0.5
CONFIGS: dict[str, dict[str, Any]] = {
    "awq": {"global_quant_config": {"weight": W4}, "exclude": ["lm_head"], "algo_config": {"name": "awq"}},
    "smoothquant": {
        "global_quant_config": {"weight": W8, "input_tensors": A8},
        "exclude": ["lm_head"],
        "pre_quant_opt_config": {"name": "smoothquant", "alpha": ALPHA},
    },
}


@pytest.fixture
def no_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ's scale search and folding only (its clipping changes the float weights on purpose)."""
    monkeypatch.setattr(awq_module, "_search_clip", lambda *args, **kwargs: None)


def quantize(model: nn.Module, algo: str, data: list[dict[str, torch.Tensor]]) -> nn.Module:
    from quark.torch.quantization.config.config import Config

    return ModelQuantizer(Config.from_dict(copy.deepcopy(CONFIGS[algo]))).quantize_model(model, data)


def float_logits(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in data])


def quantizers_off(model: nn.Module) -> nn.Module:
    for _, q in iter_quantizers(model):
        q.disable_fake_quant()
    return model


def column_ratio(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Per input column, ``after / before`` (the scale a fold multiplied the column by), from the largest entry."""
    idx = before.abs().argmax(dim=0, keepdim=True)
    return (after.gather(0, idx) / before.gather(0, idx)).reshape(-1)


def folded_scales(before: nn.Module, after: nn.Module, layer: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The norm's scale (its weight before / after) and each expert's up -> down scale (its down columns after /
    before), read off the weights; asserts that every other block of the layer's MoE moved accordingly."""
    b, a = before.model.layers[layer], after.model.layers[layer]
    s = (b.post_attention_layernorm.weight / a.post_attention_layernorm.weight).detach()
    torch.testing.assert_close(a.mlp.gate.weight, b.mlp.gate.weight * s, rtol=1e-5, atol=0)  # the router
    per_expert = []
    for e in range(EXPERTS):
        gate_up_b, gate_up_a = b.mlp.experts.gate_up_proj[e].detach(), a.mlp.experts.gate_up_proj[e].detach()
        s_e = column_ratio(a.mlp.experts.down_proj[e].detach(), b.mlp.experts.down_proj[e].detach())
        torch.testing.assert_close(a.mlp.experts.down_proj[e], b.mlp.experts.down_proj[e] * s_e, rtol=1e-5, atol=0)
        torch.testing.assert_close(gate_up_a[:INTER], gate_up_b[:INTER] * s, rtol=1e-5, atol=0)  # gate: the norm's
        expected_up = gate_up_b[INTER:] * s / s_e.reshape(-1, 1)  # up: the norm's columns, its own rows
        torch.testing.assert_close(gate_up_a[INTER:], expected_up, rtol=1e-5, atol=0)
        per_expert.append(s_e)
    if hasattr(b.mlp, "shared_expert"):  # Qwen2-MoE: the shared expert and its gate read the norm too
        shared_b, shared_a = b.mlp.shared_expert, a.mlp.shared_expert
        s_shared = column_ratio(shared_a.down_proj.weight.detach(), shared_b.down_proj.weight.detach())
        torch.testing.assert_close(shared_a.gate_proj.weight, shared_b.gate_proj.weight * s, rtol=1e-5, atol=0)
        expected_up = shared_b.up_proj.weight * s / s_shared.reshape(-1, 1)
        torch.testing.assert_close(shared_a.up_proj.weight, expected_up, rtol=1e-5, atol=0)
        torch.testing.assert_close(
            a.mlp.shared_expert_gate.weight, b.mlp.shared_expert_gate.weight * s, rtol=1e-5, atol=0
        )
    return s, per_expert


# ----------------------------------------------------------------------------------------------- the float function
@pytest.mark.parametrize("algo", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_float_function_is_kept_and_each_block_gets_its_scale(family: str, algo: str, no_clip) -> None:
    data = token_batches(n=4, batch=4)
    model = build(family)
    reference = copy.deepcopy(model)
    quantized = quantizers_off(quantize(model, algo, data))
    ids = {"input_ids": eval_ids()}
    rel = (float_logits(quantized, [ids]) - float_logits(reference, [ids])).norm() / float_logits(
        reference, [ids]
    ).norm()
    assert float(rel) < 1e-5
    for layer in range(2):
        s, per_expert = folded_scales(reference, quantized, layer)
        assert not torch.allclose(s, torch.ones_like(s)), layer  # the norm's fold happened
        assert sum(not torch.allclose(s_e, torch.ones_like(s_e)) for s_e in per_expert) >= 2, layer


def test_smoothquant_scales_come_from_each_experts_routed_tokens(no_clip) -> None:
    """SmoothQuant's rule on layer 0 (its inputs are the float model's): the norm's scale from every token and every
    consumer's weights (router included), each expert's from its own routed tokens and its down weight."""
    data = token_batches(n=4, batch=4)
    model = build("qwen3_moe")
    reference = copy.deepcopy(model)
    quantize(model, "smoothquant", data)
    s, per_expert = folded_scales(reference, model, 0)
    x = moe_block_inputs(reference, 0, data)
    mlp = reference.model.layers[0].mlp
    consumers = [mlp.gate.weight, *mlp.experts.gate_up_proj]
    w_max = torch.stack([w.detach().abs().amax(dim=0) for w in consumers]).amax(dim=0)
    expected = (x.abs().amax(dim=0).pow(ALPHA) / w_max.clamp(min=1e-8).pow(1 - ALPHA)).clamp(min=1e-5)
    torch.testing.assert_close(s, expected, rtol=1e-5, atol=0)
    routes = routed(mlp.gate.weight, x, TOP_K)
    for e in range(EXPERTS):
        mine = x[(routes == e).any(dim=-1)]
        gate, up = F.linear(mine, mlp.experts.gate_up_proj[e]).chunk(2, dim=-1)
        x_max = (F.silu(gate) * up).abs().amax(dim=0)
        w_max = mlp.experts.down_proj[e].detach().abs().amax(dim=0)
        expected = (x_max.pow(ALPHA) / w_max.clamp(min=1e-8).pow(1 - ALPHA)).clamp(min=1e-5)
        torch.testing.assert_close(per_expert[e], expected.detach(), rtol=1e-5, atol=0)


def test_awq_scales_are_grid_candidates_of_each_experts_routed_tokens(no_clip) -> None:
    data = token_batches(n=4, batch=4)
    model = build("mixtral")
    reference = copy.deepcopy(model)
    quantize(model, "awq", data)
    _, per_expert = folded_scales(reference, model, 0)
    x = moe_block_inputs(reference, 0, data)
    mlp = reference.model.layers[0].mlp
    routes = routed(mlp.gate.weight, x, TOP_K)
    chosen = []
    for e in range(EXPERTS):
        own, everyone = (
            _down_inputs(x[mask], mlp.experts.gate_up_proj[e]) for mask in ((routes == e).any(dim=-1), slice(None))
        )
        ratio = _grid_ratio(per_expert[e], own.abs().mean(dim=0))
        assert ratio is not None, e
        if ratio > 0:  # the statistics of all the layer's tokens would give another scale
            assert _grid_ratio(per_expert[e], everyone.abs().mean(dim=0)) is None, e
        chosen.append(ratio)
    assert any(r > 0 for r in chosen), chosen


def _down_inputs(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).detach()


def _grid_ratio(scale: torch.Tensor, x_mean: torch.Tensor) -> float | None:
    """The ratio of AWQ's grid whose candidate ``x_mean^ratio`` (normalised by sqrt(max * min)) is ``scale``."""
    for i in range(awq_module.N_GRID):
        s = x_mean.pow(i / awq_module.N_GRID).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if torch.allclose(s, scale, rtol=1e-4, atol=0):
            return i / awq_module.N_GRID
    return None


# ----------------------------------------------------------------------------------------------- AWQ vs RTN
@pytest.mark.parametrize("family", FAMILIES)
def test_awq_is_no_worse_than_round_to_nearest_on_the_calibration_data(family: str) -> None:
    data = token_batches(n=4, batch=4)
    reference = build(family)
    expected = float_logits(reference, data)
    errors = {}
    for name, extra in (("rtn", {}), ("awq", {"algo_config": {"name": "awq"}})):
        model = ModelQuantizer(weight_only(W4, **extra)).quantize_model(copy.deepcopy(reference), data)
        errors[name] = float((float_logits(model, data) - expected).pow(2).mean())
    assert errors["awq"] <= errors["rtn"], errors


# ----------------------------------------------------------------------------------------------- explicit maps, errors
def test_amd_quarks_per_expert_map_given_explicitly_folds_each_expert(no_clip) -> None:
    """amd-quark 0.13's qwen2_moe map style: one ``mlp.experts.{i}.up_proj -> down_proj`` entry per expert (concrete
    names), and the same as one ``{e}`` entry; the norm is left alone as amd-quark leaves it."""
    data = token_batches(n=2, batch=4)
    maps = {
        "concrete": [
            {
                "prev_op": f"mlp.experts.{i}.up_proj",
                "layers": [f"mlp.experts.{i}.down_proj"],
                "inp": f"mlp.experts.{i}.down_proj",
            }
            for i in range(EXPERTS)
        ],
        "template": [{"prev_op": "mlp.experts.{e}.up_proj", "layers": ["mlp.experts.{e}.down_proj"]}],
    }
    results = {}
    for name, scaling_layers in maps.items():
        model = build("mixtral")
        config = weight_only(W4, algo_config={"name": "awq", "scaling_layers": scaling_layers})
        ModelQuantizer(config).quantize_model(model, data)
        results[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = {n: p for n, p in build("mixtral").named_parameters()}
    assert results["concrete"].keys() == results["template"].keys()
    for n, p in results["concrete"].items():
        assert torch.equal(p, results["template"][n]), n
    assert torch.equal(
        results["concrete"]["model.layers.0.post_attention_layernorm.weight"],
        before["model.layers.0.post_attention_layernorm.weight"],
    )
    assert not torch.equal(
        results["concrete"]["model.layers.0.mlp.experts.down_proj"], before["model.layers.0.mlp.experts.down_proj"]
    )


def _error(model: nn.Module, config: dict[str, Any], data: list[dict[str, torch.Tensor]]) -> str:
    from quark.torch.quantization.config.config import Config

    with pytest.raises(ValueError) as info:
        ModelQuantizer(Config.from_dict(config)).quantize_model(model, data)
    return str(info.value)


@pytest.mark.parametrize("algo", list(CONFIGS))
def test_the_error_of_a_layer_no_family_fits_names_no_quantizer(algo: str, monkeypatch) -> None:
    monkeypatch.setattr(structure, "MODEL_FAMILIES", [])
    message = _error(build("qwen2_moe"), copy.deepcopy(CONFIGS[algo]), token_batches(n=1))
    assert message.startswith("cannot derive scaling_layers for layer Qwen2MoeDecoderLayer")
    assert "'mlp.experts'" in message and "'mlp.shared_expert.up_proj'" in message
    assert "its experts' projections, {e} in [0, 1, 2, 3]" in message and "mlp.experts.{e}.down_proj" in message
    assert "quantizer" not in message and "observer" not in message.lower()


def test_the_error_of_scaling_layers_naming_a_missing_module_names_no_quantizer() -> None:
    config = copy.deepcopy(CONFIGS["smoothquant"])
    config["pre_quant_opt_config"]["scaling_layers"] = [
        {
            "prev_op": "post_attention_layernorm",
            "layers": ["mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.w1"],
            "inp": "mlp.gate",
        }
    ]
    message = _error(build("mixtral"), config, token_batches(n=1))
    assert message.startswith("scaling_layers[0] names ['mlp.experts.{e}.w1'], not modules of the decoder layer")
    assert "'mlp.experts'" in message and "mlp.experts.{e}.up_proj" in message
    assert "quantizer" not in message and "observer" not in message.lower()
