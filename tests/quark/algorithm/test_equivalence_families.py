"""SmoothQuant and AWQ's scaling keep what a model computes on the families that showed they did not (issue 33):
Gemma / Gemma2 / Gemma3 (norms computing ``x * (1 + w)``; Gemma2/3 with a norm after the attention output and one
before the MLP), and AWQ on Bloom (alibi, [batch * heads, 1, keys], broke the merged calibration calls).

Tiny transformers models with random weights. References are computed here: the model's logits before the algorithm,
the norm forms from the transformers classes' own code (a ``Gemma*RMSNorm`` multiplies by ``1 + w``)."""

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
from quark.torch.algorithm.smoothquant import fold_scales
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.equivalence import EquivalenceError
from quark.torch.quantization.hf import linear_weight
from quark.torch.quantization.nn.modules import iter_quantizers

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*stay float", "ignore:.*register_constant")

VOCAB, HIDDEN, FFN = 128, 64, 128
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "intermediate_size": FFN,
    "max_position_embeddings": 64,
}
MODELS: dict[str, Callable[[int], nn.Module]] = {
    "gemma": lambda kv: transformers.GemmaForCausalLM(transformers.GemmaConfig(**_COMMON, num_key_value_heads=kv)),
    "gemma2": lambda kv: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**_COMMON, num_key_value_heads=kv)),
    "gemma3": lambda kv: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**_COMMON, num_key_value_heads=kv)
    ),
    "llama": lambda kv: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, num_key_value_heads=kv)),
    "bloom": lambda kv: transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=2, n_head=4)
    ),
}
GEMMAS = ["gemma", "gemma2", "gemma3"]

W4 = spec_dict(4, "per_group", 32, sym=False)
W8, A8 = spec_dict(8, "per_channel"), spec_dict(8, "per_tensor")
SMOOTHQUANT = {
    "global_quant_config": {"weight": W8, "input_tensors": A8},
    "pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5},
}
AWQ = {"global_quant_config": {"weight": W4}, "algo_config": {"name": "awq"}}
RTN = {"global_quant_config": {"weight": W4}}
ALGORITHMS = {"smoothquant": SMOOTHQUANT, "awq": AWQ}


def _offset(norm: nn.Module) -> float:
    """What the norm's weight is added to (transformers' Gemma norms: ``x * (1 + w)``; LLaMA's, LayerNorm: ``x * w``)."""
    return 1.0 if type(norm).__name__.startswith("Gemma") else 0.0


def build(name: str, kv_heads: int = 4) -> nn.Module:
    """The tiny model, its norms multiplying by random factors with a few outlier channels (as trained LLMs have:
    what SmoothQuant and AWQ are for); Gemma's zero-initialised ``w`` would otherwise hide its ``1 + w`` form."""
    torch.manual_seed(0)
    model = MODELS[name](kv_heads).eval()
    g = torch.Generator().manual_seed(3)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.ndim == 1:
            factor = (torch.rand(weight.shape, generator=g) + 0.5) * (
                1 + 15 * (torch.rand(weight.shape, generator=g) > 0.9).float()
            )
            with torch.no_grad():
                weight.copy_(factor - _offset(module))
    return model


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


def norm_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if "norm" in type(m).__name__.lower()}


@pytest.fixture
def no_clip(monkeypatch: pytest.MonkeyPatch) -> None:
    """AWQ's scale search and folding only (its clipping changes the float weights on purpose)."""
    monkeypatch.setattr(awq_module, "_search_clip", lambda *args, **kwargs: None)


# ----------------------------------------------------------------------------------------------- the float function
@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("name", [*GEMMAS, "llama"])
def test_the_float_function_is_kept_with_quantizers_off(name: str, algo: str, no_clip) -> None:
    data = batches()
    model = build(name)
    reference = logits(model, data)
    norms_before = norm_weights(model)
    quantized = quantizers_off(quantize(model, ALGORITHMS[algo], data))
    assert relative(logits(quantized, data), reference) < 1e-5
    norms_after = norm_weights(quantized)
    layer = "model.layers.0"
    assert not torch.equal(norms_after[f"{layer}.input_layernorm"], norms_before[f"{layer}.input_layernorm"])
    if name in ("gemma2", "gemma3"):  # the MLP's scale went into the norm before it; the one after attention kept
        assert not torch.equal(
            norms_after[f"{layer}.pre_feedforward_layernorm"], norms_before[f"{layer}.pre_feedforward_layernorm"]
        )
        for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
            assert torch.equal(norms_after[f"{layer}.{norm}"], norms_before[f"{layer}.{norm}"])


