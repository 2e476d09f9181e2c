"""Sweeps and searches spread over processes: a bit-width sweep under Hydra's joblib launcher gives the basic launcher's
summary (and records the same sweep files); two search workers sharing one sqlite storage finish a search with no
trial run twice and no run directory written by both; submitit's local executor runs a small sweep."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
from app_helpers import ROOT, compose_cfg, run_train

from quark_lightning.app.run import run

pytestmark = pytest.mark.integration

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
SWEEP_STATE = "sweep_state.json"  # the names are part of the contract: spelled here, not imported
#: a small search: 2 x 6 = 12 configurations, the uniform trials 2 and 8 first
SEARCH = (
    "hparams_search=optuna_bits",
    "hparams_search.uniform=[2,8]",
    "hydra.sweeper.params=null",
    "++quant.layer_bits.fc1=choice(2,8)",
    "++quant.layer_bits.fc2=choice(2,3,4,5,6,8)",
)


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A float checkpoint: the sweeps below skip training and share the float-test cache."""
    return run(compose_cfg(*SMOKE, "quant=none"), tmp_path_factory.mktemp("float") / "run")["checkpoints"]["float"]


def _summary(sweep: Path) -> list[dict[str, str]]:
    """summary.csv without its wall times (which differ from run to run)."""
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in csv.DictReader((sweep / "summary.csv").open())]


def _check_recorded(sweep: Path, names: set[str]) -> dict[str, Any]:
    """The sweep ended complete, its recorded files are ``names`` with their size and sha256 as on disk."""
    state = json.loads((sweep / SWEEP_STATE).read_text())
    assert state["state"] == "complete", state
    written = {e["path"]: e for e in state["written"]}
    assert set(written) == names, written
    for name, entry in written.items():
        data = (sweep / name).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    return state


