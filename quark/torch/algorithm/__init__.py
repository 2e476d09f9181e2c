"""GPTQ, AWQ, SmoothQuant and rotations (RotationConfig, ``quark.torch.algorithm.rotation``), run by ``ModelQuantizer.calibrate`` / ``quantize_model`` when the Config holds them
(``algo_config``: GPTQConfig / AWQConfig, one or a list in order; ``pre_quant_opt_config``: SmoothQuantConfig).

Order on a prepared model: SmoothQuant and AWQ on the float function (quantizers paused), then calibration, then GPTQ.
"""

from __future__ import annotations

from quark.torch.algorithm.api import (
    apply_gptq,
    apply_pre_quant_and_awq,
    check_embedding_layers,
    run_awq,
    run_gptq,
    run_smoothquant,
)
from quark.torch.algorithm.gptq import HessianAccumulator, gptq_quantize
from quark.torch.algorithm.rotation.apply import check_rotation, run_rotation
from quark.torch.algorithm.structure import (
    MODEL_FAMILIES,
    ModelFamily,
    ScalingGroup,
    derive_scaling_groups,
    find_decoder_layers,
    model_family,
    scaling_groups,
)
from quark.torch.quantization.algo_registry import register_algorithm
from quark.torch.quantization.config.config import AWQConfig, GPTQConfig, RotationConfig, SmoothQuantConfig

__all__ = [
    "apply_gptq",
    "apply_pre_quant_and_awq",
    "gptq_quantize",
    "HessianAccumulator",
    "ScalingGroup",
    "derive_scaling_groups",
    "find_decoder_layers",
    "scaling_groups",
    "MODEL_FAMILIES",
    "ModelFamily",
    "model_family",
]


for _type, _stage, _handler in (
    (SmoothQuantConfig, "before_calibration", run_smoothquant),
    (AWQConfig, "before_calibration", run_awq),
    (GPTQConfig, "after_calibration", run_gptq),
):
    register_algorithm(_type, stage=_stage, handler=_handler, check=check_embedding_layers)
register_algorithm(RotationConfig, stage="before_calibration", handler=run_rotation, check=check_rotation)