@pytest.mark.parametrize("name", GEMMAS)
def test_gemma_norm_fold_divides_one_plus_w(name: str) -> None:
    """The fold itself: ``(1 + w_new) = (1 + w) / s`` as computed here, and the output kept (Gemma's norms compute
    in float32 whatever the model's dtype: float32 noise)."""
    model = build(name)
    norm = model.model.layers[0].input_layernorm
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, HIDDEN)
    with torch.no_grad():
        before = q(norm(x))
        w = norm.weight.detach().double()
        s = torch.rand(HIDDEN) * 3 + 0.25
        fold_scales(norm, [q], s, "test")
        torch.testing.assert_close(1 + norm.weight.double(), (1 + w) / s.double(), rtol=1e-6, atol=1e-7)
        assert relative(q(norm(x)), before) < 1e-6


# ----------------------------------------------------------------------------------------------- the family map
@pytest.mark.parametrize("name", GEMMAS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_gemma_scaling_groups_place_the_mlp_scale_before_the_mlp(name: str, kv_heads: int) -> None:
    """Gemma: LLaMA's layout; Gemma2/3: the MLP reads pre_feedforward_layernorm (post_attention_layernorm normalises
    the attention output). v_proj -> o_proj stays where it folds (not with grouped-query attention)."""
    layer = build(name, kv_heads).model.layers[0]
    mlp_norm = "post_attention_layernorm" if name == "gemma" else "pre_feedforward_layernorm"
    expected = ["input_layernorm", "self_attn.v_proj", mlp_norm, "mlp.up_proj"]
    if kv_heads != 4:
        expected.remove("self_attn.v_proj")
    groups = derive_scaling_groups(layer)
    assert [g.prev_op for g in groups] == expected
    assert groups[expected.index(mlp_norm)].layers == ["mlp.gate_proj", "mlp.up_proj"]
    family = model_family(layer)
    assert family is not None and family.norm_offset == 1.0
    assert model_family(build("llama").model.layers[0]).norm_offset == 0.0  # type: ignore[union-attr]


class OnePlusNorm(nn.Module):
    """A norm of no known class computing ``x * (1 + w)``: found by probing."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class SquaredNorm(OnePlusNorm):
    """A norm whose weight enters squared: neither form; a scale cannot be folded into it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.pow(2)


def test_the_norm_form_by_class_name_or_by_probing() -> None:
    gemma = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(8)
    llama = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    probed, squared = OnePlusNorm(8), SquaredNorm(8)
    weight = probed.weight.detach().clone()
    assert [structure.norm_offset(m) for m in (gemma, llama, nn.LayerNorm(8), nn.RMSNorm(8), probed, squared)] == [
        1.0,
        0.0,
        0.0,
        0.0,
        1.0,
        None,
    ]
    assert torch.equal(probed.weight, weight)  # the probe put the weight back bit for bit
    assert structure.norm_offset(nn.Linear(8, 8)) is None
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 3)
    before = lin(probed(x))
    with torch.no_grad():
        fold_scales(probed, [lin], torch.rand(8) + 0.5, "test")
        torch.testing.assert_close(lin(probed(x)), before, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"cannot fold a scale into SquaredNorm: .*neither"):
        fold_scales(squared, [lin], torch.rand(8) + 0.5, "test")


# ----------------------------------------------------------------------------------------------- against round-to-nearest
@pytest.mark.parametrize("name", GEMMAS)
def test_awq_is_no_worse_than_round_to_nearest(name: str) -> None:
    data = batches()
    reference = logits(build(name), data)
    awq = relative(logits(quantize(build(name), AWQ, data), data), reference)
    rtn = relative(logits(quantize(build(name), RTN, data), data), reference)
    assert 0 < awq <= rtn * 1.0001, (awq, rtn)


# ----------------------------------------------------------------------------------------------- Bloom
def test_awq_on_bloom_runs_merges_alibi_and_is_no_worse_than_round_to_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    data = batches()
    reference = logits(build("bloom"), data)
    merged: list[int] = []
    original = awq_module._merged_calls
    monkeypatch.setattr(
        awq_module, "_merged_calls", lambda layer, calls: merged.append(len(r := original(layer, calls))) or r
    )
    awq = relative(logits(quantize(build("bloom"), AWQ, data), data), reference)
    rtn = relative(logits(quantize(build("bloom"), RTN, data), data), reference)
    assert merged == [1, 1]  # per decoder layer, its 3 calibration calls ran as one
    assert 0 < awq <= rtn * 1.0001, (awq, rtn)


def test_bloom_awq_scaling_keeps_the_float_function(no_clip) -> None:
    data = batches()
    model = build("bloom")
    reference = logits(model, data)
    assert relative(logits(quantizers_off(quantize(model, AWQ, data)), data), reference) < 1e-5


