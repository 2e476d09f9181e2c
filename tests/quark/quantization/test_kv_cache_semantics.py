"""KV-cache and attention quantization with amd-quark 0.13's semantics, on a tiny Hugging Face LLaMA (random weights).

Every calibrated scale is checked against the tensors an independent float run gives: the k/v projections' outputs
(forward hooks, pre-RoPE), the key states after RoPE (the attention's inputs captured by a pre-hook, rotated with
transformers' own ``apply_rotary_pos_emb``), the eager attention's probabilities (``output_attentions``). Static fp8
scales are amax / 448, int8 (symmetric, amd-quark's convention) amax / ((127 - (-128)) / 2) = amax / 127.5.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import (
    FP8E4M3PerTensorSpec,
    Int8PerChannelSpec,
    Int8PerTensorSpec,
    QConfig,
    QLayerConfig,
)
from quark.torch.quantization.nn.modules import QuantLinear, QuantMixin
from quark.torch.quantization.nn.modules.quant_attention import QuantAttentionProbs

transformers = pytest.importorskip("transformers")
llama_module = pytest.importorskip("transformers.models.llama.modeling_llama")

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")

FP8 = FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False).to_quantization_spec()
INT8 = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
INT8_W = Int8PerChannelSpec(ch_axis=0, symmetric=True).to_quantization_spec()
QMAX = {"fp8": 448.0, "int8": 127.5}
LAYERS = 2


def tiny_llama(attn: str = "eager") -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def batches() -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    return [{"input_ids": torch.randint(0, 256, (2, 12))} for _ in range(3)]


def kv_config(spec=FP8, post_rope: bool = False, **fields) -> QConfig:
    kv = QLayerConfig(output_tensors=spec)
    return QConfig(
        global_quant_config=fields.pop("global_quant_config", QLayerConfig(weight=INT8_W)),
        kv_cache_quant_config={"*k_proj": kv, "*v_proj": kv},
        kv_cache_group=["*k_proj", "*v_proj"],
        kv_cache_post_rope=post_rope,
        exclude=["lm_head"],
        **fields,
    )


def scale_of(layer: QuantMixin) -> float:
    return float(layer._output_quantizer.calculate_qparams()[0])


# ----------------------------------------------------------------------------------------------- independent amax
def float_kv_amax(post_rope: bool) -> dict[str, float]:
    """amax of each layer's keys and values in a float run of the calibration batches: the projection outputs, or
    for post-RoPE keys the states transformers' apply_rotary_pos_emb gives from the attention's own inputs."""
    model = tiny_llama()
    amax: dict[str, float] = {}
    hooks = []

    def record(name: str, value: torch.Tensor) -> None:
        amax[name] = max(amax.get(name, 0.0), float(value.abs().max()))

    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hooks.append(attn.v_proj.register_forward_hook(lambda m, a, out, i=i: record(f"{i}.v", out)))
        if not post_rope:
            hooks.append(attn.k_proj.register_forward_hook(lambda m, a, out, i=i: record(f"{i}.k", out)))
            continue

        def rotated(module, args, kwargs, i=i):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            shape = (*hidden.shape[:-1], -1, module.head_dim)
            k = module.k_proj(hidden).view(shape).transpose(1, 2)
            q = module.q_proj(hidden).view((*hidden.shape[:-1], -1, module.head_dim)).transpose(1, 2)
            _, k_rot = llama_module.apply_rotary_pos_emb(q, k, cos, sin)
            record(f"{i}.k", k_rot)

        hooks.append(attn.register_forward_pre_hook(rotated, with_kwargs=True))
    with torch.no_grad():
        for batch in batches():
            model(**batch, use_cache=False)
    for h in hooks:
        h.remove()
    return amax


@pytest.mark.parametrize("post_rope", [False, True], ids=["pre_rope", "post_rope"])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_kv_scales_are_amax_over_qmax_of_the_keys_and_values_at_the_quantized_point(fmt: str, post_rope: bool) -> None:
    spec = FP8 if fmt == "fp8" else INT8
    model = ModelQuantizer(kv_config(spec, post_rope)).quantize_model(tiny_llama(), batches())
    amax = float_kv_amax(post_rope)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert attn.k_proj.output_applied_elsewhere is post_rope and attn.v_proj.output_applied_elsewhere is post_rope
        # the kv entry is each k/v layer's whole config (amd-quark's rule): its weights stay float
        assert attn.k_proj._weight_quantizer is None and attn.q_proj._weight_quantizer is not None
        assert scale_of(attn.k_proj) == pytest.approx(amax[f"{i}.k"] / QMAX[fmt], rel=1e-6)
        assert scale_of(attn.v_proj) == pytest.approx(amax[f"{i}.v"] / QMAX[fmt], rel=1e-6)
    if post_rope:  # RoPE mixes pairs of channels: the rotated keys have another range than the projection's
        before = float_kv_amax(False)
        assert any(abs(before[f"{i}.k"] - amax[f"{i}.k"]) > 1e-4 * amax[f"{i}.k"] for i in range(LAYERS))


def fp8_fake_quant(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def test_post_rope_keys_reach_the_attention_quantized_and_the_projection_output_does_not(monkeypatch) -> None:
    model = ModelQuantizer(kv_config(FP8, post_rope=True)).quantize_model(tiny_llama(), batches())
    seen: dict[str, torch.Tensor] = {}
    eager = llama_module.eager_attention_forward

    def spy(module, query, key, value, *args, **kwargs):  # what get_interface's default would call
        if module is model.model.layers[0].self_attn:
            seen.update(key=key, value=value)
        return eager(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(llama_module, "eager_attention_forward", spy)
    attn = model.model.layers[0].self_attn
    projected = {}
    handle = attn.k_proj.register_forward_hook(lambda m, a, out: projected.update(k=out, x=a[0]))
    ids = batches()[0]["input_ids"]
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    assert torch.equal(projected["k"], nn.functional.linear(projected["x"], attn.k_proj.weight))  # not quantized
    k = projected["k"].view(*ids.shape, -1, attn.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(projected["x"], torch.arange(ids.shape[1])[None])
    _, k_rot = llama_module.apply_rotary_pos_emb(k, k, cos, sin)
    assert torch.equal(seen["key"], fp8_fake_quant(k_rot, scale_of(attn.k_proj)))
    assert not torch.equal(seen["key"], k_rot)


def test_softmax_probabilities_are_quantized_on_the_grid_of_amax_over_448() -> None:
    config = QConfig(global_quant_config=QLayerConfig(), softmax_quant_spec=FP8)
    float_model = tiny_llama()
    with torch.no_grad():
        amax = [0.0] * LAYERS
        for batch in batches():
            for i, a in enumerate(float_model(**batch, output_attentions=True).attentions):
                amax[i] = max(amax[i], float(a.abs().max()))
    model = ModelQuantizer(config).quantize_model(tiny_llama(), batches())
    ids = batches()[0]["input_ids"]
    with torch.no_grad():
        reference = float_model(input_ids=ids, output_attentions=True).attentions[0]
        quantized = model(input_ids=ids, output_attentions=True).attentions[0]
    probs = model.model.layers[0].self_attn.attn_probs
    assert isinstance(probs, QuantAttentionProbs)
    scale = scale_of(probs)
    assert scale == pytest.approx(amax[0] / 448, rel=1e-6)
    assert torch.equal(quantized, fp8_fake_quant(reference, scale))  # layer 0's scores are float: only the softmax
    assert not torch.equal(quantized, reference)


def test_a_kv_layer_that_is_excluded_keeps_only_its_output_quantizer() -> None:
    config = kv_config(FP8, global_quant_config=QLayerConfig(weight=INT8_W, input_tensors=INT8))
    config.exclude.append("*k_proj")
    quantizer = ModelQuantizer(config)
    model = quantizer.quantize_model(tiny_llama(), batches())
    k = model.model.layers[0].self_attn.k_proj
    assert isinstance(k, QuantLinear)
    assert k._weight_quantizer is None and k._input_quantizer is None and k._output_quantizer is not None
    assert "kv_cache '*k_proj' (layer excluded)" in quantizer.summary(tiny_llama())


def test_inherit_roles_fills_the_roles_a_kv_entry_leaves_none_and_the_last_matching_pattern_wins() -> None:
    int8_out = QLayerConfig(output_tensors=INT8)
    config = QConfig(
        global_quant_config=QLayerConfig(weight=INT8_W),
        kv_cache_quant_config={"*proj": QLayerConfig(output_tensors=FP8), "*v_proj": int8_out},
        inherit_roles=True,
        exclude=["lm_head"],
    )
    model = ModelQuantizer(config).quantize_model(tiny_llama(), batches())
    attn = model.model.layers[0].self_attn
    assert attn.v_proj.quant_config.output_tensors == INT8 and attn.k_proj.quant_config.output_tensors == FP8
    assert attn.v_proj._weight_quantizer is not None  # from the global level (inherit_roles)


def test_a_failed_quantization_leaves_no_attention_quantizer_behind() -> None:
    model = tiny_llama()
    data = [batches()[0], {"input_ids": torch.full((2, 12), 10_000)}]  # the second batch fails in the embedding
    with pytest.raises(IndexError):
        ModelQuantizer(kv_config(FP8, post_rope=True, softmax_quant_spec=FP8)).quantize_model(model, data)
    assert not any(isinstance(m, QuantMixin) for m in model.modules())
    assert not hasattr(model.model.layers[0].self_attn, "attn_probs")


def test_the_attention_wrapper_changes_nothing_for_a_model_it_did_not_prepare() -> None:
    ids = batches()[0]["input_ids"]
    for attn in ("eager", "sdpa"):
        with torch.no_grad():
            before = tiny_llama(attn)(input_ids=ids).logits
        ModelQuantizer(kv_config(FP8, post_rope=True)).quantize_model(tiny_llama(attn), batches())
        with torch.no_grad():
            assert torch.equal(tiny_llama(attn)(input_ids=ids).logits, before)


def test_the_wrapped_interface_hands_out_the_callers_own_default_for_other_modules() -> None:
    ModelQuantizer(kv_config(FP8, post_rope=True)).quantize_model(tiny_llama(), batches())
    interface = llama_module.ALL_ATTENTION_FUNCTIONS
    seen = []

    def own_default(module, query, key, value, mask, **kwargs):  # like timesfm's simple_eager_attention_forward
        seen.append((module, key))
        return query, None

    x = torch.randn(1, 2, 3, 4)
    function = interface.get_interface("eager", own_default)
    other = nn.Linear(2, 2)
    assert function(other, x, x, x, None)[0] is x and seen[0][0] is other and seen[0][1] is x


def test_softmax_on_a_model_switched_to_sdpa_after_preparing_is_refused_at_the_forward() -> None:
    model = ModelQuantizer(QConfig(global_quant_config=QLayerConfig(), softmax_quant_spec=FP8)).quantize_model(
        tiny_llama(), batches()
    )
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match=r"LlamaAttention: its attention function .* attn_implementation='eager'"):
        model(**batches()[0])


def test_post_rope_works_with_sdpa_and_a_kv_cache_during_generation() -> None:
    model = ModelQuantizer(kv_config(FP8, post_rope=True)).quantize_model(tiny_llama("sdpa"), batches())
    ids = batches()[0]["input_ids"][:1, :4]
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, use_cache=True)
        step = model(input_ids=out[:, :-1], use_cache=False).logits[:, -1].argmax(-1)
    assert out.shape == (1, 7) and torch.equal(out[:, -1], step)  # the cached run decodes as the uncached one


def test_pre_rope_kv_quantization_works_on_a_model_without_hugging_face_attention() -> None:
    from quark_lightning.tasks.char_lm import CharTransformer

    torch.manual_seed(0)
    model = CharTransformer(vocab_size=256, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_seq_len=16)
    seen = []
    float_k = [n for n, m in model.named_modules() if n.endswith("k_proj")][0]
    handle = model.get_submodule(float_k).register_forward_hook(lambda m, a, out: seen.append(out.abs().max()))
    data = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    with torch.no_grad():
        for x in data:
            model(x)
    handle.remove()
    ModelQuantizer(kv_config(FP8, global_quant_config=QLayerConfig())).quantize_model(model, data)
    assert scale_of(model.get_submodule(float_k)) == pytest.approx(float(max(seen)) / 448, rel=1e-6)
