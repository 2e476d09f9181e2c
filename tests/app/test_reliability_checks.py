"""The app finds what it can before training (issue 18, items 5 and 6): activation channel axes against one batch,
the types of its plain keys (ConfigError naming the key; ``train.py`` prints ``error: ...`` without a traceback);
``trainer.precision=64-true`` / ``bf16-true`` quantize and test in the model's dtype; warnings reach train.log once."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from app_helpers import compose_cfg, run_train
from lightning.pytorch import Trainer

from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
PER_CHANNEL_ACT = ("quant/input_tensors=int8_per_channel_sym",)  # activations per channel along ch_axis


class FitReached(Exception):
    """Raised by the patched Trainer.fit: every check before training passed."""


@pytest.fixture
def no_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer.fit raises FitReached: an error raised instead comes from a check that ran before any training."""

    def fit(self: Trainer, *args: object, **kwargs: object) -> None:
        raise FitReached

    monkeypatch.setattr(Trainer, "fit", fit)


# ----------------------------------------------------------------------------------------------- channel axes
def test_activation_ch_axis_out_of_range_stops_before_training(no_fit: None, tmp_path: Path) -> None:
    cfg = compose_cfg(*SMOKE, *PER_CHANNEL_ACT, "quant.global_quant_config.input_tensors.ch_axis=5")
    with pytest.raises(
        ConfigError,
        match=r"layer 'net.conv1' \(Conv2d, input_tensors\): ch_axis=5 \(per_channel\) is out of range for the activation of shape \(64, 1, 8, 8\)",
    ):
        run(cfg, tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_activation_ch_axis_in_range_passes_the_checks(no_fit: None, tmp_path: Path) -> None:
    with pytest.raises(FitReached):  # the dry forward on one batch found nothing wrong: training would start
        run(compose_cfg(*SMOKE, *PER_CHANNEL_ACT, "quant.global_quant_config.input_tensors.ch_axis=1"), tmp_path)


# ----------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_true_precision_ptq_calibrates_and_tests(precision: str, tmp_path: Path) -> None:
    results = run(compose_cfg(*SMOKE, f"trainer.precision={precision}"), tmp_path)
    assert results["config"]["trainer"]["precision"] == precision
    assert math.isfinite(results["metric"]["float"]) and math.isfinite(results["metric"]["quantized"])
    assert results["sqnr_db"]["activation"]  # the report ran its batch in the model's dtype too


# ----------------------------------------------------------------------------------------------- plain keys
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=abc", r"seed='abc' must be an int in 0\.\.4294967295"),
        ("seed=-1", r"seed=-1 must be an int"),
        (
            "trainer.max_epochs=abc",
            r"trainer\.max_epochs='abc' must be an int or null \(Trainer argument 'max_epochs'\)",
        ),
        ("trainer.precision=fp64", r"trainer\.precision='fp64' must be one of \[.*'64-true'.*\]"),
        ("+trainer.max_epoch=3", r"unknown key trainer\.max_epoch: .* did you mean trainer\.max_epochs\?"),
        ("data.batch_size=abc", r"data\.batch_size='abc' must be an int \(DigitsDataModule argument 'batch_size'\)"),
        ("export=onnx", r"export='onnx' must be a list of format names"),
    ],
)
def test_plain_key_of_the_wrong_type_is_a_config_error(
    override: str, message: str, no_fit: None, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg(*SMOKE, override), tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("seed=abc", "error: seed='abc' must be an int"),
        ("trainer.max_epochs=abc", "error: trainer.max_epochs='abc' must be an int or null"),
    ],
)
def test_train_py_prints_the_key_without_a_traceback(override: str, message: str, tmp_path: Path) -> None:
    proc = run_train(override, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------- warnings
def test_warnings_reach_train_log_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_train(*SMOKE, "+quant.layer_type_quant_config={Embedding:{}}", f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "train.log").read_text()
    unused = (
        "UserWarning: Config.layer_type_quant_config entries name layer types the model does not have, so they configure "
        "nothing: ['Embedding']; the model's quantizable layer types: ['Conv2d', 'Linear']"
    )
    assert log.count(unused) == 1  # the app's checks and the callback both resolve: once
    assert "configure nothing" not in proc.stderr  # through logging, not printed by warnings as well
    assert (proc.stdout + proc.stderr).count("configure nothing") == 1  # Hydra's console handler, once
    # (exclude / layer_quant_config names matching no layer stop the app: tests/app/test_unmatched_names.py)
