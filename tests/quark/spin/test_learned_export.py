"""A learned-rotation model (trainable=True, int4 weights, int4 per-token inputs) exports and reimports into a fresh
float model with the same logits, and reloads from a QuantCallback-style checkpoint."""

import copy
import json

import pytest
import torch
from spin_models import char_batches, char_model, logits, w4a4

from callbacks.quant import load_quantized_checkpoint
from quark.torch import ModelQuantizer
from quark.torch.export.front_end import export_model, import_model
from quark.torch.quantization.config.config import RotationConfig

pytestmark = [pytest.mark.filterwarnings("ignore:.*stay float.*")]
pytest.importorskip("safetensors")
LEARNED = RotationConfig(r1=True, r2=True, r4=True, trainable=True, train_steps=3, train_lr=1.5)


@pytest.fixture(scope="module")
def model():
    return ModelQuantizer(w4a4(LEARNED)).quantize_model(char_model(), char_batches(2))


def test_export_reimports_to_the_same_logits(model, tmp_path):
    x = char_batches(1, seed=4)[0]
    frozen = ModelQuantizer.freeze(copy.deepcopy(model))
    export_model(frozen, tmp_path, ["quark"])
    fresh = import_model(char_model(), tmp_path, "quark")
    assert torch.allclose(logits(fresh, x), logits(frozen, x), rtol=0, atol=1e-6)
    config = json.loads(next(tmp_path.rglob("config.json")).read_text())["quantization_config"]
    rotation = next(a for a in config["algo_config"] if a["name"] == "rotation")
    assert rotation["trainable"] is True and "train_steps" not in rotation  # amd-quark 0.13 refuses fields it lacks


def test_quantized_checkpoint_reloads(model, tmp_path):
    path = tmp_path / "q.ckpt"
    state = dict(model.state_dict())
    torch.save({"state_dict": state, "callbacks": {"QuantCallback": {"config": w4a4(LEARNED).to_dict()}}}, path)
    fresh = load_quantized_checkpoint(char_model(), str(path))
    x = char_batches(1, seed=4)[0]
    assert torch.allclose(logits(fresh, x), logits(model, x), rtol=0, atol=1e-6)
