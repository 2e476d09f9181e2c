"""GPTQ after the rotations: it runs, and the Hessian of a down_proj is of its rotated inputs (the online R4 pre-hook
runs before GPTQ's capture): with R4 only (and norms of weight 1), layer 0's down_proj Hessian is R4^T H R4 of the one without rotation."""

import copy

import pytest
import torch
from rot_models import char_batches, char_model, logits

from quark.torch import ModelQuantizer
from quark.torch.algorithm import gptq as gptq_module
from quark.torch.algorithm.rotation import hadamard_matrix
from quark.torch.quantization.config.config import Config, GPTQConfig, RotationConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*layer\\(s\\) with Parameters stay float.*")
W4 = {
    "dtype": "int4",
    "qscheme": "per_channel",
    "ch_axis": 0,
    "symmetric": True,
    "is_dynamic": False,
    "observer_cls": "PerChannelMinMaxObserver",
    "round_method": "half_even",
    "scale_type": "float",
}


ORIGINAL_TAKE = gptq_module.HessianAccumulator.take


def _down_hessians(monkeypatch, algos) -> tuple[list[torch.Tensor], torch.nn.Module]:
    taken: list[torch.Tensor] = []

    def take(self):
        hessian = ORIGINAL_TAKE(self)
        if hessian.shape[0] == 192:  # only down_proj reads 192 features
            taken.append(hessian.clone())
        return hessian

    monkeypatch.setattr(gptq_module.HessianAccumulator, "take", take)
    config = Config.from_dict({"global_quant_config": {"weight": W4}})
    config.algo_config = algos
    model = char_model()
    with torch.no_grad():  # norms of weight 1: fusing them changes no weight, so only R4 differs between the runs
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return taken, ModelQuantizer(config).quantize_model(model, char_batches(3))


def test_gptq_sees_rotated_down_proj_inputs(monkeypatch):
    plain, _ = _down_hessians(monkeypatch, [GPTQConfig(group_size=-1, sym=True)])
    rot, model = _down_hessians(monkeypatch, [RotationConfig(r1=False, r4=True), GPTQConfig(group_size=-1, sym=True)])
    assert len(plain) == len(rot) == 2
    h = hadamard_matrix(192, dtype=torch.float64)
    expected = h.T @ plain[0].double() @ h
    assert torch.allclose(rot[0].double(), expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
    assert not torch.allclose(rot[0], plain[0], atol=1e-3 * float(plain[0].abs().max()))


def test_full_rotation_then_gptq_runs_and_is_close():
    model = char_model()
    config = Config.from_dict({"global_quant_config": {"weight": W4}})
    config.algo_config = [RotationConfig(r1=True, r2=True, r4=True), GPTQConfig(group_size=-1, sym=True)]
    q = ModelQuantizer(config).quantize_model(copy.deepcopy(model), char_batches(3))
    x = char_batches(1, seed=9)[0]
    ref, out = logits(model, x), logits(q, x)
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 0.5  # int4 weights: close, not equal
