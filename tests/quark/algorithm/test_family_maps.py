"""AWQ and SmoothQuant on the families of issue 35: Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``, with grouped-query
attention), GPT-NeoX (LayerNorm with bias, q/k/v interleaved per head; both ``use_parallel_residual`` settings) and
the mixture-of-experts layers of transformers 5 (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE).

Tiny random-weight models built from their transformers configs; every norm multiplied by random factors with a few
outlier channels (LayerNorm biases random too), as trained LLMs have. References are computed here: the model's
logits before the algorithm, and its weights before it (which rows and modules a fold may touch)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from algo_refs import spec_dict
from torch import nn

import quark.torch.algorithm.awq as awq_module
import quark.torch.algorithm.structure as structure
from quark.torch import ModelQuantizer
from quark.torch.algorithm import derive_scaling_groups, find_decoder_layers, model_family
from quark.torch.algorithm.fused_rows import FusedRows
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.equivalence import EquivalenceError
from quark.torch.quantization.nn.modules import iter_quantizers

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant", "ignore:.*reached")

VOCAB, HIDDEN, FFN = 128, 64, 128
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": FFN,
    "max_position_embeddings": 64,
}
_MOE = {"num_key_value_heads": 2, "num_experts_per_tok": 2, "head_dim": 16}
MODELS: dict[str, Callable[[], nn.Module]] = {
    "phi3-gqa": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**_COMMON, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**_COMMON, num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    ),
    "gpt-neox-parallel": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**_COMMON, use_parallel_residual=True)
    ),
    "gpt-neox-sequential": lambda: transformers.GPTNeoXForCausalLM(
        transformers.GPTNeoXConfig(**_COMMON, use_parallel_residual=False)
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**_COMMON, **_MOE, num_local_experts=4)
    ),
    "qwen2-moe": lambda: transformers.Qwen2MoeForCausalLM(  # layer 1 dense (mlp_only_layers): a LLaMA layer
        transformers.Qwen2MoeConfig(
            **_COMMON,
            **_MOE,
            num_experts=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
        )
    ),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**_COMMON, **_MOE, num_experts=4, moe_intermediate_size=32)
    ),
}
#: per model: the family of each decoder layer and its groups' prev_op
GROUPS = {
    "phi3-gqa": ("phi3", ["input_layernorm", "self_attn.qkv_proj", "post_attention_layernorm", "mlp.gate_up_proj"]),
    "gpt-neox-parallel": ("gpt-neox", ["input_layernorm", "attention.query_key_value", "post_attention_layernorm"]),
    "mixtral": ("moe", ["input_layernorm"]),  # v_proj -> o_proj left out with grouped-query attention, as LLaMA's
    "qwen2-moe": ("qwen2-moe", ["input_layernorm", "mlp.shared_expert.up_proj"]),
    "qwen3-moe": ("moe", ["input_layernorm"]),
}
GROUPS["phi3"] = GROUPS["phi3-gqa"]
GROUPS["gpt-neox-sequential"] = GROUPS["gpt-neox-parallel"]

W4 = spec_dict(4, "per_group", 32, sym=False)
W8, A8 = spec_dict(8, "per_channel"), spec_dict(8, "per_tensor")
SMOOTHQUANT = {
    "global_quant_config": {"weight": W8, "input_tensors": A8},
    "pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5},
}
AWQ = {"global_quant_config": {"weight": W4}, "algo_config": {"name": "awq"}}
RTN = {"global_quant_config": {"weight": W4}}
ALGORITHMS = {"smoothquant": SMOOTHQUANT, "awq": AWQ}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    g = torch.Generator().manual_seed(3)
    for module in model.modules():
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.ndim == 1:
            factor = (torch.rand(weight.shape, generator=g) + 0.5) * (
                1 + 15 * (torch.rand(weight.shape, generator=g) > 0.9).float()
            )
            with torch.no_grad():
                weight.copy_(factor)
                if isinstance(bias, torch.Tensor):
                    bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
    return model


def layers_of(model: nn.Module) -> nn.ModuleList:
    found = find_decoder_layers(model)
    assert found is not None
    return found[1]


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (2, 16), generator=g),
            "attention_mask": torch.ones(2, 16, dtype=torch.long),
        }
        for _ in range(3)
    ]


def logits(model: nn.Module, data: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in data])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def quantize(model: nn.Module, config: dict[str, Any], data: list[dict[str, torch.Tensor]]) -> nn.Module:
    return ModelQuantizer(Config.from_dict(copy.deepcopy(config))).quantize_model(model, data)


def quantizers_off(model: nn.Module) -> nn.Module:
    for _, q in iter_quantizers(model):
        q.disable_fake_quant()
    return model


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def no_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ's scale search and folding only (its clipping changes the float weights on purpose)."""
    monkeypatch.setattr(awq_module, "_search_clip", lambda *args, **kwargs: None)


