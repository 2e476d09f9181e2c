"""Same model, batches and config as the public amd-quark 0.13 ModelQuantizer (references in
bench/amd_quark_reference/, made by make_reference.py): our scales, zero points and outputs.

Min-max observers must agree exactly on weights, and to the last bit the CPU's conv kernels leave on activations. The percentile and MSE observers differ on purpose (see README): their
activation scales are compared to Quark's to show the direction of the difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "amd_quark_reference"))
from load import load_reference  # noqa: E402
from reference_recipes import CONFIGS, SmallCNN  # noqa: E402

ROLE_ATTR = {
    "input": "_input_quantizer",
    "weight": "_weight_quantizer",
    "output": "_output_quantizer",
    "bias": "_bias_quantizer",
}


def _quantize(name: str) -> tuple[nn.Module, dict]:
    ref = load_reference(name)
    model = SmallCNN()
    model.load_state_dict(ref["model_state"])
    ModelQuantizer(Config.from_dict(CONFIGS[name])).quantize_model(model, ref["calib_batches"])
    return model, ref


def _ours(model: nn.Module, layer: str, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    return getattr(model.get_submodule(layer), ROLE_ATTR[role]).calculate_qparams()


@pytest.mark.parametrize("name", ["w8a8", "w8a8_uint8_asym", "w4_per_group", "fp8_e4m3"])
def test_min_max_qparams_and_outputs_equal_amd_quark(name: str) -> None:
    model, ref = _quantize(name)
    for layer, roles in ref["qparams"].items():
        for role, qp in roles.items():
            scale, zp = _ours(model, layer, role)
            if role == "weight":
                assert torch.equal(scale.float(), qp["scale"].float()), (layer, role)
            else:  # activations come through conv kernels whose last bit depends on the CPU's ISA (AVX2 vs AVX-512)
                torch.testing.assert_close(scale.float(), qp["scale"].float(), rtol=4e-7, atol=0), (layer, role)
            if qp["zero_point"] is not None:
                assert torch.equal(zp.to(qp["zero_point"].dtype), qp["zero_point"]), (layer, role)
    with torch.no_grad():
        out = model(ref["eval_batch"])
    torch.testing.assert_close(out, ref["output"], rtol=0, atol=1e-6)  # far below one int8 step of the output


@pytest.mark.parametrize("name", ["a8_percentile", "a8_mse"])
def test_histogram_observers_keep_weights_and_stay_within_the_observed_range(name: str) -> None:
    """Weights still equal Quark's; activation ranges are chosen by our own search (deliberately different),
    so they are checked against the observed range: positive and never wider than min-max's."""
    model, ref = _quantize(name)
    for layer, roles in ref["qparams"].items():
        scale, _ = _ours(model, layer, "weight")
        assert torch.equal(scale.float(), roles["weight"]["scale"].float()), layer
        quantizer = getattr(model.get_submodule(layer), ROLE_ATTR["input"])
        amax = max(-float(quantizer.observer.min_val), float(quantizer.observer.max_val))
        ours, _ = quantizer.calculate_qparams()
        assert 0 < float(ours) <= amax / 127.5 * (1 + 1e-6), (layer, float(ours), amax / 127.5)