def test_merge_concatenates_a_per_sample_tensor_of_several_rows_per_sample() -> None:
    """Bloom's alibi: [batch * heads, 1, keys], sample-major; merged calls get it concatenated along dim 0."""
    alibi = torch.randn(8, 1, 5)  # batch 2, 4 heads
    calls = [
        ((torch.randn(2, 5, 16),), {"alibi": alibi, "attention_mask": torch.zeros(2, 1, 5, 5, dtype=torch.bool)})
        for _ in range(2)
    ]
    calls.append(
        ((torch.randn(1, 5, 16),), {"alibi": alibi[:4], "attention_mask": torch.zeros(1, 1, 5, 5, dtype=torch.bool)})
    )
    (merged,) = awq_module._merge(calls)
    assert torch.equal(merged[1]["alibi"], torch.cat([alibi, alibi, alibi[:4]]))
    assert merged[1]["attention_mask"].shape == (5, 1, 5, 5)
    odd = [((torch.randn(2, 5, 16),), {"table": torch.randn(3, 5)}) for _ in range(2)]  # 3 rows for 2 samples
    assert len(awq_module._merge(odd)) == 2  # neither per sample nor equal: kept apart


class MergeBreaks(nn.Module):
    """A layer that fails on any batch but 2 (an argument the merge cannot see is per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] != 2:
            raise RuntimeError("The expanded size of the tensor must match")
        return self.fc(hidden_states)


def test_a_merged_call_that_fails_keeps_the_calls_apart() -> None:
    calls = [((torch.randn(2, 3, 8),), {}) for _ in range(3)]
    assert awq_module._merged_calls(MergeBreaks(), calls) is calls


# ----------------------------------------------------------------------------------------------- a broken fold is caught
def _state_bytes(model: nn.Module) -> dict[str, bytes]:
    """Every parameter and buffer as bytes, but the quantizers' on/off flags (``calibrate`` sets them on its way out,
    failed or not)."""
    return {
        k: v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        for k, v in model.state_dict().items()
        if not k.endswith("_enabled")
    }


def _plain_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every norm taken for ``x * w`` (Gemma's too): the mistake SmoothQuant made on Gemma before issue 33."""
    monkeypatch.setattr(structure, "UNIT_OFFSET_NORMS", frozenset())
    monkeypatch.setattr(structure, "_probe_offset", lambda module, weight: 0.0)


def _llama_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma2/3's map with LLaMA's groups: the MLP's scale folded into post_attention_layernorm, which normalises the
    attention output (the mistake on Gemma2/3 before issue 33)."""
    families = [
        structure.ModelFamily(f.name, f.signature, structure.MODEL_FAMILIES[2].groups, f.norm_offset, f.absent)
        if f.name == "gemma2"
        else f
        for f in structure.MODEL_FAMILIES
    ]
    assert structure.MODEL_FAMILIES[2].name == "llama"
    monkeypatch.setattr(structure, "MODEL_FAMILIES", families)


BROKEN = {"gemma-as-plain-w": ("gemma", _plain_norms), "gemma2-llama-placement": ("gemma2", _llama_placement)}


@pytest.mark.parametrize("algo", list(ALGORITHMS))
@pytest.mark.parametrize("broken", list(BROKEN))
def test_a_broken_fold_raises_naming_transform_and_layer_and_leaves_the_model_as_it_was(
    broken: str, algo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``prepare`` + ``calibrate`` (no copy kept by ``quantize_model``): the algorithm itself puts back every
    parameter and buffer, bit for bit."""
    name, breaks = BROKEN[broken]
    breaks(monkeypatch)
    data = batches()
    quantizer = ModelQuantizer(Config.from_dict(copy.deepcopy(ALGORITHMS[algo])))
    model = quantizer.prepare(build(name))
    before = _state_bytes(model)
    transform = {"smoothquant": "SmoothQuant", "awq": "AWQ"}[algo]
    with pytest.raises(EquivalenceError, match=rf"^{transform} changed what model\.layers\.0 computes"):
        quantizer.calibrate(model, data)
    assert _state_bytes(model) == before


def test_a_failure_in_a_later_layer_puts_the_earlier_layers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 folds correctly; layer 1's fold is broken: layer 0 is restored too."""
    import quark.torch.algorithm.smoothquant as smoothquant

    fold = smoothquant.fold_scales
    seen: list[int] = []

    def fold_layer_1_wrong(
        prev: nn.Module, layers: list[nn.Module], scales: torch.Tensor, where: str, rows: torch.Tensor | None = None
    ) -> None:
        seen.append(id(prev))
        fold(prev, layers, scales, where, rows=rows)
        if len(seen) > 4:  # 4 groups per layer: layer 1's consumers get twice the scale their producer lost
            with torch.no_grad():
                linear_weight(layers[0]).mul_(2)

    monkeypatch.setattr(smoothquant, "fold_scales", fold_layer_1_wrong)
    quantizer = ModelQuantizer(Config.from_dict(copy.deepcopy(SMOOTHQUANT)))
    model = quantizer.prepare(build("llama"))
    before = _state_bytes(model)
    with pytest.raises(EquivalenceError, match=r"SmoothQuant changed what model\.layers\.1 computes"):
        quantizer.calibrate(model, batches())
    assert _state_bytes(model) == before


def test_decoder_stack_of_every_gemma_is_found() -> None:
    for name in GEMMAS:
        found = find_decoder_layers(build(name))
        assert found is not None and found[0] == "model.layers"
