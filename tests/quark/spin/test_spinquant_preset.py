"""The w4a4_spinquant preset composes on experiment=char_lm and experiment=hf_lm and builds a RotationConfig with
trainable=True and the preset's steps / step size."""

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).parents[2] / "app"))
from app_helpers import compose_cfg  # noqa: E402

from quark.torch.quantization.config.config import RotationConfig  # noqa: E402


@pytest.mark.parametrize("experiment", ["char_lm", "hf_lm"])
def test_preset_composes(experiment):
    cfg = compose_cfg(f"experiment={experiment}", "quant=w4a4_spinquant")
    algos = OmegaConf.to_container(cfg.quant.algo_config, resolve=True)
    rotation = RotationConfig(**algos[0])
    assert (rotation.trainable, rotation.r1, rotation.r2, rotation.r4) == (True, True, True, True)
    assert (rotation.train_steps, rotation.train_lr) == (100, 1.5)
    assert algos[1]["name"] == "gptq"
    assert (
        cfg.quant.global_quant_config.input_tensors.is_dynamic
        and cfg.quant.global_quant_config.input_tensors.dtype == "int4"
    )
