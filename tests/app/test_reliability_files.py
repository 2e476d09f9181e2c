"""The files of a run: complete under their final name or absent (a full disk while quantized.ckpt is written leaves
nothing there and no temporary), and a run directory that says whose it is (``run_state.json``: running, complete,
failed; a killed run reads as stale), lists its files in results.json, and is cleared of another run's files and of
the temporaries of a killed export when a run reuses it (``quark_lightning.app.rundir``)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from app_helpers import ROOT, compose_cfg

import callbacks.checkpoint_io as checkpoint_io
from callbacks import AtomicCheckpointIO
from quark.torch.export.files import TEMP_PREFIX, is_temporary
from quark_lightning.app import rundir
from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import _trainer, run
from quark_lightning.tasks.lightning_digits import DigitsClassifier

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if is_temporary(p.name) or p.name.endswith(".tmp")]


def _state(out: Path) -> dict[str, Any]:
    return json.loads((out / rundir.RUN_STATE).read_text())


def _float_checkpoint(path: Path) -> Path:
    """A float checkpoint of the digits model (what the app's fp32 ModelCheckpoint would write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save({"state_dict": DigitsClassifier().state_dict()}, path)
    return path


_LEFT = (
    "results.json",
    "checkpoints/quantized.ckpt",
    "checkpoints/float-epoch3.ckpt",
    "export/model.safetensors",
    "export/config.json",
    "logs/ptq/metrics.csv",
    "logs/fp32/metrics.csv",
    "sensitivity.csv",
    "extra/recorded.bin",
)


def _leftovers(out: Path) -> None:
    """What a complete PTQ run with export=[safetensors] leaves (recorded in its run_state.json with size and hash),
    plus a file of the user's."""
    written = []
    for rel in _LEFT:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(f"the other run's {rel}")
        written.append(
            {
                "path": rel,
                "size": (out / rel).stat().st_size,
                "sha256": hashlib.sha256((out / rel).read_bytes()).hexdigest(),
            }
        )
    (out / "notes.txt").write_text("mine")
    (out / rundir.RUN_STATE).write_text(
        json.dumps(
            {
                "state": "complete",
                "pid": 1,
                "started": "yesterday",
                "written": written,
                "dirs": ["checkpoints", "export", "logs", "logs/ptq", "logs/fp32", "extra"],
            }
        )
    )


# ----------------------------------------------------------------------------------------------- quark_lightning.app.rundir, no training
def test_claim_removes_what_the_other_run_recorded_and_keeps_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _leftovers(out)
    ckpt = _float_checkpoint(out / "checkpoints" / "float-epoch0.ckpt")  # this run's input: kept
    state = rundir.claim(compose_cfg(*SMOKE), out, inputs=[str(ckpt)])
    try:
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
            "checkpoints/float-epoch0.ckpt",
            "notes.txt",
            "run_state.json",
        ]
        assert state["state"] == "running" and state["pid"] == os.getpid() and _state(out)["state"] == "running"
        assert state["replaced"]["previous"]["state"] == "complete" and state["replaced"]["kept"] == []
        assert set(state["replaced"]["removed"]) == {*_LEFT, "export/", "logs/", "logs/ptq/", "logs/fp32/", "extra/"}
        assert rundir.read_state(out)["state"] == "running"  # this process holds it
    finally:
        rundir.finish(out, RuntimeError("stopped\nsecond line"))
    final = _state(out)
    assert final["state"] == "failed" and final["error"] == "RuntimeError: stopped" and "finished" in final


def test_a_linked_checkpoint_folder_is_left_alone(tmp_path: Path) -> None:
    """checkpoints/ as a link to a larger disk: nothing there is removed through the link (named in the state)."""
    out, elsewhere = tmp_path / "run", tmp_path / "big" / "ckpts"
    elsewhere.mkdir(parents=True)
    (elsewhere / "quantized.ckpt").write_text("the other run's")
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    written = [
        {"path": "checkpoints/quantized.ckpt", "size": 15, "sha256": hashlib.sha256(b"the other run's").hexdigest()}
    ]
    (out / rundir.RUN_STATE).write_text(json.dumps({"state": "complete", "written": written}))
    try:
        state = rundir.claim(compose_cfg(*SMOKE), out)
    finally:
        rundir.finish(out, None)
    assert (out / "checkpoints").is_symlink() and (elsewhere / "quantized.ckpt").read_text() == "the other run's"
    assert state["replaced"]["removed"] == []
    assert state["replaced"]["kept"] == ["checkpoints/quantized.ckpt (checkpoints is a symbolic link)"]


def test_the_apps_trainers_write_checkpoints_atomically(tmp_path: Path) -> None:
    trainer = _trainer(compose_cfg(*SMOKE), tmp_path, "fp32", "float-epoch{epoch}")
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


def test_a_killed_run_reads_as_stale_and_temporaries_go(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "export" / "quark").mkdir(parents=True)
    (out / rundir.RUN_STATE).write_text(json.dumps({"state": "running", "pid": 999999}))
    (out / rundir.LOCK).write_text("999999\n")  # the OS released its lock when it died
    stale = [
        out / "export" / "quark" / f"{TEMP_PREFIX}model.safetensors.k3j4h5g6",
        out / f"{TEMP_PREFIX}results.json.abcdefgh",
    ]
    for path in stale:
        path.write_bytes(b"half")
    (out / "results.json.tmp").write_bytes(b"not named like ours: kept")
    assert rundir.read_state(out)["state"] == "stale"
    assert sorted(rundir.remove_temporaries(out, [out / "export"])) == sorted(stale)
    assert [p.name for p in _temporaries(out)] == ["results.json.tmp"]


