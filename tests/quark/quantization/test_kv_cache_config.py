"""The KV-cache and attention fields of ``Config`` (amd-quark 0.13's names and defaults): round trips through our
dicts and amd-quark's config.json (both directions, against the files amd-quark 0.13 wrote), and the clear errors,
raised before the model is touched."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.export.quark_config import from_quark_dict, to_quark_dict
from quark.torch.quantization.config.config import (
    Config,
    FP8E4M3PerChannelSpec,
    FP8E4M3PerTensorSpec,
    Int4PerTensorSpec,
    Int8PerTensorSpec,
    OCP_MXFP4Spec,
    QConfig,
    QLayerConfig,
    Uint8PerTensorSpec,
)
from quark.torch.quantization.nn.modules import QuantMixin

transformers = pytest.importorskip("transformers")

EXPORTS = Path(__file__).resolve().parents[3] / "bench" / "amd_quark_reference" / "exports"
FP8 = FP8E4M3PerTensorSpec(observer_method="min_max", is_dynamic=False).to_quantization_spec()
KV = QLayerConfig(output_tensors=FP8)
KV_FIELDS = ("kv_cache_quant_config", "kv_cache_group", "min_kv_scale", "kv_cache_post_rope", "softmax_quant_spec")

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")


def tiny_llama(attn: str = "eager") -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def full_config() -> Config:
    return QConfig(
        global_quant_config=QLayerConfig(weight=FP8, input_tensors=FP8),
        kv_cache_quant_config={"*k_proj": QLayerConfig(weight=FP8, output_tensors=FP8), "*v_proj": KV},
        kv_cache_group=["*k_proj", "*v_proj"],
        min_kv_scale=0.002,
        kv_cache_post_rope=True,
        softmax_quant_spec=Uint8PerTensorSpec(symmetric=False).to_quantization_spec(),
        exclude=["lm_head"],
    )


def test_the_fields_have_amd_quarks_names_and_defaults() -> None:
    config = Config(global_quant_config=QLayerConfig())
    assert [f.name for f in fields(Config) if f.name in KV_FIELDS] == list(KV_FIELDS)
    assert (config.kv_cache_quant_config, config.kv_cache_group, config.min_kv_scale) == ({}, [], 0.0)
    assert config.kv_cache_post_rope is False and config.softmax_quant_spec is None


def test_to_dict_from_dict_round_trips_every_kv_and_softmax_field() -> None:
    config = full_config()
    data = json.loads(json.dumps(config.to_dict()))
    assert data["kv_cache_quant_config"]["*v_proj"]["output_tensors"]["dtype"] == "fp8_e4m3"
    assert data["softmax_quant_spec"]["dtype"] == "uint8" and data["min_kv_scale"] == 0.002
    assert Config.from_dict(data) == config


@pytest.mark.parametrize("scheme", ["kv_fp8", "kv_fp8_softmax_fp8", "kv_int8"])
def test_amd_quarks_config_json_reads_into_the_fields_and_writes_back_unchanged(scheme: str) -> None:
    amd = json.loads((EXPORTS / scheme / "config.json").read_text())["quantization_config"]
    config, export = from_quark_dict(amd)
    assert config.kv_cache_group == amd["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    assert config.min_kv_scale == amd["export"]["min_kv_scale"]
    assert sorted(config.kv_cache_quant_config) == ["*k_proj", "*v_proj"]
    assert config.kv_cache_quant_config["*k_proj"].output_tensors.dtype.name == (
        "int8" if "int8" in scheme else "fp8_e4m3"
    )
    assert (config.softmax_quant_spec is not None) == ("softmax" in scheme)
    assert to_quark_dict(config, export["weight_format"], export["pack_method"]) == amd


def test_our_config_json_reads_back_into_the_same_config() -> None:
    config = full_config()
    written = json.loads(json.dumps(to_quark_dict(config)))
    assert written["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"] and written["export"]["min_kv_scale"] == 0.002
    assert written["kv_cache_post_rope"] is True
    # the kv entries are also the layer_quant_config entries of their patterns (what vLLM and transformers read)
    assert written["layer_quant_config"]["*v_proj"] == written["kv_cache_quant_config"]["*v_proj"]
    back, _ = from_quark_dict(written)
    for name in KV_FIELDS:
        assert getattr(back, name) == getattr(config, name), name


def test_without_a_kv_cache_config_the_export_block_has_no_kv_cache_group() -> None:
    config = QConfig(global_quant_config=QLayerConfig(weight=FP8), kv_cache_group=["*k_proj", "*v_proj"])
    assert to_quark_dict(config)["export"]["kv_cache_group"] == []  # amd-quark's exporter writes [] then


@pytest.mark.parametrize(
    ("fields_", "message"),
    [
        ({"kv_cache_quant_config": {"*k_proj": QLayerConfig(weight=FP8)}}, r"\['\*k_proj'\]\.output_tensors is None"),
        (
            {
                "kv_cache_quant_config": {
                    "*k_proj": QLayerConfig(output_tensors=OCP_MXFP4Spec(ch_axis=-1).to_quantization_spec())
                }
            },
            r"output_tensors\.dtype=mx: a KV cache cannot hold it; allowed: \['fp8_e4m3', 'fp8_e5m2', 'int8'\]",
        ),
        (
            {
                "kv_cache_quant_config": {
                    "*k_proj": QLayerConfig(output_tensors=Int4PerTensorSpec().to_quantization_spec())
                }
            },
            r"dtype=int4: a KV cache cannot hold it",
        ),
        (
            {
                "kv_cache_quant_config": {
                    "*k": QLayerConfig(output_tensors=FP8E4M3PerChannelSpec(ch_axis=-1).to_quantization_spec())
                }
            },
            r"\['\*k'\]\.output_tensors\.qscheme=per_channel: a KV cache has one scale per tensor",
        ),
        (
            {
                "kv_cache_quant_config": {
                    "*k": QLayerConfig(output_tensors=Int8PerTensorSpec(symmetric=False).to_quantization_spec())
                }
            },
            r"symmetric=False: the KV cache stores keys and values with zero point 0",
        ),
        ({"softmax_quant_spec": Int4PerTensorSpec().to_quantization_spec()}, r"softmax_quant_spec\.dtype=int4"),
        ({"min_kv_scale": -1.0}, r"min_kv_scale=-1\.0 must be a finite number >= 0"),
        ({"min_kv_scale": float("inf")}, r"min_kv_scale=inf must be a finite number >= 0"),
        ({"kv_cache_post_rope": "yes"}, r"kv_cache_post_rope='yes' must be true or false"),
        ({"kv_cache_group": "*k_proj"}, r"kv_cache_group='\*k_proj' must be a list of layer-name patterns"),
        (
            {"kv_cache_quant_config": {"*k_proj": KV}, "quant_mode": "fx_graph_mode"},
            r"work in eager_mode only",
        ),
    ],
)
def test_bad_fields_are_refused_by_name(fields_: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(global_quant_config=QLayerConfig(), **fields_)


class PlainAttention(nn.Module):
    """An attention with k/v projections that is not a Hugging Face module (no attention interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2), dim=-1)
        return w @ self.v_proj(x)


