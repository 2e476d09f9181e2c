"""hparams_search=optuna_bits: quant.layer_bits (per-layer widths/formats, checked against the model), the search
config, the objectives, the uniform-first sampler, the Pareto front, and a tiny search end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import optuna
import pytest
from app_helpers import compose_cfg, run_train
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from quark.torch import ModelQuantizer
from quark_lightning.app.conf import CONF_DIR, ConfigError, QuantConfigError, build_quant
from quark_lightning.app.layer_bits import apply_layer_bits, assign
from quark_lightning.app.pareto import collect, dominates, pareto_mask, write_pareto
from quark_lightning.app.run import run
from quark_lightning.app.sampler import UniformFirstSampler
from quark_lightning.app.search import check_search_args, directions, objective_values, register_search

register_search()
SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
CNN_LAYERS = ["net.conv1", "net.conv2", "net.fc1", "net.fc2"]


def _hydra_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _weights(config, model) -> dict[str, tuple[str, str | None]]:
    return {
        p.name: (
            p.qconfig.weight.dtype.name,
            p.qconfig.weight.mx_element_dtype.name if p.qconfig.weight.mx_element_dtype else None,
        )
        for p in ModelQuantizer(config).resolve(model, warn=False)
    }


# ----------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    ("overrides", "mode", "keys"),
    [
        (["hparams_search=optuna_bits"], "maximize", ["conv1", "conv2", "fc1", "fc2"]),
        (
            ["experiment=char_lm", "hparams_search=optuna_bits_lm"],
            "minimize",
            ["self_attn", "gate_proj", "up_proj", "down_proj", "lm_head"],
        ),
    ],
)
def test_search_config_composes(overrides: list[str], mode: str, keys: list[str]) -> None:
    cfg = _hydra_cfg(*overrides, "hparams_search.n_trials=7")
    sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    assert sweeper["_target_"].endswith("OptunaSweeper") and str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert (
        sweeper["n_trials"] == 7 and sweeper["direction"] == [mode, "minimize"] and sweeper["max_failure_rate"] == 1.0
    )
    assert list(sweeper["params"]) == [f"++quant.layer_bits.{k}" for k in keys]
    assert sweeper["sampler"]["_target_"] == "quark_lightning.app.sampler.UniformFirstSampler" and sweeper["sampler"][
        "widths"
    ] == [2, 3, 4, 8]
    assert cfg.hydra.callbacks.sweep_summary._target_ == "quark_lightning.app.pareto.ParetoFront"
    sampler = instantiate(cfg.hydra.sweeper.sampler)
    assert isinstance(sampler, UniformFirstSampler) and isinstance(sampler.base, optuna.samplers.TPESampler)
    assert compose_cfg().quant.layer_bits == {} and "hparams_search" not in compose_cfg()  # off by default


def test_search_needs_the_plugin_message(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_search_args(["hparams_search=optuna_bits"]) is None  # installed (the search extra)
    monkeypatch.setattr("quark_lightning.app.search.sweeper_installed", lambda: False)
    message = check_search_args(["quant=none", "hparams_search=optuna_bits"])
    assert (
        message
        == 'hparams_search=optuna_bits needs Hydra\'s Optuna sweeper: pip install -e ".[search]" (hydra-optuna-sweeper, optuna 2.x)'
    )
    assert check_search_args(["quant=none"]) is None


def test_objectives_and_directions() -> None:
    results = {"metric": {"quantized": 97.5, "float": 98.0}, "size": {"quantized_bits": 4096}}
    assert objective_values(results, ["metric", "model_bits"]) == [97.5, 4096.0]
    assert objective_values({**results, "metric": {"quantized": None, "float": 98.0}}, ["metric"]) == [98.0]
    with pytest.raises(ValueError, match="objective metric is nan"):
        objective_values({**results, "metric": {"quantized": math.nan, "float": 98.0}}, ["metric"])
    with pytest.raises(ValueError, match="'latency' is not known"):
        objective_values(results, ["latency"])
    assert directions(["metric", "model_bits"], "max") == ["maximize", "minimize"]
    assert directions(["metric", "model_bits"], "min") == ["minimize", "minimize"]


# ----------------------------------------------------------------------------------------------- quant.layer_bits
def test_layer_bits_values_are_checked_before_the_model() -> None:
    flow, _ = build_quant(compose_cfg("+quant.layer_bits.net.fc1=3", "+quant.layer_bits.conv2=mxfp4").quant)
    assert flow.layer_bits == {"net.fc1": 3, "conv2": "mxfp4"}  # Hydra's nesting of dotted keys is undone
    with pytest.raises(
        QuantConfigError, match=r"quant.layer_bits.fc1=1 must be an int in 2..16 .* or a weight spec of conf/quant/spec"
    ):
        build_quant(compose_cfg("+quant.layer_bits.fc1=1").quant)
    with pytest.raises(QuantConfigError, match=r"quant.layer_bits.fc1='int5' must be"):
        build_quant(compose_cfg("+quant.layer_bits.fc1=int5").quant)
    with pytest.raises(QuantConfigError, match="quant.mode='none' quantizes nothing"):
        build_quant(compose_cfg("quant=none", "+quant.layer_bits.fc1=4").quant)


def test_layer_bits_sets_each_matched_layer() -> None:
    cfg = compose_cfg("quant=int8_per_channel")
    model = instantiate(cfg.model)
    _, config = build_quant(cfg.quant)
    updated = apply_layer_bits(config, model, {"net": 6, "fc1": 3, "fc2": "mxfp4", "*conv2": 4})
    assert _weights(updated, model) == {
        "net.conv1": ("int6", None),
        "net.conv2": ("int4", None),
        "net.fc1": ("int3", None),
        "net.fc2": ("mx", "fp4"),
    }
    plan = {p.name: p for p in ModelQuantizer(updated).resolve(model, warn=False)}["net.fc1"]
    assert (
        plan.qconfig.input_tensors.dtype.name == "int8" and plan.qconfig.weight.qscheme.name == "per_channel"
    )  # the rest is the preset's
    _, mx = build_quant(compose_cfg("quant=mxfp8").quant)  # a width keeps the family: MX fp8 elements -> fp6 / fp4
    assert _weights(apply_layer_bits(mx, model, {"fc1": 6, "fc2": 4}), model)["net.fc1"] == ("mx", "fp6_e2m3")


def test_layer_bits_errors_name_the_key() -> None:
    assert assign({"fc1": 3, "net": 8}, CNN_LAYERS)["net.fc1"] == ("fc1", 3)  # the narrower key wins
    with pytest.raises(
        QuantConfigError,
        match=r"quant.layer_bits.fc3: matches no quantized layer; .*\['net.conv1', 'net.conv2', 'net.fc1', 'net.fc2'\]",
    ):
        assign({"fc3": 4}, CNN_LAYERS)
    lm = ["m.layers.0.mlp.up_proj", "m.layers.0.attn.q_proj", "m.layers.1.mlp.up_proj"]
    with pytest.raises(
        QuantConfigError,
        match=r"quant.layer_bits.mlp=4, quant.layer_bits.layers.0=8 all set layer m.layers.0.mlp.up_proj",
    ):
        assign({"mlp": 4, "layers.0": 8}, lm)
    assert assign({"mlp": 4, "layers.0": 4}, lm)["m.layers.0.mlp.up_proj"][1] == 4  # agreeing keys are fine
    assert assign({"mlp": 4, "layers.0.mlp": 8}, lm)["m.layers.0.mlp.up_proj"] == ("layers.0.mlp", 8)
    cfg = compose_cfg("quant=bf16")
    model = instantiate(cfg.model)
    _, config = build_quant(cfg.quant)
    with pytest.raises(
        QuantConfigError, match=r"quant.layer_bits.conv1=3 on layer net.conv1: dtype \w+ has a fixed width"
    ):
        apply_layer_bits(config, model, {"conv1": 3})


def test_layer_bits_typo_stops_the_run_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"quant.layer_bits.fc3: matches no quantized layer"):
        run(compose_cfg("+quant.layer_bits.fc3=4", *SMOKE), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


# ----------------------------------------------------------------------------------------------- sampler and front
def test_uniform_first_sampler() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = UniformFirstSampler(widths=[2, 8], base=optuna.samplers.RandomSampler(seed=0))
    study = optuna.create_study(directions=["maximize", "minimize"], sampler=sampler)
    seen = []
    for _ in range(6):
        trial = study.ask()
        a = trial.suggest_categorical("++quant.layer_bits.a", [2, 3, 4, 8, "mxfp4"])
        b = trial.suggest_categorical("++quant.layer_bits.b", [2, 4, 8])
        trial.suggest_categorical("seed", [0, 1])  # not a layer_bits parameter: the base sampler's
        seen.append((a, b))
        study.tell(trial, [1.0, 2.0])
    assert seen[:2] == [(2, 2), (8, 8)]
    assert len(set(seen)) == len(seen)  # distinct: no configuration twice


def test_uniform_first_sampler_draws_distinct_configurations() -> None:
    """TPE picks the best of its candidates and so repeats itself in a small discrete space; distinct=True redraws."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    counts = {}
    for distinct in (False, True):
        base = optuna.samplers.TPESampler(seed=0, n_startup_trials=4)
        study = optuna.create_study(
            directions=["minimize", "minimize"], sampler=UniformFirstSampler([2, 3], base, seed=0, distinct=distinct)
        )
        seen = []
        for _ in range(12):  # the space has 12 configurations
            trial = study.ask()
            a = trial.suggest_categorical("++quant.layer_bits.a", [2, 3, 4, 5])
            b = trial.suggest_categorical("++quant.layer_bits.b", [2, 3, 4])
            seen.append((a, b))
            study.tell(trial, [a + b, -a * b])
        counts[distinct] = len(set(seen))
    assert counts[True] == 12 and counts[False] < 12
    bad = optuna.create_study(directions=["maximize", "minimize"], sampler=UniformFirstSampler(widths=[3]))
    with pytest.raises(ValueError, match=r"width 3 is not a value of the search parameter \+\+quant.layer_bits.b"):
        bad.ask().suggest_categorical("++quant.layer_bits.b", [2, 4, 8])