# ----------------------------------------------------------------------------------------------- the map
@pytest.mark.parametrize("name", list(MODELS))
def test_each_layer_gets_its_family_and_groups(name: str) -> None:
    family, prev_ops = GROUPS[name]
    layers = layers_of(build(name))
    assert model_family(layers[0]).name == family  # type: ignore[union-attr]
    assert [g.prev_op for g in derive_scaling_groups(layers[0])] == prev_ops
    if name == "qwen2-moe":  # its dense layer: LLaMA's layout, all four groups (no grouped-query v -> o)
        assert model_family(layers[1]).name == "llama"  # type: ignore[union-attr]
        assert [g.prev_op for g in derive_scaling_groups(layers[1])] == [
            "input_layernorm",
            "post_attention_layernorm",
            "mlp.up_proj",
        ]


# ----------------------------------------------------------------------------------------------- the float function
def _touched(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in before if not torch.equal(before[n], after[n])}


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("name", list(MODELS))
def test_the_float_function_is_kept_with_quantizers_off(name: str, algo: str, no_clip) -> None:
    """Logits equal the float model's to float noise once the quantizers are off, and the folds went where the map
    says: into the norms and (fused) producers of the groups; MoE layers: the norm before the experts into the router
    and the fused experts (tests/quark/moe/test_moe_scaling.py checks those folds block by block)."""
    data = batches()
    model = build(name)
    reference, before = logits(model, data), weights(model)
    quantized = quantizers_off(quantize(model, ALGORITHMS[algo], data))
    assert relative(logits(quantized, data), reference) < 1e-5
    after = weights(quantized)
    touched = _touched(before, after)
    layer = "model.layers.0" if "gpt-neox" not in name else "gpt_neox.layers.0"
    assert f"{layer}.input_layernorm.weight" in touched
    if "gpt-neox" in name:
        assert f"{layer}.input_layernorm.bias" in touched and f"{layer}.attention.dense.weight" in touched
    if name.startswith("phi3"):  # the v rows of qkv_proj and the up half of gate_up_proj, the rest bit for bit
        qkv = after[f"{layer}.self_attn.qkv_proj.weight"]
        v_rows = quantized.model.layers[0].self_attn.num_key_value_heads * 16
        norm_scale = before[f"{layer}.input_layernorm.weight"] / after[f"{layer}.input_layernorm.weight"]
        ref_qk = before[f"{layer}.self_attn.qkv_proj.weight"][:-v_rows] * norm_scale  # only the norm's fold
        torch.testing.assert_close(qkv[:-v_rows], ref_qk, rtol=1e-6, atol=0)
        assert f"{layer}.self_attn.o_proj.weight" in touched and f"{layer}.mlp.down_proj.weight" in touched
    if "moe" in name or name == "mixtral":  # the norm into the router and every expert, each expert's up -> down
        experts = {f"{layer}.mlp.experts.gate_up_proj", f"{layer}.mlp.experts.down_proj"}
        assert {f"{layer}.post_attention_layernorm.weight", f"{layer}.mlp.gate.weight", *experts} <= touched


