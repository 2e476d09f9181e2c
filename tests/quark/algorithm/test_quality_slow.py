"""The quality targets of GPTQ / AWQ / SmoothQuant on the byte-level LM (slow: trains the LM for one epoch, ~2 min)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from bench.algorithms import W8A8, add_outlier_channels, perplexity, run_method, weight_spec
from quark_lightning.tasks.char_lm import CharLM, PythonSourceDataModule

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lm() -> tuple[CharLM, list, object]:
    L.seed_everything(0, verbose=False)
    dm = PythonSourceDataModule()
    dm.setup()
    model = CharLM()
    L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
    ).fit(model, datamodule=dm)
    calib = [b for _, b in zip(range(16), dm.train_dataloader(), strict=False)]
    return model.eval(), calib, dm.test_dataloader()


def test_gptq_and_awq_beat_rtn_at_3_bits_and_gptq_closes_half_the_gap(lm: tuple) -> None:
    model, calib, test = lm
    fp32 = perplexity(model, test)
    base = {"global_quant_config": {"weight": weight_spec(3)}}
    rtn = run_method(model, base, calib, test)[0]
    gptq, seconds, _ = run_method(model, {**base, "algo_config": {"name": "gptq"}}, calib, test)
    awq = run_method(model, {**base, "algo_config": {"name": "awq"}}, calib, test)[0]
    assert gptq < rtn and awq < rtn
    assert (rtn - gptq) >= 0.5 * (rtn - fp32)
    assert seconds < 120


def test_at_4_bits_neither_is_worse_than_rtn(lm: tuple) -> None:
    model, calib, test = lm
    base = {"global_quant_config": {"weight": weight_spec(4)}}
    rtn = run_method(model, base, calib, test)[0]
    for algo in ("gptq", "awq"):
        assert run_method(model, {**base, "algo_config": {"name": algo}}, calib, test)[0] <= rtn * 1.001


def test_smoothquant_beats_naive_w8a8_with_outlier_channels(lm: tuple) -> None:
    model, calib, test = lm
    outliers = add_outlier_channels(model)
    with torch.no_grad():
        assert perplexity(outliers, test) == pytest.approx(perplexity(model, test), rel=1e-3)  # the same function
    naive = run_method(outliers, {"global_quant_config": W8A8}, calib, test)[0]
    smooth = run_method(
        outliers,
        {"global_quant_config": W8A8, "pre_quant_opt_config": {"name": "smoothquant", "alpha": 0.5}},
        calib,
        test,
    )[0]
    assert smooth < naive