def test_pareto_front_of_a_hand_made_table() -> None:
    up, down = ["maximize", "minimize"], ["minimize", "minimize"]
    assert dominates((90, 100), (80, 100), up) and not dominates((90, 100), (90, 100), up)
    points = [
        (90.0, 100.0),
        (95.0, 200.0),
        (89.0, 150.0),
        (95.0, 200.0),
        (99.0, 400.0),
        None,
        (math.nan, 50.0),
        (80.0, 100.0),
    ]
    # (89, 150) is beaten by (90, 100); the tie (95, 200) stays twice; (80, 100) loses to (90, 100) at equal size
    assert pareto_mask(points, up) == [True, True, False, True, True, False, False, False]
    # perplexity: lower is better; now (80, 100) leads and (90, 100) falls behind it
    assert pareto_mask(points, down) == [False, False, False, False, False, False, False, True]
    assert pareto_mask([(1.0, 1.0)], up) == [True] and pareto_mask([], up) == []


def test_pareto_table_from_job_folders(tmp_path: Path) -> None:
    def job(
        n: int, value: float | None, bits: int, dtype: str, status: str = "COMPLETED", error: str | None = None
    ) -> None:
        folder = tmp_path / str(n)
        folder.mkdir()
        record = {"job": n, "overrides": [f"++quant.layer_bits.fc1={bits // 100}", "trainer=smoke"], "status": status}
        (folder / "trial.json").write_text(json.dumps({**record, **({"error": error} if error else {})}))
        if value is None:
            return
        layers = {n: {"weight": {"dtype": dtype, "bits": float(dtype[3:]), "group_size": None}} for n in ("a", "b")}
        results = {
            "metric": {"name": "test_ppl", "mode": "min", "float": 5.0, "quantized": value},
            "size": {"quantized_bits": bits, "fp32_bits": 3200, "compression": 3200 / bits},
            "layers": layers,
        }
        (folder / "results.json").write_text(json.dumps(results))

    job(0, 7.0, 200, "int2")
    job(1, 5.5, 400, "int4")
    job(2, 6.0, 500, "int4")  # dominated by job 1
    job(3, None, 300, "int3", status="FAILED", error="QuantConfigError: quant.layer_bits.fc1=1 must be ...")
    job(10, 5.1, 800, "int8")
    rows = collect(tmp_path)
    assert [r["trial"] for r in rows] == [0, 1, 2, 3, 10]  # job order, not text order
    assert [r["pareto"] for r in rows] == [True, True, False, False, True]
    assert rows[3]["status"] == "failed" and "fc1=1" in rows[3]["error"] and rows[0]["uniform"] == "int2"
    csv_path, png_path = write_pareto(rows, tmp_path)
    table = list(csv.DictReader(csv_path.open()))
    assert [t["status"] for t in table] == ["ok", "ok", "ok", "failed", "ok"] and table[1]["bits_per_param"] == "4.0"
    assert "layer_bits.fc1" in table[0] and "trainer" not in table[0]  # searched parameters only
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------- end to end
def test_tiny_search_writes_pareto_with_a_failed_trial(tmp_path: Path) -> None:
    """Three trials through train.py and Hydra's Optuna sweeper; the first sets fc2 to 1 bit (not allowed): it is
    recorded as failed and the sweep goes on."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        "hparams_search=optuna_bits",
        "hparams_search.n_trials=3",
        "hparams_search.uniform=[1,4]",
        "hydra.sweeper.params=null",
        "++quant.layer_bits.fc2=choice(1,4)",
        *SMOKE,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = list(csv.DictReader((sweep / "pareto.csv").open()))
    assert [t["trial"] for t in table] == ["0", "1", "2"]
    assert table[0]["status"] == "failed" and "quant.layer_bits.fc2=1 must be an int in 2..16" in table[0]["error"]
    assert table[1]["status"] == "ok" and table[1]["layer_bits.fc2"] == "4" and float(table[1]["model_bits"]) > 0
    assert any(t["pareto"] == "True" for t in table)
    assert (sweep / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((sweep / "0" / "trial.json").read_text())["status"] == "FAILED"
    assert "pareto:" in proc.stdout
