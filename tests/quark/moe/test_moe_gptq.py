"""GPTQ on fused MoE experts, per expert and projection:

- each expert's gate/up Hessian is ``2/n X_e^T X_e`` of exactly the tokens the router sends to it, and its down
  projection's that of its own activations (computed here from the float model with the router's top-k, and the gate
  and up weights GPTQ wrote, since down is quantized after them);
- the result of each expert's projection is on its own grid (per tensor, per channel, per group of that expert),
  written into its block of the stacked Parameter, its quantizer holding GPTQ's qparams, its loss the closed-form OBS
  objective (as tests/quark/algorithm/test_gptq.py checks for Linears), and its output error below RTN's;
- a projection whose expert received fewer tokens than ``GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE`` x its inputs
  keeps round-to-nearest and is named in the warning;
- the experts are quantized in two passes per layer (every expert's gate and up, then every expert's down), and the
  parts' hooks see exactly the routed rows.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe_models import EXPERTS, TOP_K, build, token_batches
from moe_refs import expert_inputs, moe_block_inputs, routed, two_over_n_gram, weight_only
from torch import nn

import quark.torch.algorithm.api as algo_api
from quark.torch import ModelQuantizer
from quark.torch.algorithm.gptq_plan import gptq_groups, gptq_targets
from quark.torch.quantization.config.config import GPTQConfig
from quark.torch.quantization.nn.modules import iter_quantizers
from quark.torch.quantization.nn.modules.linear_parts import LinearPart, linear_part_modules

pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*reached")

INTER = 32


def spec(qscheme: str, bits: int = 4, sym: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dtype": f"int{bits}" if sym else f"uint{bits}",
        "qscheme": qscheme,
        "symmetric": sym,
        "scale_type": "float",
        "round_method": "half_even",
        "is_dynamic": False,
        "observer_cls": {
            "per_tensor": "PerTensorMinMaxObserver",
            "per_channel": "PerChannelMinMaxObserver",
            "per_group": "PerGroupMinMaxObserver",
        }[qscheme],
    }
    if qscheme == "per_channel":
        out["ch_axis"] = 0
    if qscheme == "per_group":
        out["ch_axis"], out["group_size"] = 1, 16
    return out


def record_gptq(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Per module the driver quantized: its Hessian, row count, original weight and GPTQResult."""
    records: dict[str, dict[str, Any]] = {}
    results: list[Any] = []
    real_quantize, real_gptq = algo_api._quantize_module, algo_api.gptq_quantize

    def gptq(*args: Any, **kwargs: Any) -> Any:
        results.append(real_gptq(*args, **kwargs))
        return results[-1]

    taken: dict[int, torch.Tensor] = {}  # the driver takes a shared accumulator's Hessian at its first module

    def quantize_module(name: str, module: nn.Module, hessian: Any, *args: Any) -> None:
        before, count = len(results), hessian.count
        if hessian.hessian is not None:
            taken[id(hessian)] = hessian.hessian.clone()
        original = module.weight.detach().clone()
        real_quantize(name, module, hessian, *args)
        records[name] = {
            "hessian": taken[id(hessian)],
            "count": count,
            "original": original,
            "result": results[-1] if len(results) > before else None,
        }

    monkeypatch.setattr(algo_api, "gptq_quantize", gptq)
    monkeypatch.setattr(algo_api, "_quantize_module", quantize_module)
    return records


def experts_only(family: str, qscheme: str = "per_group") -> Any:
    """GPTQ on the experts alone (attention and the shared expert float): layer 0's experts see the float model's
    routed tokens."""
    exclude = ["lm_head", "*self_attn*", *(["*shared_expert*"] if family == "qwen2_moe" else [])]
    return weight_only(spec(qscheme), exclude=exclude, algo_config={"name": "gptq"})


