"""train.py end to end: every preset runs and reports; ckpt_path skips training; a sweep writes its summary; mistakes
stop the run before any training, with a message that names the key."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from app_helpers import DECODER_ONLY, PRESETS, ROTATED, TINY_LM, compose_cfg, run_train

from quark.torch.quantization.config.config import Config
from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "preset", [p for p in PRESETS if p not in DECODER_ONLY + ROTATED and not p.endswith("_graph")]
)  # graph presets: test_graph_presets_run
def test_every_preset_runs_and_writes_results(preset: str, tmp_path: Path) -> None:
    results = run(compose_cfg(f"quant={preset}", *SMOKE), tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["metric"] == results["metric"]
    m, q, size = on_disk["metric"], on_disk["quant"], on_disk["size"]
    assert m["name"] == "test_acc" and 0.0 <= m["float"] <= 100.0
    assert on_disk["config"]["quant"]["name"] == preset == q["name"]
    assert on_disk["wall_time_s"]["total_s"] >= on_disk["wall_time_s"]["fit_s"] > 0
    assert (tmp_path / "logs" / "fp32" / "metrics.csv").exists()
    if preset == "none":
        assert m["quantized"] is None and on_disk["quark_config"] is None and on_disk["sqnr_db"] is None
        assert size["quantized_bits"] == size["fp32_bits"]
        return
    assert 0.0 <= m["quantized"] <= 100.0 and m["delta"] == pytest.approx(m["quantized"] - m["float"])
    Config.from_dict(on_disk["quark_config"])  # the resolved quark config round-trips
    layers = on_disk["layers"]
    assert set(layers) == {"net.conv1", "net.conv2", "net.fc1", "net.fc2"}
    assert set(on_disk["sqnr_db"]["weight"]) == set(layers)
    assert all(v > 5.0 for v in on_disk["sqnr_db"]["weight"].values())  # quantized weights resemble the float ones
    # the size follows the weight bits of each layer (4 KiB of biases and such stay float)
    assert size["quantized_bits"] < size["fp32_bits"]
    assert size["quantized_bytes"] == -(-size["quantized_bits"] // 8)
    assert size["compression"] == pytest.approx(size["fp32_bits"] / size["quantized_bits"])
    assert Path(on_disk["checkpoints"]["quantized"]).exists()
    assert (tmp_path / "logs" / q["mode"] / "metrics.csv").exists()


def test_size_matches_bits_per_weight(tmp_path: Path) -> None:
    """int8 everywhere: each weight costs 8 bits, everything else (biases) 32; the report must say exactly that."""
    results = run(compose_cfg("quant=int8_per_tensor", *SMOKE), tmp_path)
    import torch

    from quark_lightning.tasks.lightning_digits import DigitsClassifier

    model = DigitsClassifier()
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear))
    others = sum(p.numel() for p in model.parameters()) - weights
    assert results["size"]["quantized_bits"] == 8 * weights + 32 * others
    assert results["size"]["fp32_bits"] == 32 * (weights + others)


def test_qat_run_learns_thresholds_and_reports(tmp_path: Path) -> None:
    overrides = ("quant.qat_epochs=2", "quant.weight_bits=3", "quant.quantizer_lr=0.02")
    results = run(compose_cfg("quant=w4a8_tqt", *SMOKE, *overrides), tmp_path)
    assert results["quant"]["weight_bits"] == 3.0 and results["quant"]["weight_bits_knob"] == 3
    groups = torch.load(tmp_path / "checkpoints" / "quantized.ckpt", weights_only=True)["optimizer_states"][0][
        "param_groups"
    ]
    assert len(groups) == 2 and groups[1]["lr"] == 0.02 and len(groups[1]["params"]) == 8  # 4 layers: weight + input
    assert results["layers"]["net.fc1"]["weight"]["dtype"] == "int3"
    assert results["wall_time_s"]["quantize_s"] > 0
    logged = (tmp_path / "logs" / "qat" / "metrics.csv").read_text()
    assert "train_loss" in logged  # QAT trained


def test_ckpt_path_skips_training_and_leaves_the_checkpoint_untouched(tmp_path: Path) -> None:
    first = run(compose_cfg("quant=none", *SMOKE), tmp_path / "first")
    ckpt = Path(first["checkpoints"]["float"])
    assert ckpt.exists()
    digest = _sha(ckpt)
    second = run(compose_cfg("quant=int8_per_channel", *SMOKE, f"ckpt_path={ckpt}"), tmp_path / "second")
    assert "fit_s" not in second["wall_time_s"]
    assert second["metric"]["float"] == first["metric"]["float"]  # the same weights, not a new training
    assert second["float_metrics"]["test_loss"] == pytest.approx(first["float_metrics"]["test_loss"], rel=1e-6)
    assert second["checkpoints"]["float"] == str(ckpt)
    assert _sha(ckpt) == digest
    assert not list((tmp_path / "second" / "checkpoints").glob("float-*.ckpt"))


def test_bad_ckpt_path_stops_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ckpt_path='/no/such.ckpt' does not exist"):
        run(compose_cfg(*SMOKE, "ckpt_path=/no/such.ckpt"), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (
            ("quant/weight=int4_g32",),
            ConfigError,
            r"layer 'net.conv1' \(Conv2d, weight of shape \(32, 1, 3, 3\)\): group_size=32",
        ),
        (
            ("quant.exclude=[net.*]",),
            ConfigError,
            r"matches no layer of DigitsClassifier; its layers: \['net \(DigitsCNN\)'",
        ),
        (
            ("metric.name=test_ppl",),
            ConfigError,
            r"metric.name='test_ppl' is not logged by DigitsClassifier; it logs \[",
        ),
        (("quant.global_quant_config.weight.dtype=int33",), ConfigError, r"'int33' is not a valid Dtype; allowed"),
    ],
)
def test_mistakes_stop_before_any_training(
    overrides: tuple[str, ...], error: type, message: str, tmp_path: Path
) -> None:
    with pytest.raises(error, match=message):
        run(compose_cfg(*SMOKE, *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()


def test_fashion_mnist_missing_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"data \(quark_lightning.tasks.fashion.FashionDataModule\): Fashion-MNIST: .* apt-get install -y dataset-fashion-mnist",
    ):
        run(compose_cfg("data=fashion_mnist", f"+data.root={tmp_path}", *SMOKE), tmp_path)


# ----------------------------------------------------------------------------------------------- the entry point
def test_train_py_default_run(tmp_path: Path) -> None:
    proc = run_train(*SMOKE, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["quant"]["name"] == "int8_per_channel" and results["metric"]["quantized"] is not None
    assert "int8_per_channel (ptq, weights 8 bits, activations 8 bits)" in proc.stdout
    assert (tmp_path / "run" / "train.log").exists()
    assert not (tmp_path / "outputs").exists()  # hydra.run.dir honoured


def test_train_py_typo_in_a_key_names_it_and_what_is_allowed(tmp_path: Path) -> None:
    proc = run_train("quant.global_quant_config.weight.dtyp=int4", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "unknown key quant.global_quant_config.weight.dtyp (QuantizationSpec)" in proc.stderr
    assert "did you mean quant.global_quant_config.weight.dtype?" in proc.stderr and "'observer_cls'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_train_py_bad_value_names_it_and_what_is_allowed(tmp_path: Path) -> None:
    proc = run_train("quant.global_quant_config.weight.dtype=int33", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert (
        "error: quant: Config.global_quant_config: QuantizationConfig.weight: QuantizationSpec.dtype='int33' is not a valid Dtype; allowed: ['int2'"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sweep_writes_summary_csv_and_png(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m", "quant=int8_per_channel", "quant.weight_bits=4,8", *SMOKE, f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("job,task,scheme,mode,weight_bits")
    assert len(rows) == 3 and {r.split(",")[4] for r in rows[1:]} == {"4.0", "8.0"}
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep summary:" in proc.stdout


def test_a_sweep_value_that_fails_leaves_the_summary_of_the_jobs_that_finished(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m", "quant=int8_per_channel", "quant.weight_bits=4,1", *SMOKE, f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert proc.returncode != 0 and "quant.weight_bits=1 must be null or an int in 2..16" in proc.stderr
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[4] == "4.0"  # the job before the bad value, summarised


def test_char_lm_experiment_runs_and_reports_perplexity(tmp_path: Path) -> None:
    tiny = ("data.train_bytes=20000", "data.val_bytes=4000", "data.test_bytes=4000", "model.n_layers=1")
    results = run(compose_cfg("experiment=char_lm", "quant=int4_per_group", *SMOKE, *tiny), tmp_path)
    m = results["metric"]
    assert (m["name"], m["mode"]) == ("test_ppl", "min")
    assert 1.0 < m["float"] < 300.0 and 1.0 < m["quantized"] < 300.0
    assert results["float_metrics"]["test_ppl"] == pytest.approx(
        2.718281828 ** results["float_metrics"]["test_loss"], rel=1e-5
    )
    q_proj = results["layers"]["net.model.layers.0.self_attn.q_proj"]["weight"]
    assert (q_proj["dtype"], q_proj["group_size"], q_proj["bits"]) == ("int4", 32, 4.0)
    assert results["quant"]["act_bits"] == 32.0 and results["sqnr_db"]["activation"] == {}


@pytest.mark.parametrize("preset", ["w3_rtn", "w3_gptq", "w3_awq", "w8a8", "w8a8_smoothquant"])
def test_algorithm_presets_run_on_the_lm(preset: str, tmp_path: Path) -> None:
    results = run(compose_cfg(*TINY_LM, f"quant={preset}", *SMOKE), tmp_path)
    config = results["quark_config"]
    assert results["metric"]["quantized"] > 1.0
    weight = results["layers"]["net.model.layers.0.mlp.down_proj"]["weight"]
    if preset.startswith("w3"):
        assert (weight["dtype"], weight["group_size"]) == ("uint3", 32)
        assert (config["algo_config"] or {}).get("name") == {"w3_rtn": None, "w3_gptq": "gptq", "w3_awq": "awq"}[preset]
    else:
        assert weight["dtype"] == "int8" and results["quant"]["act_bits"] == 8.0
        assert (config["pre_quant_opt_config"] or {}).get("name") == (
            "smoothquant" if preset.endswith("smoothquant") else None
        )


@pytest.mark.parametrize("preset", DECODER_ONLY)
def test_decoder_only_algorithms_on_the_cnn_stop_before_training(preset: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs a decoder stack and DigitsClassifier has none"):
        run(compose_cfg(f"quant={preset}", *SMOKE), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("preset", ROTATED)
def test_rotation_presets_on_the_cnn_stop_before_training(preset: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rotation: DigitsClassifier has no decoder stack.*supported families"):
        run(compose_cfg(f"quant={preset}", *SMOKE), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


def test_export_switch_writes_files_and_records_sizes(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("onnx")
    from quark.torch.export import import_model_from_safetensors
    from quark_lightning.tasks.lightning_digits import DigitsClassifier

    results = run(compose_cfg(*SMOKE, "export=[safetensors,onnx]"), tmp_path)
    for fmt in ("safetensors", "onnx"):
        info = results["export"][fmt]
        assert Path(info["path"]).stat().st_size == info["file_bytes"]
        assert info["ratio"] < 0.3 and 8.0 < info["bits_per_parameter"] < 9.5  # int8 weights, float biases, scales
    restored = import_model_from_safetensors(DigitsClassifier(), tmp_path / "export")
    assert sum(p.numel() for p in restored.parameters()) > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("export=[tflite]",), r"export=\['tflite'\] is not known; allowed: \['safetensors', 'onnx', 'quark'\]"),
        (
            ("quant=mxfp4", "export=[onnx]"),
            r"layer 'net.conv1' \(input_tensors\): ONNX QDQ export supports static int8/uint8",
        ),
        (("quant=none", "export=[safetensors]"), "export needs a quantized run"),
    ],
)
def test_export_mistakes_stop_before_training(overrides: tuple[str, ...], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        run(compose_cfg(*SMOKE, *overrides), tmp_path)
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("preset", [p for p in PRESETS if p.endswith("_graph")])
def test_graph_presets_run(preset: str, tmp_path: Path) -> None:
    """The graph-mode presets train, quantize the captured network and report (the layer table is the callback's)."""
    results = run(compose_cfg(f"quant={preset}", *SMOKE), tmp_path)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["quark_config"]["quant_mode"] == "fx_graph_mode"
    assert 0.0 <= results["metric"]["quantized"] <= 100.0
    assert on_disk["size"]["quantized_bits"] < on_disk["size"]["fp32_bits"]


def test_float_test_cache_tests_once_per_key_and_survives_a_broken_file(tmp_path: Path) -> None:
    """The cache is a file of the sweep (recorded in sweep_state.json): read back while as recorded; one changed since
    (broken, or not numbers) is tested again and never written over."""
    from quark_lightning.app.run import float_test
    from quark_lightning.app.rundir import SWEEP_STATE, write_recorded

    calls: list[int] = []

    def test() -> dict[str, float]:
        calls.append(1)
        return {"test_acc": 0.5 + len(calls)}

    cache = tmp_path / "float_test_cache.json"
    (tmp_path / SWEEP_STATE).write_text('{"state": "running", "written": []}')  # as a sweep's claim leaves it
    assert float_test(None, "k", test) == {"test_acc": 1.5}  # no cache: always tested
    assert float_test(cache, "k", test) == {"test_acc": 2.5}
    assert float_test(cache, "k", test) == {"test_acc": 2.5} and len(calls) == 2  # read back
    assert float_test(cache, "other", test) == {"test_acc": 3.5}  # another model or data: tested
    assert json.loads(cache.read_text()) == {"k": {"test_acc": 2.5}, "other": {"test_acc": 3.5}}
    cache.write_text('{"k": {"test_acc": 9.5}}')
    assert float_test(cache, "k", test) == {"test_acc": 4.5}  # changed since recorded: not the sweep's, tested
    assert cache.read_text() == '{"k": {"test_acc": 9.5}}'  # and not written over
    cache.unlink()
    write_recorded(tmp_path, cache.name, "{not json", SWEEP_STATE)  # a broken cache of the sweep's
    assert float_test(cache, "k", test) == {"test_acc": 5.5}  # unreadable: tested again, and rewritten
    assert json.loads(cache.read_text()) == {"k": {"test_acc": 5.5}}
    write_recorded(tmp_path, cache.name, '{"k": {"test_acc": "n/a"}}', SWEEP_STATE)
    assert float_test(cache, "k", test) == {"test_acc": 6.5}  # not a number: tested again
    state = torch.get_rng_state()
    float_test(cache, "new", lambda: {"test_acc": float(torch.rand(()))})
    assert torch.equal(torch.get_rng_state(), state)  # a test that fills the cache leaves the RNG as a hit does


def test_a_sweep_from_one_float_checkpoint_tests_the_float_model_once(tmp_path: Path) -> None:
    first = run(compose_cfg("quant=none", *SMOKE), tmp_path / "first")
    ckpt = first["checkpoints"]["float"]
    sweep = tmp_path / "sweep"
    # bf16-true and mixed precision: the later jobs' model must be in the dtype the float test would have left it in
    proc = run_train(
        "-m",
        "quant=mixed_auto",
        "quant.target_bits=4,6",
        "quant.sensitivity_batches=1",
        "trainer.precision=bf16-true",
        *SMOKE,
        f"ckpt_path={ckpt}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cache = json.loads((sweep / "float_test_cache.json").read_text())
    assert len(cache) == 1
    jobs = [json.loads((sweep / str(i) / "results.json").read_text()) for i in (0, 1)]
    assert jobs[0]["float_metrics"] == jobs[1]["float_metrics"] == next(iter(cache.values()))
    assert jobs[0]["float_metrics"]["test_loss"] == pytest.approx(first["float_metrics"]["test_loss"], rel=2e-2)  # bf16
    assert "float test metrics read from" in (sweep / "1" / "train.log").read_text()
    assert jobs[0]["quant"]["weight_bits"] <= 4.0 < jobs[1]["quant"]["weight_bits"] <= 6.0


def test_a_new_sweep_in_the_same_directory_tests_the_float_model_again(tmp_path: Path) -> None:
    """The previous sweep's recorded cache goes when a new sweep claims the directory (one of the user's stops it:
    tests/app/test_sweepdir_ownership.py)."""
    from omegaconf import OmegaConf

    from quark_lightning.app.rundir import SWEEP_STATE, write_recorded
    from quark_lightning.app.summary import SweepSummary

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SWEEP_STATE).write_text('{"state": "complete", "written": []}')
    write_recorded(sweep, "float_test_cache.json", '{"k": {"test_acc": 0.9}}', SWEEP_STATE)
    callback, config = SweepSummary(), OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    callback.on_multirun_start(config)
    try:
        assert not (sweep / "float_test_cache.json").exists()
    finally:
        callback.on_multirun_end(config)
