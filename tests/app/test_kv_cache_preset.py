"""``+quant/kv_cache=fp8`` / ``int8``: amd-quark's KV cache added to any preset from the command line; the composed
node makes the Config fields, the layers resolve to the preset's roles plus the k/v outputs, and a run of the
Hugging Face LLaMA exports the k/v scales and config.json as amd-quark does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from app_helpers import compose_cfg
from hydra.utils import instantiate

from quark.torch import ModelQuantizer
from quark_lightning.app.conf import build_quant
from quark_lightning.app.run import run

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

TINY_HF = (
    "experiment=hf_lm",
    "data.train_bytes=20000",
    "data.val_bytes=4000",
    "data.test_bytes=4000",
    "model.config.num_hidden_layers=1",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "trainer=smoke",
    "trainer.accelerator=cpu",
)
K_PROJ = "net.model.layers.0.self_attn.k_proj"


@pytest.mark.parametrize(("kv", "dtype"), [("fp8", "fp8_e4m3"), ("int8", "int8")])
def test_the_kv_cache_group_composes_on_top_of_a_preset(kv: str, dtype: str) -> None:
    cfg = compose_cfg(*TINY_HF, "quant=w8a8", f"+quant/kv_cache={kv}", "quant.kv_cache_post_rope=true")
    flow, config = build_quant(cfg.quant)
    assert flow.name == "w8a8" and config.kv_cache_group == ["*k_proj", "*v_proj"] and config.kv_cache_post_rope
    plans = {p.name: p for p in ModelQuantizer(config).resolve(instantiate(cfg.model))}
    k = plans[K_PROJ]
    assert k.qconfig.output_tensors.dtype.name == dtype and k.source["output_tensors"] == "kv_cache '*k_proj'"
    assert k.qconfig.weight.dtype.name == "int8" and k.source["weight"] == "global"  # the preset's (inherit_roles)
    assert plans["net.model.layers.0.self_attn.q_proj"].qconfig.output_tensors is None


def test_without_the_group_no_kv_field_is_set() -> None:
    _, config = build_quant(compose_cfg("quant=w8a8").quant)
    assert (config.kv_cache_quant_config, config.kv_cache_group, config.softmax_quant_spec) == ({}, [], None)


def test_a_run_exports_the_kv_scales_and_fields_as_amd_quark_does(tmp_path: Path) -> None:
    results = run(compose_cfg(*TINY_HF, "quant=w8a8", "+quant/kv_cache=fp8", "export=[quark]"), tmp_path)
    info = results["export"]["quark"]
    q = json.loads((Path(info["weights"]).parent / "config.json").read_text())["quantization_config"]
    assert q["export"]["kv_cache_group"] == ["*k_proj", "*v_proj"]
    # the app's inherit_roles: each KV layer's resolved config under its name (the preset's int8 weight, the fp8 output)
    k = q["kv_cache_quant_config"]["model.layers.0.self_attn.k_proj"]
    assert sorted(q["kv_cache_quant_config"]) == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert (k["weight"]["dtype"], k["output_tensors"]["dtype"]) == ("int8", "fp8_e4m3")
    assert q["layer_quant_config"]["model.layers.0.self_attn.k_proj"] == k
    with safetensors.safe_open(info["weights"], "pt") as f:
        keys = set(f.keys())
        k, v = (f.get_tensor(f"model.layers.0.self_attn.{p}.output_scale") for p in ("k_proj", "v_proj"))
    assert "model.layers.0.self_attn.q_proj.output_scale" not in keys
    assert float(k) == float(v) > 0  # kv_cache_group: one scale for k and v