def fake_quant_reference(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """torch's own fake quantization of [rows, columns] ``w`` with uint``bits`` qparams per tensor (0-d / one value),
    per row ([rows]) or per row and input group ([rows, groups])."""
    qmax = 2**bits - 1
    rows, columns = w.shape
    scale, zero_point = scale.float(), zero_point.round().int()
    if scale.numel() == 1:
        return torch.fake_quantize_per_tensor_affine(w, float(scale), int(zero_point), 0, qmax)
    groups = scale.numel() // rows
    flat = w.reshape(rows * groups, columns // groups)
    out = torch.fake_quantize_per_channel_affine(flat, scale.reshape(-1), zero_point.reshape(-1), 0, 0, qmax)
    return out.reshape(rows, columns)


# ----------------------------------------------------------------------------------------------- Hessians
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_each_experts_hessian_is_that_of_exactly_its_routed_tokens(family: str, monkeypatch) -> None:
    model, data = build(family), token_batches(n=8, batch=8)
    reference = copy.deepcopy(model)
    x = moe_block_inputs(reference, 0, data)
    routes = routed(reference.model.layers[0].mlp.gate.weight, x, TOP_K)
    records = record_gptq(monkeypatch)
    ModelQuantizer(experts_only(family)).quantize_model(model, data)
    gate_up_after = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    for e in range(EXPERTS):
        mine, _ = expert_inputs(x, routes, reference.model.layers[0].mlp.experts.gate_up_proj[e], e)
        _, down_in = expert_inputs(x, routes, gate_up_after[e], e)  # down is quantized after gate and up
        assert mine.shape[0] >= 64  # every expert has enough tokens: GPTQ, not the fallback
        for proj, rows in (("gate_proj", mine), ("up_proj", mine), ("down_proj", down_in)):
            record = records[f"model.layers.0.mlp.experts.{e}.{proj}"]
            assert record["count"] == rows.shape[0], (e, proj)
            torch.testing.assert_close(record["hessian"].double(), two_over_n_gram(rows), rtol=1e-4, atol=1e-6)
            assert record["result"] is not None
        # not the Hessian of all the layer's tokens
        everyone = two_over_n_gram(x)
        assert not torch.allclose(records[f"model.layers.0.mlp.experts.{e}.up_proj"]["hessian"].double(), everyone)


# ----------------------------------------------------------------------------------------------- results
@pytest.mark.parametrize("qscheme", ["per_tensor", "per_channel", "per_group"])
def test_each_experts_result_is_on_its_grid_in_its_block_with_the_closed_form_loss(qscheme: str, monkeypatch) -> None:
    model, data = build("mixtral"), token_batches(n=8, batch=8)
    records = record_gptq(monkeypatch)
    ModelQuantizer(weight_only(spec(qscheme), algo_config={"name": "gptq"})).quantize_model(model, data)
    for layer in range(2):
        twin = model.model.layers[layer].mlp.experts
        for e in range(EXPERTS):
            for proj, block in (
                ("gate_proj", twin.gate_up_proj[e, :INTER]),
                ("up_proj", twin.gate_up_proj[e, INTER:]),
                ("down_proj", twin.down_proj[e]),
            ):
                record = records[f"model.layers.{layer}.mlp.experts.{e}.{proj}"]
                result, w = record["result"], record["original"]
                assert result is not None, (layer, e, proj)
                expected_shape = {
                    "per_tensor": (),
                    "per_channel": (w.shape[0],),
                    "per_group": (w.shape[0], w.shape[1] // 16),
                }
                assert tuple(result.scale.shape) == expected_shape[qscheme], (qscheme, tuple(result.scale.shape))
                # on the grid of this expert's own qparams (torch's fake quantization leaves it as it is) ...
                on_grid = fake_quant_reference(result.weight, result.scale, result.zero_point)
                assert torch.equal(on_grid, result.weight), (layer, e, proj)
                # ... written into its block of the stacked Parameter, its quantizer holding those qparams
                assert torch.equal(block.detach(), result.weight), (layer, e, proj)
                quantizer = getattr(twin, f"_e{e}_{proj.removesuffix('_proj')}_weight_quantizer")
                scale, zero_point = quantizer.calculate_qparams()
                assert torch.equal(scale.reshape(-1), result.scale.reshape(-1).to(scale.dtype))
                assert torch.equal(zero_point.reshape(-1).float(), result.zero_point.reshape(-1).float())
                assert torch.equal(quantizer(block.detach()), block.detach())  # the forward keeps it
                # GPTQ's loss is the OBS objective it minimises: 1/2 tr(dW H_damped dW^T)
                h = record["hessian"].double()
                damped = h + 0.01 * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=torch.float64)
                delta = (result.weight - w).double()
                assert result.loss == pytest.approx(0.5 * float(torch.trace(delta @ damped @ delta.T)), rel=1e-3)
                # and below round-to-nearest's for this expert's Hessian
                rtn = fake_quant_reference(w, *_rtn_qparams(quantizer, w))
                rtn_delta = (rtn - w).double()
                assert float(torch.trace(delta @ h @ delta.T)) < float(torch.trace(rtn_delta @ h @ rtn_delta.T))


def _rtn_qparams(quantizer: nn.Module, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The qparams the weight spec's own min-max observer gives ``w`` (what round-to-nearest uses)."""
    observer = quantizer.spec.observer_cls(quantizer.spec, w.device)
    observer(w)
    return observer.calculate_qparams()


# ----------------------------------------------------------------------------------------------- too few tokens
def test_an_expert_with_too_few_tokens_keeps_round_to_nearest_and_is_named(monkeypatch, caplog) -> None:
    model, data = build("qwen3_moe"), token_batches(n=4, batch=4)
    reference = copy.deepcopy(model)
    x = moe_block_inputs(reference, 0, data)
    counts = torch.bincount(routed(reference.model.layers[0].mlp.gate.weight, x, TOP_K).reshape(-1), minlength=EXPERTS)
    fewest = int(counts.argmin())
    # a threshold between the fewest tokens an expert of layer 0 got and the next fewest, for gate and up (64 inputs)
    threshold = (int(counts[fewest]) + int(counts.sort().values[1])) / 2
    assert counts[fewest] < threshold < counts.sort().values[1]
    monkeypatch.setattr(GPTQConfig, "MIN_EXPERT_TOKENS_PER_FEATURE", threshold / 64)
    rtn_model = ModelQuantizer(weight_only(spec("per_group"))).quantize_model(copy.deepcopy(reference), data)
    with caplog.at_level(logging.WARNING, logger="quark.torch.algorithm.gptq_plan"):
        ModelQuantizer(experts_only("qwen3_moe")).quantize_model(model, data)
    twin, rtn_twin = model.model.layers[0].mlp.experts, rtn_model.model.layers[0].mlp.experts
    for e in range(EXPERTS):
        for proj in ("gate", "up"):
            rows = slice(0, INTER) if proj == "gate" else slice(INTER, 2 * INTER)
            quantized = getattr(twin, f"_e{e}_{proj}_weight_quantizer")(twin.gate_up_proj[e, rows]).detach()
            rtn = getattr(rtn_twin, f"_e{e}_{proj}_weight_quantizer")(rtn_twin.gate_up_proj[e, rows]).detach()
            assert torch.equal(quantized, rtn) == (e == fewest), (e, proj)
    (message,) = [r.getMessage() for r in caplog.records if "round-to-nearest" in r.getMessage()]
    assert f"model.layers.0.mlp.experts.{fewest} ({int(counts[fewest])} tokens): gate_proj, up_proj" in message
    assert "GPTQConfig.MIN_EXPERT_TOKENS_PER_FEATURE" in message
    others = [f"model.layers.0.mlp.experts.{e} " for e in range(EXPERTS) if e != fewest]
    assert not any(o in message for o in others)


class ExpertsOnly(nn.Module):
    """Mixtral's experts module fed routed tokens directly (no decoder stack: GPTQ goes module by module)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = build("mixtral").model.layers[0].mlp.experts

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, idx, w)


def test_an_expert_no_token_reaches_keeps_round_to_nearest_whatever_the_threshold(monkeypatch, caplog) -> None:
    """Without any routed token every input column is dead: GPTQ would zero the weight; the expert keeps RTN."""
    monkeypatch.setattr(GPTQConfig, "MIN_EXPERT_TOKENS_PER_FEATURE", 0.0)
    g = torch.Generator().manual_seed(5)
    others = torch.tensor([0, 1, 3])  # expert 2: no token
    data = [
        {
            "x": torch.randn(128, 64, generator=g),
            "idx": others[torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(128)])],
            "w": torch.rand(128, 2, generator=g),
        }
        for _ in range(2)
    ]
    model = ExpertsOnly()
    rtn = ModelQuantizer(weight_only(spec("per_group"))).quantize_model(copy.deepcopy(model), data)
    with caplog.at_level(logging.WARNING, logger="quark.torch.algorithm.gptq_plan"):
        ModelQuantizer(weight_only(spec("per_group"), algo_config={"name": "gptq"})).quantize_model(model, data)
    twin, rtn_twin = model.experts, rtn.experts
    for e in range(EXPERTS):
        for proj, block in (("gate", slice(0, INTER)), ("up", slice(INTER, 2 * INTER))):
            q, rtn_q = (
                getattr(twin, f"_e{e}_{proj}_weight_quantizer"),
                getattr(rtn_twin, f"_e{e}_{proj}_weight_quantizer"),
            )
            same = torch.equal(q(twin.gate_up_proj[e, block]), rtn_q(rtn_twin.gate_up_proj[e, block]))
            assert same == (e == 2), (e, proj)
    assert bool(twin.gate_up_proj[2].abs().amax() > 0)
    (message,) = [r.getMessage() for r in caplog.records if "round-to-nearest" in r.getMessage()]
    assert "experts.2 (0 tokens): gate_proj, up_proj, down_proj" in message


# ----------------------------------------------------------------------------------------------- passes and hooks
def test_every_experts_gate_and_up_then_every_experts_down_from_one_pass_each() -> None:
    model = build("mixtral")
    ModelQuantizer(weight_only(spec("per_group"))).prepare(model)
    layer = model.model.layers[0]
    targets = {
        n.removeprefix("model.layers.0."): m for n, m in gptq_targets(model).items() if n.startswith("model.layers.0.")
    }
    x = torch.zeros(1)
    first_inputs = {"self_attn.q_proj": x, "self_attn.k_proj": x, "self_attn.v_proj": x}
    groups = gptq_groups(targets, first_inputs, true_sequential=True)
    experts = [
        [f"mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in ps]
        for ps in (("gate_proj", "up_proj"), ("down_proj",))
    ]
    assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"], *experts]
    assert isinstance(targets["mlp.experts.2.up_proj"], LinearPart)
    del layer


def test_the_parts_hooks_see_exactly_the_routed_rows_and_their_weights_are_the_blocks() -> None:
    model, data = build("mixtral"), token_batches(n=1, batch=4)
    reference = copy.deepcopy(model)
    ModelQuantizer(weight_only(spec("per_group"))).prepare(model)
    for _, q in iter_quantizers(model):  # the float function: the routing of the float model
        q.disable_fake_quant()
    twin = model.model.layers[0].mlp.experts
    parts = linear_part_modules(twin)
    seen: dict[str, list[torch.Tensor]] = {}
    handles = [
        p.register_forward_pre_hook(lambda m, args, n=n: seen.setdefault(n, []).append(args[0]))
        for n, p in parts.items()
    ]
    with torch.no_grad():
        model(**data[0])
    for h in handles:
        h.remove()
    x = moe_block_inputs(reference, 0, data)
    routes = routed(reference.model.layers[0].mlp.gate.weight, x, TOP_K)
    for e in range(EXPERTS):
        mine, down_in = expert_inputs(x, routes, twin.gate_up_proj[e].detach(), e)
        (gate_in,), (up_in,), (down_seen,) = seen[f"{e}.gate_proj"], seen[f"{e}.up_proj"], seen[f"{e}.down_proj"]
        assert gate_in is up_in  # one tensor: one Hessian for both
        order = torch.argsort(_row_keys(gate_in))
        torch.testing.assert_close(gate_in[order], mine[torch.argsort(_row_keys(mine))], rtol=0, atol=0)
        torch.testing.assert_close(down_seen[order], down_in[torch.argsort(_row_keys(mine))], rtol=1e-5, atol=1e-6)
        part = parts[f"{e}.down_proj"]
        assert part.weight.data_ptr() == twin.down_proj[e].data_ptr() and part.weight.shape == (64, INTER)
        torch.testing.assert_close(part(down_seen), F.linear(down_seen, twin.down_proj[e]))
    with torch.no_grad():  # removed hooks see nothing more
        model(**data[0])
    assert all(len(v) == 1 for v in seen.values())
    with torch.no_grad():  # writing into a part writes into the stacked Parameter
        parts["1.up_proj"].weight.mul_(2)
    torch.testing.assert_close(
        twin.gate_up_proj[1, INTER:], 2 * reference.model.layers[0].mlp.experts.gate_up_proj[1, INTER:]
    )


def _row_keys(rows: torch.Tensor) -> torch.Tensor:
    """A sort key per row (rows of the same tokens in another order sort alike)."""
    return rows.double() @ torch.linspace(1, 2, rows.shape[1], dtype=torch.float64)
