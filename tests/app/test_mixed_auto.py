"""quant=mixed_auto: the preset composes and validates (mistakes named before any training); a run measures the
sensitivity, allocates under quant.target_bits, writes sensitivity.csv, mixed_bits.png and mixed_precision.yaml, and
that YAML, used as a quant preset, reproduces the same per-layer formats and metric."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml
from app_helpers import TINY_LM, compose_cfg, run_train
from hydra.utils import instantiate

from quark.torch import ModelQuantizer
from quark.torch.quantization.config.config import Config
from quark.torch.quantization.config.type import Dtype
from quark_lightning.app.conf import ConfigError, QuantConfigError, build_quant
from quark_lightning.app.mixed import candidate_configs, with_candidate
from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
CNN_LAYERS = {"net.conv1", "net.conv2", "net.fc1", "net.fc2"}
DEFAULT_CANDIDATES = ["int2_per_channel_sym", "int3_per_channel_sym", "int4_per_channel_sym", "int8_per_channel_sym"]
TWO = "quant.candidates=[int2_per_channel_sym,int8_per_channel_sym]"


# ----------------------------------------------------------------------------------------------- composition
def test_mixed_auto_composes_with_sensible_defaults() -> None:
    cfg = compose_cfg("quant=mixed_auto")
    flow, config = build_quant(cfg.quant)
    assert (flow.name, flow.mode, flow.target_bits, flow.sensitivity) == ("mixed_auto", "ptq", 4, "kl")
    assert flow.candidates == DEFAULT_CANDIDATES and flow.sensitivity_batches == 8 and flow.sensitivity_csv is None
    assert config.global_quant_config.weight is None and config.global_quant_config.input_tensors is None  # weight-only
    candidates = candidate_configs(config, flow)
    assert [qc.weight.dtype for qc in candidates.values()] == [Dtype.int2, Dtype.int3, Dtype.int4, Dtype.int8]
    assert all(qc.weight.qscheme.name == "per_channel" and qc.input_tensors is None for qc in candidates.values())
    model = instantiate(cfg.model)
    for qc in candidates.values():  # every candidate fits every layer of the CNN
        quantizer = ModelQuantizer(with_candidate(config, qc))
        assert {p.name for p in quantizer.resolve(model)} == CNN_LAYERS


def test_command_line_sets_the_budget_and_candidates() -> None:
    flow, _ = build_quant(compose_cfg("quant=mixed_auto", "quant.target_bits=3.5", TWO, "quant.sensitivity=mse").quant)
    assert flow.target_bits == 3.5 and flow.candidates == ["int2_per_channel_sym", "int8_per_channel_sym"]
    assert flow.sensitivity == "mse"


def test_target_bits_on_another_preset_keeps_its_activations() -> None:
    """quant=int8_per_channel quant.target_bits=... : mixed weights, the preset's int8 activations on every candidate."""
    flow, config = build_quant(compose_cfg("quant=int8_per_channel", "quant.target_bits=4", TWO).quant)
    for qc in candidate_configs(config, flow).values():
        assert qc.input_tensors is not None and qc.input_tensors.dtype is Dtype.int8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("quant.candidates=[int4_per_chanel_sym]",),
            r"quant.candidates: 'int4_per_chanel_sym' is not a spec preset of conf/quant/spec; allowed: \[.*'int8_per_channel_sym'.*\]; did you mean int4_per_channel_sym\?",
        ),
        (("quant.target_bits=nan",), r"quant.target_bits=nan must be a finite number > 0"),
        (("quant.target_bits=inf",), r"quant.target_bits=inf must be a finite number > 0"),
        (("quant.target_bits=0",), r"quant.target_bits=0 must be a finite number > 0"),
        (("quant.target_bits=-2",), r"quant.target_bits=-2 must be a finite number > 0"),
        (("quant.target_bits=true",), r"quant.target_bits=True must be a finite number > 0"),
        (
            ("quant.target_bits=1.5",),
            r"quant.target_bits=1.5 is below the fewest bits a candidate stores: int2_per_channel_sym, 2 bits",
        ),
        (
            ("quant.target_bits=3", "quant.candidates=[int4_g32,int8_per_channel_sym]"),
            r"quant.target_bits=3 is below .* int4_g32, 4 bits",
        ),
        (("quant.candidates=[]",), r"quant.candidates=\[\] must be a non-empty list of spec presets"),
        (
            ("quant.candidates=null",),
            r"quant.target_bits is set but quant.candidates is null: mixed precision needs both",
        ),
        (("quant.candidates=[int4_per_channel_sym,int4_per_channel_sym]",), r"names a spec twice"),
        (
            ("quant.sensitivity=fisher",),
            r"quant.sensitivity='fisher' is not allowed; allowed: \['kl', 'mse', 'hessian'\]",
        ),
        (("quant.sensitivity_batches=0",), r"quant.sensitivity_batches=0 must be an int >= 1"),
        (("quant.mode=qat",), r"it needs quant.mode=ptq, not 'qat'"),
        (
            ("quant.weight_bits=3",),
            r"quant.weight_bits=3 sets one width for every weight.*leave quant.weight_bits null",
        ),
    ],
)
def test_mistakes_are_named(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(QuantConfigError, match=message):
        build_quant(compose_cfg("quant=mixed_auto", *overrides).quant)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("quant=int8_per_channel", "quant.target_bits=3"), r"quant.target_bits is set but quant.candidates is null"),
        (
            ("quant=w4_gptq", "quant.target_bits=4", TWO),
            r"quant.algo_config and quant.target_bits \(mixed precision\) are both set",
        ),
        (("quant=int8_graph", "quant.target_bits=4", TWO), r"quant.quant_mode must be eager_mode"),
        (
            ("quant=int8_per_channel", "quant.sensitivity_csv=x.csv"),
            r"quant.sensitivity_csv is set but quant.target_bits",
        ),
    ],
)
def test_mixed_keys_on_other_presets(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(QuantConfigError, match=message):
        build_quant(compose_cfg(*overrides).quant)


# ----------------------------------------------------------------------------------------------- before training
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("quant.candidates=[int4_per_chanel_sym]",), r"quant.candidates: 'int4_per_chanel_sym' is not a spec preset"),
        (("quant.target_bits=nan",), r"quant.target_bits=nan must be a finite number > 0"),
        # above int2's 2 element bits, below what int2 per channel stores on the CNN with its scales
        (
            ("quant.target_bits=2.02",),
            r"quant.target_bits=2.02 is below what the cheapest candidates store on DigitsClassifier: 2.0496 .*allowed: >= 2.0496",
        ),
        # groups of 32 inputs do not fit the first conv (9 inputs per channel)
        (
            ("quant.candidates=[int4_g32,int8_per_channel_sym]",),
            r"quant.candidates: int4_g32: layer 'net.conv1' \(Conv2d, weight of shape \(32, 1, 3, 3\)\)",
        ),
        (
            ("quant.sensitivity_csv=/nonexistent/sensitivity.csv",),
            r"quant.sensitivity_csv='/nonexistent/sensitivity.csv': No such file",
        ),
    ],
)
def test_mistakes_stop_before_training(overrides: tuple[str, ...], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg("quant=mixed_auto", *SMOKE, *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()


def test_train_py_names_a_bad_candidate_and_what_is_allowed(tmp_path: Path) -> None:
    proc = run_train(
        "quant=mixed_auto", "quant.candidates=[int4_per_chanel_sym]", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert proc.returncode != 0
    assert (
        "error: quant.candidates: 'int4_per_chanel_sym' is not a spec preset of conf/quant/spec; allowed: ["
        in proc.stderr
    )
    assert "did you mean int4_per_channel_sym?" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------- end to end
def _weights(results: dict) -> dict[str, tuple]:
    return {
        n: (e["weight"]["dtype"], e["weight"]["qscheme"], e["weight"]["from"]) for n, e in results["layers"].items()
    }


def test_mixed_auto_run_writes_its_files_and_the_preset_reproduces_it(tmp_path: Path) -> None:
    """Measure -> allocate -> PTQ with the written preset; then that preset (in a config dir of its own, as
    ``--config-dir`` adds it) and the sensitivity.csv (quant.sensitivity_csv) give the same formats and metric."""
    out = tmp_path / "mixed"
    first = run(compose_cfg("quant=mixed_auto", "quant.target_bits=3", "quant.sensitivity_batches=2", *SMOKE), out)
    mixed = first["mixed_precision"]
    assert set(mixed["choice"]) == CNN_LAYERS and set(mixed["choice"].values()) <= set(DEFAULT_CANDIDATES)
    assert 2.0 < mixed["avg_bits"] <= 3.0 and mixed["target_bits"] == 3.0
    assert first["quant"]["weight_bits"] == mixed["avg_element_bits"] < mixed["avg_bits"]  # element bits: no scales
    assert mixed["uniform"]["int3_per_channel_sym"]["avg_bits"] > 3.0  # int3 everywhere does not fit: scales
    assert json.loads((out / "results.json").read_text())["mixed_precision"]["choice"] == mixed["choice"]
    assert {n: e["weight"]["dtype"] for n, e in first["layers"].items()} == {
        n: c.split("_")[0] for n, c in mixed["choice"].items()
    }  # the quantized model has the chosen formats
    assert first["wall_time_s"]["sensitivity_s"] > 0 and first["metric"]["quantized"] is not None

    rows = list(csv.DictReader((out / "sensitivity.csv").open()))
    assert len(rows) == 4 * 4 and {r["layer"] for r in rows} == CNN_LAYERS
    assert {r["layer"]: r["candidate"] for r in rows if r["chosen"] == "1"} == mixed["choice"]
    assert all(float(r["loss"]) >= 0 for r in rows)
    assert (out / "mixed_bits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "mixed_precision.yaml").read_text()
    assert text.startswith("# Mixed precision chosen by quant=mixed_auto") and "conf/quant/" in text
    preset = yaml.safe_load(text)
    assert preset["name"] == "mixed_precision" and "target_bits" not in preset and "candidates" not in preset
    assert preset["layer_quant_config"]["net"]["fc1"]["weight"]["dtype"] == mixed["choice"]["net.fc1"].split("_")[0]
    assert (
        Config.from_dict(first["quark_config"]) == build_quant(preset)[1]
    )  # the run quantized with the preset's Config

    # reuse 1: the preset as conf/quant/<name>.yaml of an added config dir (what `--config-dir presets` does)
    presets = tmp_path / "presets" / "quant"
    presets.mkdir(parents=True)
    shutil.copy(out / "mixed_precision.yaml", presets / "mix3.yaml")
    ckpt = first["checkpoints"]["float"]
    again = run(
        compose_cfg(f"hydra.searchpath=[file://{tmp_path / 'presets'}]", "quant=mix3", f"ckpt_path={ckpt}", *SMOKE),
        tmp_path / "reuse",
    )
    assert _weights(again) == _weights(first)
    assert again["metric"]["float"] == first["metric"]["float"]
    assert again["metric"]["quantized"] == first["metric"]["quantized"]
    assert again["quark_config"] == first["quark_config"] and "mixed_precision" not in again
    assert not (tmp_path / "reuse" / "sensitivity.csv").exists()

    # reuse 2: allocate again from the measured sensitivity.csv (no measurement): the same choice
    csv_run = run(
        compose_cfg(
            "quant=mixed_auto",
            "quant.target_bits=3",
            f"quant.sensitivity_csv={out / 'sensitivity.csv'}",
            f"ckpt_path={ckpt}",
            *SMOKE,
        ),
        tmp_path / "csv",
    )
    assert csv_run["mixed_precision"]["choice"] == mixed["choice"]
    assert csv_run["metric"]["quantized"] == first["metric"]["quantized"]


@pytest.mark.slow
def test_train_py_reuses_the_preset_with_config_dir(tmp_path: Path) -> None:
    """The documented command lines: a mixed_auto run, then `--config-dir <dir> quant=<name>` on its float checkpoint."""
    proc = run_train(
        "quant=mixed_auto",
        "quant.target_bits=3.5",
        "quant.sensitivity_batches=1",
        *SMOKE,
        f"hydra.run.dir={tmp_path / 'mixed'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "mixed" / "results.json").read_text())
    assert "mixed_auto (ptq, weights" in proc.stdout
    (tmp_path / "presets" / "quant").mkdir(parents=True)
    shutil.copy(tmp_path / "mixed" / "mixed_precision.yaml", tmp_path / "presets" / "quant" / "mine.yaml")
    proc = run_train(
        "--config-dir",
        str(tmp_path / "presets"),
        "quant=mine",
        f"ckpt_path={first['checkpoints']['float']}",
        *SMOKE,
        f"hydra.run.dir={tmp_path / 'reuse'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((tmp_path / "reuse" / "results.json").read_text())
    assert _weights(again) == _weights(first) and again["metric"]["quantized"] == first["metric"]["quantized"]


def test_hessian_sensitivity_on_the_lm(tmp_path: Path) -> None:
    """HAWQ's trace x weight error on the byte LM (decoder Linears and the head), budget met, int8 activations kept."""
    results = run(
        compose_cfg(
            *TINY_LM,
            "quant=int8_per_channel",
            "quant.target_bits=5",
            TWO,
            "quant.sensitivity=hessian",
            "quant.sensitivity_batches=1",
            "data.batch_size=4",
            *SMOKE,
        ),
        tmp_path,
    )
    mixed = results["mixed_precision"]
    assert len(mixed["choice"]) == 8 and mixed["avg_bits"] <= 5.0 and mixed["sensitivity"] == "hessian"
    assert all(e["input_tensors"]["dtype"] == "int8" for e in results["layers"].values())
    assert {e["weight"]["dtype"] for e in results["layers"].values()} == {"int2", "int8"}  # 5 bits: some of each
    assert results["metric"]["name"] == "test_ppl" and results["metric"]["quantized"] > 1.0


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_mixed_auto_measures_in_the_models_dtype(precision: str, tmp_path: Path) -> None:
    """trainer.precision=64-true / bf16-true convert the model: the sensitivity batches follow its dtype."""
    results = run(
        compose_cfg(
            "quant=mixed_auto",
            "quant.target_bits=3",
            "quant.sensitivity_batches=2",
            *SMOKE,
            f"trainer.precision={precision}",
        ),
        tmp_path,
    )
    assert results["mixed_precision"]["avg_bits"] <= 3
