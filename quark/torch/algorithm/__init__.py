"""GPTQ, AWQ and SmoothQuant, run by ``ModelQuantizer.calibrate`` / ``quantize_model`` when the Config holds them
(``algo_config``: GPTQConfig / AWQConfig, one or a list in order; ``pre_quant_opt_config``: SmoothQuantConfig).

Order on a prepared model: SmoothQuant and AWQ on the float function (quantizers paused), then calibration, then GPTQ.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.api import apply_gptq, apply_pre_quant_and_awq
from quark.torch.algorithm.gptq import HessianAccumulator, gptq_quantize
from quark.torch.algorithm.structure import (
    MODEL_FAMILIES,
    ModelFamily,
    ScalingGroup,
    derive_scaling_groups,
    find_decoder_layers,
    model_family,
    scaling_groups,
)
from quark.torch.quantization.api import register_algorithms, run_batch
from quark.torch.quantization.config.config import Config, GPTQConfig, QuantizationSpec
from quark.torch.quantization.hf import is_hf_conv1d, transpose_weight_spec
from quark.torch.quantization.nn.modules import QuantMixin

__all__ = [
    "apply_gptq", "apply_pre_quant_and_awq", "gptq_quantize", "HessianAccumulator", "ScalingGroup",
    "derive_scaling_groups", "find_decoder_layers", "scaling_groups", "MODEL_FAMILIES", "ModelFamily", "model_family",
]  # fmt: skip


class _Runner:
    """The algorithm runner ModelQuantizer calls around calibration."""

    def before_calibration(self, model: nn.Module, config: Config, batches: list[Any], device: torch.device | None) -> None:
        specs = {  # as for the weight seen [out, in] (a Conv1D's quantizer holds the transposed spec)
            n: transpose_weight_spec(m._weight_quantizer.spec) if is_hf_conv1d(m) else m._weight_quantizer.spec
            for n, m in model.named_modules() if isinstance(m, QuantMixin) and m._weight_quantizer is not None
        }  # fmt: skip

        def weight_spec_of(name: str) -> QuantizationSpec | None:
            return specs.get(name)

        apply_pre_quant_and_awq(model, config, batches, lambda m, b: run_batch(m, b, device), weight_spec_of)

    def after_calibration(self, model: nn.Module, config: Config, batches: list[Any], device: torch.device | None) -> None:
        for algo in config.algo_configs:
            if isinstance(algo, GPTQConfig):
                apply_gptq(model, algo, batches, lambda m, b: run_batch(m, b, device))


register_algorithms(_Runner())