def test_a_config_error_leaves_the_previous_run_as_it_was(tmp_path: Path) -> None:
    """The checks run before the directory is claimed: a mistake costs the previous results nothing."""
    out = tmp_path / "run"
    _leftovers(out)
    before = _state(out)
    with pytest.raises(ConfigError):
        run(compose_cfg(*SMOKE, "ckpt_path=/no/such.ckpt"), out)
    assert _state(out) == before and (out / "results.json").read_text() == "the other run's results.json"
    assert (out / "checkpoints" / "quantized.ckpt").exists()


# ----------------------------------------------------------------------------------------------- one run each
def test_a_rerun_into_a_used_directory_holds_only_its_own_files(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _leftovers(out)
    ckpt = _float_checkpoint(out / "checkpoints" / "float-epoch0.ckpt")
    results = run(compose_cfg("quant=none", *SMOKE, f"ckpt_path={ckpt}"), out)
    files = results["files"]
    assert files["checkpoints"] == [] and files["export"] == []  # the input checkpoint is not this run's product
    assert files["logs"] == ["logs/fp32/hparams.yaml", "logs/fp32/metrics.csv"]
    assert files["other"] == [".hydra/config.yaml"]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert on_disk == sorted(
        [
            *files["logs"],
            *files["other"],
            "checkpoints/float-epoch0.ckpt",
            "notes.txt",
            "results.json",
            "run_state.json",
            ".lock",
        ]
    )
    state = _state(out)
    assert (
        state["state"] == "complete" and state["results"] == "results.json" and state["files"]["logs"] == files["logs"]
    )
    assert state["replaced"]["previous"]["pid"] == 1 and "checkpoints/quantized.ckpt" in state["replaced"]["removed"]
    assert sorted(e["path"] for e in state["written"]) == sorted([*files["logs"], *files["other"], "results.json"])
    assert json.loads((out / "results.json").read_text())["files"] == files


def test_a_full_disk_while_quantized_ckpt_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC midway through quantized.ckpt: nothing under that name, no temporary, run_state.json says failed; the
    float checkpoint written before is whole."""
    real = checkpoint_io._save

    def full_on_quantized(checkpoint: dict[str, Any], tmp: str) -> None:
        real(checkpoint, tmp)
        if Path(tmp).name.startswith(f"{TEMP_PREFIX}quantized.ckpt."):
            with open(tmp, "r+b") as f:
                f.truncate(os.path.getsize(tmp) // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

    monkeypatch.setattr(checkpoint_io, "_save", full_on_quantized)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        run(compose_cfg(*SMOKE), out)
    assert not (out / "checkpoints" / "quantized.ckpt").exists() and not (out / "results.json").exists()
    assert "state_dict" in torch.load(out / "checkpoints" / "float-epoch0.ckpt", weights_only=False)
    assert not _temporaries(out)
    state = _state(out)
    assert state["state"] == "failed" and "No space left" in state["error"]


# ----------------------------------------------------------------------------------------------- kill -9 mid-export
_PAUSED_EXPORT = r"""
import sys, time
from pathlib import Path
import safetensors.torch as st
sys.path.insert(0, sys.argv[3])
from app_helpers import compose_cfg
from quark_lightning.app.run import _trainer, run
from callbacks import AtomicCheckpointIO

def half_then_pause(tensors, filename, metadata=None):
    st._real_save_file(tensors, filename, metadata=metadata)
    with open(filename, "r+b") as f:
        f.truncate(100)
    Path(sys.argv[2]).write_text(filename)  # the parent kills us now
    time.sleep(600)

st._real_save_file, st.save_file = st.save_file, half_then_pause
run(compose_cfg("trainer=smoke", "trainer.accelerator=cpu", "export=[safetensors]"), sys.argv[1])
"""


def test_kill_9_during_export_then_a_rerun_leaves_no_temporary(tmp_path: Path) -> None:
    out, flag = tmp_path / "run", tmp_path / "exporting"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_EXPORT, str(out), str(flag), str(ROOT / "tests" / "app")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not flag.exists():
            assert child.poll() is None, child.stderr.read()[-3000:] if child.stderr else ""
            assert time.monotonic() < deadline, "the export never started"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    tmp = Path(flag.read_text())
    assert tmp.exists() and tmp.parent == out / "export" and is_temporary(tmp.name)  # what the kill left
    assert not (out / "export" / "model.safetensors").exists() and not (out / "results.json").exists()
    assert (out / "checkpoints" / "quantized.ckpt").exists()  # the killed run's: the dir says it never finished
    assert _state(out)["state"] == "running" and _state(out)["pid"] == child.pid
    assert rundir.read_state(out)["state"] == "stale"

    results = run(compose_cfg(*SMOKE, "export=[safetensors]"), out)
    assert not _temporaries(out)
    assert results["files"]["export"] == ["export/model.safetensors"]
    assert results["files"]["checkpoints"] == ["checkpoints/float-epoch0.ckpt", "checkpoints/quantized.ckpt"]
    state = _state(out)
    assert state["state"] == "complete" and state["pid"] == os.getpid()
    assert state["replaced"]["previous"] == {**state["replaced"]["previous"], "state": "stale", "pid": child.pid}
