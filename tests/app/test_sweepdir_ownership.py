"""A sweep directory (``python train.py -m ... hydra.sweep.dir=DIR``) never loses what the user owns: the sweep-level
files of this app (summary.csv/png, pareto.csv/png, float_test_cache.json, Hydra's multirun.yaml and
optimization_results.yaml) are recorded in ``sweep_state.json`` (path, size, sha256); a new sweep into the directory
replaces exactly those still as recorded, never through a symbolic link; a file of the user's under one of those names
stops the sweep before its first job, with the directory byte for byte as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from app_helpers import compose_cfg, run_train

from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")
SWEEP_STATE = "sweep_state.json"  # the name is part of the contract: spelled here, not imported


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): a file's sha256, a link's target, ``dir`` for a folder."""
    found = {}
    for parent, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            path = Path(parent, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                found[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _identity(path: Path) -> dict[str, Any]:
    """A ``written`` entry's size and hash, computed here independently of the app."""
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _written(sweep: Path) -> dict[str, dict[str, Any]]:
    state = json.loads((sweep / SWEEP_STATE).read_text())
    return {e["path"]: {"size": e["size"], "sha256": e["sha256"]} for e in state["written"]}


def _refused(proc: Any, name: str) -> None:
    """The sweep stopped with one ``error:`` line naming ``name`` and what to do, no traceback."""
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert name in errors[0] and "hydra.sweep.dir=<another dir>" in errors[0], errors[0]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A float checkpoint, so that the sweeps below skip training and share the float-test cache."""
    return run(compose_cfg(*SMOKE, "quant=none"), tmp_path_factory.mktemp("float") / "run")["checkpoints"]["float"]


# ----------------------------------------------------------------------------------------------- user files
@pytest.mark.parametrize("name", ["summary.csv", "summary.png", "float_test_cache.json", "multirun.yaml"])
def test_a_users_file_in_the_sweep_dir_stops_the_sweep_untouched(name: str, tmp_path: Path) -> None:
    """A file of the user's under a name the sweep writes at its top (the float-test cache included, which the
    sweep used to delete at its start): the sweep stops before its first job, and the directory is as it was."""
    sweep = tmp_path / "mine"
    sweep.mkdir()
    (sweep / name).write_text("the user's")
    (sweep / "notes.txt").write_text("mine too")
    before = _tree(sweep)
    proc = run_train("-m", "quant.weight_bits=4", *SMOKE, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    _refused(proc, name)
    assert _tree(sweep) == before  # no job folder, no multirun.yaml, no lock file


@pytest.mark.parametrize("subdir", [".", "same"])
def test_one_folder_for_every_job_is_refused_before_the_first(subdir: str, tmp_path: Path) -> None:
    """``hydra.sweep.subdir=.`` (or any name without interpolation) would put every job into one folder, each job
    replacing the one before it: refused with one error line naming the setting, before anything is written."""
    sweep = tmp_path / "sweep"
    proc = run_train(
        "-m", "quant.weight_bits=4,8", *SMOKE, f"hydra.sweep.dir={sweep}", f"hydra.sweep.subdir={subdir}", cwd=tmp_path
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"hydra.sweep.subdir='{subdir}'" in errors[0] and "${hydra.job.num}" in errors[0]
    assert ("sweep directory itself" in errors[0]) == (subdir == ".")
    assert not sweep.exists() and "Traceback" not in proc.stderr


def test_a_users_pareto_csv_stops_the_search_untouched(tmp_path: Path) -> None:
    """The same for a search (Hydra's Optuna sweeper): pareto.csv of the user's, refused before the first trial."""
    sweep = tmp_path / "mine"
    sweep.mkdir()
    (sweep / "pareto.csv").write_text("my front")
    before = _tree(sweep)
    proc = run_train(
        "hparams_search=optuna_bits", "hparams_search.n_trials=1", *SMOKE, f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    _refused(proc, "pareto.csv")
    assert _tree(sweep) == before


def test_linked_sweep_files_keep_their_targets(tmp_path: Path) -> None:
    """summary.csv and multirun.yaml as links to files elsewhere (Hydra used to write multirun.yaml through the
    link): the sweep stops, the links stay links and their targets are untouched."""
    sweep, elsewhere = tmp_path / "sweep", tmp_path / "elsewhere"
    sweep.mkdir()
    elsewhere.mkdir()
    for name in ("summary.csv", "multirun.yaml"):
        (elsewhere / name).write_text(f"my {name}")
        (sweep / name).symlink_to(elsewhere / name)
    before, targets = _tree(sweep), _tree(elsewhere)
    proc = run_train("-m", "quant.weight_bits=4", *SMOKE, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    _refused(proc, "summary.csv")
    assert _tree(sweep) == before and _tree(elsewhere) == targets


# ----------------------------------------------------------------------------------------------- a second sweep
@pytest.mark.slow  # three sweeps (~30 s on one core)
def test_a_second_sweep_replaces_exactly_the_first_sweeps_files(float_ckpt: str, tmp_path: Path) -> None:
    """The first sweep (two jobs) records its top-level files (summary, the float-test cache, Hydra's multirun.yaml)
    with their size and sha256; a second sweep (one job) replaces exactly those, keeps the user's files beside them,
    tests the float model again and summarises its own job only (the first sweep's job 1 stays, a run of its own); a
    recorded file the user changed since stops a third sweep, untouched."""
    sweep = tmp_path / "sweep"
    args = (*SMOKE, f"ckpt_path={float_ckpt}", f"hydra.sweep.dir={sweep}")
    proc = run_train("-m", "quant.weight_bits=4,8", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = _written(sweep)
    top = {"summary.csv", "summary.png", "float_test_cache.json", "multirun.yaml"}
    assert set(first) == top and all(first[name] == _identity(sweep / name) for name in top)
    assert "float test metrics read from" in (sweep / "1" / "train.log").read_text()  # the cache was used
    (sweep / "notes.txt").write_text("mine")
    (sweep / "summary.csv.orig").write_text("my copy")
    job1 = _tree(sweep / "1")
    proc = run_train("-m", "quant.weight_bits=6", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((sweep / SWEEP_STATE).read_text())
    assert sorted(state["replaced"]["removed"]) == sorted(top) and state["replaced"]["kept"] == []
    assert state["state"] == "complete" and set(_written(sweep)) == top
    assert (sweep / "notes.txt").read_text() == "mine" and (sweep / "summary.csv.orig").read_text() == "my copy"
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[4] == "6.0"  # this sweep's job only
    assert _tree(sweep / "1") == job1  # the first sweep's second job: left as it was
    assert "float test metrics read from" not in (sweep / "0" / "train.log").read_text()  # a new cache
    with open(sweep / "summary.csv", "a") as f:
        f.write("a line of the user's\n")
    before = _tree(sweep)
    proc = run_train("-m", "quant.weight_bits=2", *args, cwd=tmp_path)
    _refused(proc, "summary.csv")
    assert _tree(sweep) == before
