"""A rotated, quantized model (rotations + GPTQ, int4 weights, int4 per-token activations) reloads into a fresh float
model of the same architecture, its logits equal: from a QuantCallback-style checkpoint (load_quantized_checkpoint),
from amd-quark's export directory and from the single safetensors file. The fresh model gets the ``input_rotation``
buffers and pre-hooks from the loaders, and a tied lm_head is untied where the file holds different values."""

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from rot_models import char_batches, char_model, hf_batches, hf_llama, logits

from callbacks.quant import load_quantized_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.algorithm.rotation import ROTATION_BUFFER
from quark.torch.export.front_end import export_model, import_model
from quark.torch.quantization.config.config import Config

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*"),
    pytest.mark.filterwarnings("ignore:.*stay float.*"),
]
pytest.importorskip("safetensors")
CONF = Path(__file__).parents[3] / "conf" / "quant" / "spec"
MODELS = {"char": (char_model, char_batches), "hf_tied": (lambda: hf_llama(True), hf_batches)}


def _config() -> Config:
    weight = yaml.safe_load((CONF / "int4_per_channel_sym.yaml").read_text())
    act = yaml.safe_load((CONF / "int4_per_token_dynamic.yaml").read_text())
    return Config.from_dict(
        {
            "global_quant_config": {"weight": weight, "input_tensors": act},
            "algo_config": [{"name": "rotation", "r2": True, "r4": True}, {"name": "gptq", "group_size": -1}],
        }
    )


@pytest.fixture(scope="module", params=list(MODELS))
def quantized(request):
    make, batches = MODELS[request.param]
    model = ModelQuantizer(_config()).quantize_model(make(), batches())
    return request.param, model


def _down(model):
    return dict(model.named_modules())["model.layers.0.mlp.down_proj"]


@pytest.mark.parametrize("fmt", ["quark", "safetensors"])
def test_export_reimports_to_the_same_logits(quantized, fmt, tmp_path):
    kind, model = quantized
    make, batches = MODELS[kind]
    x = batches(1, seed=4)[0]
    model = ModelQuantizer.freeze(copy.deepcopy(model))
    export_model(model, tmp_path, [fmt])
    fresh = import_model(make(), tmp_path, fmt)
    assert torch.equal(getattr(_down(fresh), ROTATION_BUFFER), getattr(_down(model), ROTATION_BUFFER))
    assert torch.allclose(logits(fresh, x), logits(model, x), rtol=0, atol=1e-6)
    if fmt == "quark":
        config = json.loads(next(tmp_path.rglob("config.json")).read_text())["quantization_config"]
        algos = config["algo_config"]
        rotation = next(a for a in algos if a["name"] == "rotation")
        assert rotation["r1"] and rotation["r2"] and rotation["r4"]


def test_quantized_checkpoint_reloads(quantized, tmp_path):
    kind, model = quantized
    make, batches = MODELS[kind]
    state = dict(model.state_dict())
    assert any(k.endswith("." + ROTATION_BUFFER) for k in state)
    path = tmp_path / "q.ckpt"
    torch.save({"state_dict": state, "callbacks": {"QuantCallback": {"config": _config().to_dict()}}}, path)
    fresh = load_quantized_checkpoint(make(), str(path))
    x = batches(1, seed=4)[0]
    assert torch.allclose(logits(fresh, x), logits(model, x), rtol=0, atol=1e-6)


def test_fresh_model_without_hooks_would_differ(quantized):
    """The pre-hook is what makes the reload right: the same weights without it give other logits."""
    kind, model = quantized
    make, batches = MODELS[kind]
    bare = copy.deepcopy(model)
    for module in bare.modules():
        module._forward_pre_hooks.clear()
    x = batches(1, seed=4)[0]
    assert not torch.allclose(logits(bare, x), logits(model, x), atol=1e-3)