def test_the_fused_layout_matters_a_wrong_part_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3's qkv -> o_proj fold through the k rows instead of the v rows: SmoothQuant's check refuses it."""
    families = []
    for f in structure.MODEL_FAMILIES:
        if f.name == "phi3":
            wrong = FusedRows(("all", "kv", "kv"), 1, "self_attn.head_dim")
            groups = tuple(
                structure.ScalingGroup(g.prev_op, g.layers, g.inp, g.module2inspect, rows=wrong) if g.rows else g
                for g in f.groups
            )
            f = structure.ModelFamily(f.name, f.signature, groups, f.norm_offset, f.absent)
        families.append(f)
    monkeypatch.setattr(structure, "MODEL_FAMILIES", families)
    with pytest.raises(EquivalenceError, match=r"^SmoothQuant changed what model\.layers\.0 computes"):
        quantize(build("phi3-gqa"), SMOOTHQUANT, batches())


def test_amd_quarks_explicit_phi3_map_folds_through_the_v_rows(no_clip) -> None:
    """amd-quark 0.13's AWQ scaling_layers for phi3, given explicitly: qkv_proj -> o_proj takes the family's rows."""
    quark_phi3 = [
        {
            "prev_op": "input_layernorm",
            "layers": ["self_attn.qkv_proj"],
            "inp": "self_attn.qkv_proj",
            "module2inspect": "self_attn",
        },
        {"prev_op": "self_attn.qkv_proj", "layers": ["self_attn.o_proj"], "inp": "self_attn.o_proj"},
        {
            "prev_op": "post_attention_layernorm",
            "layers": ["mlp.gate_up_proj"],
            "inp": "mlp.gate_up_proj",
            "module2inspect": "mlp",
        },
        {"prev_op": "mlp.gate_up_proj", "layers": ["mlp.down_proj"], "inp": "mlp.down_proj"},
    ]
    data = batches()
    model = build("phi3-gqa")
    reference = logits(model, data)
    config = copy.deepcopy(AWQ)
    config["algo_config"] |= {"scaling_layers": quark_phi3, "model_decoder_layers": "model.layers"}
    quantized = quantizers_off(quantize(model, config, data))
    assert relative(logits(quantized, data), reference) < 1e-5


# ----------------------------------------------------------------------------------------------- against round-to-nearest
@pytest.mark.parametrize("name", ["phi3-gqa", "gpt-neox-parallel", "qwen2-moe"])
def test_awq_is_no_worse_than_round_to_nearest_on_its_calibration_data(name: str) -> None:
    data = batches()
    reference = logits(build(name), data)
    awq = relative(logits(quantize(build(name), AWQ, data), data), reference)
    rtn = relative(logits(quantize(build(name), RTN, data), data), reference)
    assert 0 < awq <= rtn * 1.0001, (awq, rtn)


# ----------------------------------------------------------------------------------------------- an unknown family
class Block(nn.Module):
    """A decoder-like layer of no known family: an attention and an MLP child by their usual names."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.self_attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.self_attn(self.norm(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_an_unknown_family_is_refused_listing_only_the_models_own_modules(algo: str) -> None:
    """Through the algorithms (the layers are prepared: quantizers and observers attached): the error lists the
    layer's modules, not the quantizer submodules this library adds."""
    config = copy.deepcopy(ALGORITHMS[algo])
    config["global_quant_config"]["weight"] = spec_dict(4, "per_group", 8, sym=False)
    with pytest.raises(ValueError, match=r"cannot derive scaling_layers for layer Block") as raised:
        quantize(Net(), config, [torch.randn(2, 8)])
    text = str(raised.value)
    assert "its modules: ['norm', 'self_attn', 'mlp']" in text, text
    assert "quantizer" not in text and "observer" not in text, text


def test_explicit_groups_naming_a_missing_module_list_only_the_models_own_modules() -> None:
    quantizer = ModelQuantizer(Config.from_dict({"global_quant_config": {"weight": W8, "input_tensors": A8}}))
    layer = quantizer.prepare(Net()).blocks[0]
    assert any(n.endswith("_input_quantizer.observer") for n, _ in layer.named_modules())  # they are there
    with pytest.raises(ValueError, match=r"names \['fc', 'fc'\].*its modules: \['norm', 'self_attn', 'mlp'\]$"):
        structure.scaling_groups(layer, [{"prev_op": "norm", "layers": ["fc"]}])