@pytest.mark.parametrize(
    ("build", "fields_", "message"),
    [
        (tiny_llama, {"kv_cache_quant_config": {"*kproj": KV}}, r"\['\*kproj'\] matches no quantizable layer .*k_proj"),
        (
            tiny_llama,
            {"kv_cache_quant_config": {"*k_proj": KV}, "kv_cache_group": ["*k_proj", "*v_proj"]},
            r"kv_cache_group pattern '\*v_proj' matches none of the KV-cache layers",
        ),
        (
            PlainAttention,
            {"kv_cache_quant_config": {"*k_proj": KV}, "kv_cache_post_rope": True},
            r"'<model>' \(PlainAttention\), the parent of the KV-cache layer 'k_proj', is not a Hugging Face attention",
        ),
        (
            tiny_llama,
            {"kv_cache_quant_config": {"*o_proj": KV}, "kv_cache_post_rope": True},
            r"'model\.layers\.0\.self_attn\.o_proj' is not a key or value projection",
        ),
        (
            lambda: tiny_llama("sdpa"),
            {"softmax_quant_spec": FP8},
            r"attention 'model\.layers\.0\.self_attn' runs attn_implementation='sdpa'.*attn_implementation='eager'",
        ),
        (PlainAttention, {"softmax_quant_spec": FP8}, r"softmax_quant_spec .* PlainAttention has none"),
    ],
)
def test_what_the_model_cannot_do_is_refused_before_it_is_touched(build, fields_: dict, message: str) -> None:
    model = build()
    config = Config(global_quant_config=QLayerConfig(weight=FP8), **fields_)
    with pytest.raises(ValueError, match=message):
        ModelQuantizer(config).quantize_model(
            model, [torch.zeros(1, 4, 8) if isinstance(model, PlainAttention) else {}]
        )
    assert not any(isinstance(m, QuantMixin) for m in model.modules())