@pytest.mark.slow  # two sweeps in subprocesses (about 45 s on 2 cores); test_workers.py checks the pieces in CI's tier
def test_joblib_sweep_gives_the_basic_launchers_summary(float_ckpt: str, tmp_path: Path) -> None:
    """Two jobs at once in loky workers: the same summary rows as one after the other; the jobs listed, the float
    model tested once or twice but cached once, each job's log in its own folder, every sweep file recorded."""
    args = ("-m", "quant.weight_bits=4,8", *SMOKE, f"ckpt_path={float_ckpt}")
    basic = run_train(*args, f"hydra.sweep.dir={tmp_path / 'basic'}", cwd=tmp_path)
    assert basic.returncode == 0, basic.stderr[-3000:]
    proc = run_train(
        *args,
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={tmp_path / 'joblib'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "joblib"
    assert _summary(sweep) == _summary(tmp_path / "basic") and len(_summary(sweep)) == 2
    files = {"summary.csv", "summary.png", "float_test_cache.json", "multirun.yaml"}
    state = _check_recorded(sweep, files)
    assert sorted(state["jobs"]) == ["0", "1"]  # listed by the jobs, from their own processes
    cache = json.loads((sweep / "float_test_cache.json").read_text())
    assert json.loads((tmp_path / "basic" / "float_test_cache.json").read_text()) == cache and len(cache) == 1
    for job, bits in (("0", "int4"), ("1", "int8")):  # each job's log: its own quantization table, not the other's
        log = (sweep / job / "train.log").read_text()
        other = "int8" if bits == "int4" else "int4"
        assert f"weight         {bits}" in log and f"weight         {other}" not in log, log[-2000:]
        assert json.loads((sweep / job / "run_state.json").read_text())["state"] == "complete"
        assert json.loads((sweep / job / "run_state.json").read_text())["pid"] != state["pid"]  # another process


def _worker(sweep: Path, storage: str, seed: int, trials: int, cwd: Path, ckpt: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    args = [
        *SEARCH,
        f"hparams_search.n_trials={trials}",
        f"hparams_search.sampler_seed={seed}",
        f"hydra.sweeper.storage={storage}",
        *SMOKE,
        f"ckpt_path={ckpt}",
        f"hydra.sweep.dir={sweep}",
    ]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _layer_bits(job: Path) -> tuple[str, ...]:
    """The widths a trial ran with: its layer_bits overrides, as its trial.json lists them."""
    overrides = json.loads((job / "trial.json").read_text())["overrides"]
    return tuple(sorted(o.lstrip("+") for o in overrides if "layer_bits" in o))


def test_two_search_workers_share_one_sqlite_storage(float_ckpt: str, tmp_path: Path) -> None:
    """Two workers started at once on one new sqlite database, 3 trials each: 6 trials numbered 0-5, each run once,
    in one worker's folder, each configuration once; the last worker to finish lists all 6 in its pareto.csv."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sweeps = [tmp_path / "w0", tmp_path / "w1"]
    procs = [_worker(sweep, storage, seed, 3, tmp_path, float_ckpt) for seed, sweep in enumerate(sweeps)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]

    ran: dict[int, Path] = {}
    for sweep in sweeps:
        worker_pid = json.loads((sweep / SWEEP_STATE).read_text())["pid"]
        for trial_file in sweep.glob("*/trial.json"):
            number = json.loads(trial_file.read_text())["trial"]
            assert number not in ran, f"trial {number} ran in {ran.get(number)} and {trial_file.parent}"
            ran[number] = trial_file.parent
            run_state = json.loads((trial_file.parent / "run_state.json").read_text())
            assert run_state["pid"] == worker_pid and run_state["state"] == "complete"  # written by one worker only
    assert sorted(ran) == list(range(6))
    configs = [_layer_bits(folder) for folder in ran.values()]
    assert len(set(configs)) == 6, configs  # no configuration twice: each worker drew one unlike the other's

    study = optuna.load_study(study_name="optuna_bits", storage=storage)
    assert [t.number for t in study.trials] == list(range(6))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    for t in study.trials:  # the value the storage holds is the one the trial's own run reported
        results = json.loads((ran[t.number] / "results.json").read_text())
        assert t.values == [results["metric"]["quantized"], results["size"]["quantized_bits"]]
        assert Path(t.user_attrs["sweep_dir"]) == ran[t.number].parent.resolve()

    for sweep in sweeps:  # each worker's table lists the study's trials as they stood when it finished: its own
        # done, the other worker's done or still running (a worker that finishes first may write its table before
        # the other has drawn its last trial, so trials drawn later are not required here)
        table = list(csv.DictReader((sweep / "pareto.csv").open()))
        listed = [int(r["trial"]) for r in table]
        own = {n for n, folder in ran.items() if folder.parent == sweep}
        assert listed == list(range(len(listed))) and own <= set(listed), (listed, own)
        assert {r["status"] for r in table} <= {"ok", "running"}, table
        assert all(r["status"] == "ok" for r in table if int(r["trial"]) in own), table
    # with both workers done, the table redrawn from the storage (the documented command) has every trial done
    last = max(sweeps, key=lambda s: json.loads((s / SWEEP_STATE).read_text())["finished"])
    redraw = [sys.executable, "-m", "quark_lightning.app.pareto", str(last), storage, "optuna_bits"]
    subprocess.run(redraw, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    table = list(csv.DictReader((last / "pareto.csv").open()))
    assert [int(r["trial"]) for r in table] == list(range(6)) and all(r["status"] == "ok" for r in table)
    assert {r["job"] for r in table if r["job"].startswith("..")} == {
        f"../{ran[n].parent.name}/{ran[n].name}" for n in ran if ran[n].parent != last
    }


@pytest.mark.slow
def test_submitit_local_executor_runs_a_sweep(float_ckpt: str, tmp_path: Path) -> None:
    """submitit's local executor (the SLURM launcher's twin on one machine): both jobs run, listed and summarised."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m",
        "quant.weight_bits=4,8",
        *SMOKE,
        f"ckpt_path={float_ckpt}",
        "hydra/launcher=submitit_local",
        f"hydra.launcher.submitit_folder={tmp_path / 'submitit' / '%j'}",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _summary(sweep)
    assert [(r["job"], r["weight_bits"]) for r in rows] == [("0", "4.0"), ("1", "8.0")]
    state = _check_recorded(sweep, {"summary.csv", "summary.png", "float_test_cache.json", "multirun.yaml"})
    assert sorted(state["jobs"]) == ["0", "1"]
    assert not (sweep / ".submitit").exists()  # submitit's files where it was told
