"""quant=w4a8_qad and quant.distill: composition on the LM experiments, the refusals, and smoke runs whose QAT logs
the distillation loss (char_lm and hf_lm)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from app_helpers import TINY_LM, compose_cfg

from quark.torch.quantization.config.type import Dtype
from quark_lightning.app.conf import QuantConfigError, build_quant
from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
TINY_HF = (
    "experiment=hf_lm",
    "data.train_bytes=20000",
    "data.val_bytes=4000",
    "data.test_bytes=4000",
    "model.config.num_hidden_layers=1",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
)


@pytest.mark.parametrize("experiment", ["char_lm", "hf_lm"])
def test_preset_composes_w4_g32_a8_dynamic_qat_with_kl_distillation(experiment: str) -> None:
    flow, config = build_quant(compose_cfg(f"experiment={experiment}", "quant=w4a8_qad").quant)
    weight, act = config.global_quant_config.weight, config.global_quant_config.input_tensors
    assert flow.mode == "qat" and weight.dtype is Dtype.int4 and weight.group_size == 32 and weight.symmetric
    assert act.dtype is Dtype.int8 and act.is_dynamic and act.qscheme.name == "per_tensor"
    assert flow.distill["loss"] == "kl" and flow.distill["teacher"] == "copy" and flow.distill["weight"] == 0.5
    flow, _ = build_quant(compose_cfg(f"experiment={experiment}", "quant=w4a8_qad", "quant.distill.teacher=self").quant)
    assert flow.distill["teacher"] == "self"


def test_distill_is_null_by_default_and_refused_outside_qat() -> None:
    flow, _ = build_quant(compose_cfg("experiment=char_lm", "quant=w4a8_tqt").quant)
    assert flow.distill is None
    with pytest.raises(QuantConfigError, match="quant.distill is set but quant.mode='ptq'"):
        build_quant(compose_cfg("experiment=char_lm", "quant=w4_rtn", "+quant.distill.loss=kl").quant)


@pytest.mark.parametrize(
    "override,match",
    [
        ("quant.distill.loss=mse", r"quant.distill: Distillation.loss='mse'.*allowed: \['kl', 'jsd'\]"),
        ("quant.distill.weight=2", r"quant.distill: Distillation.weight=2 must be a number in \[0.0, 1.0\]"),
        ("quant.distill.teacher=ema", r"Distillation.teacher='ema'"),
        ("+quant.distill.alpha=1", r"quant.distill: .*unknown field.*alpha"),
    ],
)
def test_bad_distill_values_are_refused_naming_the_key(override: str, match: str) -> None:
    with pytest.raises(QuantConfigError, match=match):
        build_quant(compose_cfg("experiment=char_lm", "quant=w4a8_qad", override).quant)


def _logged(path: Path, key: str) -> list[float]:
    with path.open() as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


@pytest.mark.integration  # trains (float, then QAT with distillation)
@pytest.mark.parametrize("experiment", [TINY_LM, TINY_HF], ids=["char_lm", "hf_lm"])
def test_smoke_run_distils(experiment: tuple[str, ...], tmp_path: Path) -> None:
    results = run(compose_cfg(*experiment, "quant=w4a8_qad", "quant.qat_epochs=1", *SMOKE), tmp_path)
    assert results["quant"]["name"] == "w4a8_qad" and math.isfinite(results["metric"]["quantized"])
    distill = _logged(tmp_path / "logs" / "qat" / "metrics.csv", "distill_loss")
    assert distill and all(math.isfinite(v) and v >= 0 for v in distill)
