"""Issue 33, messages: ``quant.exclude`` / ``quant.layer_quant_config`` entries that match no layer of the built
model stop the app before anything is trained, with one error naming each entry and the closest layer names (as a
``quant.layer_bits`` typo does); before, the app only warned and quantized the layer the user meant to keep float.
The engine keeps amd-quark's warning."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from app_helpers import TINY_LM, compose_cfg, run_train

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Int8PerTensorSpec, QConfig, QLayerConfig
from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run
from quark_lightning.tasks.lightning_digits import DigitsClassifier

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("quant.exclude=[net.fc9]", r"quant\.exclude: 'net\.fc9' matches no layer; closest: \[.*'net\.fc1'"),
        ("quant.exclude=['*fc9']", r"quant\.exclude: '\*fc9' matches no layer"),
        (
            "+quant.layer_quant_config={net.fc9:{bias:null}}",
            r"quant\.layer_quant_config: 'net\.fc9' matches no layer; closest: \[.*'net\.fc1'",
        ),
    ],
    ids=["exclude", "exclude_pattern", "layer_quant_config"],
)
def test_an_entry_matching_no_layer_stops_the_run_before_training(override: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg(*SMOKE, override), tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "results.json").exists()


def test_matching_entries_still_run(tmp_path: Path) -> None:
    results = run(
        compose_cfg(*SMOKE, "quant.exclude=[net.fc2]", "+quant.layer_quant_config={net:{fc1:{bias:null}}}"), tmp_path
    )
    assert "net.fc2" not in results["layers"] and "net.fc1" in results["layers"]


def test_a_preset_naming_another_models_layers_stops_on_a_language_model(tmp_path: Path) -> None:
    """w4_edges8 names the digits CNN's net.conv1 / net.fc2: on the char LM it would quantize every layer int4."""
    with pytest.raises(
        ConfigError, match=r"quant\.layer_quant_config: 'net\.conv1' matches no layer.*'net\.fc2' matches no layer"
    ):
        run(compose_cfg(*TINY_LM, *SMOKE, "quant=w4_edges8"), tmp_path)


def test_train_py_prints_one_error_line(tmp_path: Path) -> None:
    proc = run_train(*SMOKE, "quant.exclude=[net.fc9]", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "quant.exclude: 'net.fc9' matches no layer" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_engine_keeps_amd_quarks_warning() -> None:
    weight = Int8PerTensorSpec(symmetric=True).to_quantization_spec()
    config = QConfig(global_quant_config=QLayerConfig(weight=weight), exclude=["net.fc9"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = ModelQuantizer(config).resolve(DigitsClassifier())
    assert any(
        "Config.exclude entries match no layer of the model (typo?): ['net.fc9']" in str(w.message) for w in caught
    )
    assert "net.fc2" in {p.name for p in plans}
