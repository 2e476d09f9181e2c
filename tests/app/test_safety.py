"""Untrusted files and shared directories: a checkpoint given as ckpt_path= is read with torch.load(weights_only=True)
(a pickle payload in it is refused and never runs; our own float checkpoints still load), and a run directory is
locked for the whole run (a second run on it stops at once, without results or checkpoints of its own)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from app_helpers import ROOT, compose_cfg, run_train
from omegaconf import OmegaConf

from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run
from quark_lightning.tasks.lightning_digits import DigitsClassifier

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")


class _OpensAFile:
    """Unpickling this calls ``open(marker, "w")``: the file appears only if the pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _malicious_checkpoint(path: Path, marker: Path) -> Path:
    """A checkpoint that looks like a Lightning one (a state_dict that fits the model) with a payload beside it."""
    torch.save({"state_dict": DigitsClassifier().state_dict(), "hyper_parameters": {"x": _OpensAFile(marker)}}, path)
    return path


@pytest.fixture(scope="module")
def float_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One float run (no quantization): its results, with a checkpoint written by the app's ModelCheckpoint."""
    return run(compose_cfg("quant=none", *SMOKE), tmp_path_factory.mktemp("float"))


# ----------------------------------------------------------------------------------------------- checkpoints
def test_the_payload_runs_when_loaded_unsafely(tmp_path: Path) -> None:
    """The payload is real: torch.load(weights_only=False), as the app did, creates the marker."""
    marker = tmp_path / "marker"
    ckpt = _malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    torch.load(ckpt, map_location="cpu", weights_only=False)
    assert marker.exists()


def test_malicious_checkpoint_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = _malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    out = tmp_path / "run"
    proc = run_train(*SMOKE, f"ckpt_path={ckpt}", f"hydra.run.dir={out}", cwd=tmp_path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    error = errors[0]
    assert f"error: ckpt_path='{ckpt}' was refused: it holds objects other than tensors and plain containers" in error
    assert "open" in error and "weights_only=True" in error
    assert "weights_only=False" not in error  # never advice to run the file's code
    assert (
        "torch.save({'state_dict': model.state_dict()}, 'weights.ckpt')" in error and "ckpt_path=weights.ckpt" in error
    )
    assert "Traceback" not in proc.stderr
    assert not marker.exists()  # the payload never ran
    assert not (out / "results.json").exists() and not (out / "checkpoints").exists()


def test_refused_in_process_too(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    ckpt = _malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    with pytest.raises(ConfigError, match=r"was refused: it holds objects other than tensors and plain containers"):
        run(compose_cfg(*SMOKE, f"ckpt_path={ckpt}"), tmp_path / "run")
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_app_float_checkpoint_loads_with_weights_only(float_run: dict, tmp_path: Path) -> None:
    ckpt = Path(float_run["checkpoints"]["float"])
    torch.load(ckpt, map_location="cpu", weights_only=True)  # what Lightning's ModelCheckpoint wrote: plain data
    again = run(compose_cfg("quant=none", *SMOKE, f"ckpt_path={ckpt}"), tmp_path / "run")
    assert again["metric"]["float"] == float_run["metric"]["float"]
    assert again["float_metrics"]["test_loss"] == pytest.approx(float_run["float_metrics"]["test_loss"], rel=1e-6)


def test_checkpoint_with_omegaconf_hyper_parameters_loads(float_run: dict, tmp_path: Path) -> None:
    """A Hydra-built model given DictConfig/ListConfig arguments (or save_hyperparameters(cfg)) puts omegaconf
    containers in hyper_parameters: allowed by name, still with weights_only=True."""
    checkpoint = torch.load(float_run["checkpoints"]["float"], map_location="cpu", weights_only=True)
    checkpoint["hyper_parameters"]["optim"] = OmegaConf.create({"lr": 1e-3, "betas": [0.9, 0.99], "ref": "${lr}"})
    checkpoint["hyper_parameters"]["widths"] = OmegaConf.create([32, {"x": None}])
    checkpoint["hyper_parameters_type"] = type(OmegaConf.create({}))
    ckpt = tmp_path / "hydra.ckpt"
    torch.save(checkpoint, ckpt)
    again = run(compose_cfg("quant=none", *SMOKE, f"ckpt_path={ckpt}"), tmp_path / "run")
    assert again["metric"]["float"] == float_run["metric"]["float"]


@pytest.mark.parametrize("content", ["garbage", "truncated"])
def test_unreadable_checkpoint_is_a_config_error(content: str, float_run: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "bad.ckpt"
    if content == "garbage":
        ckpt.write_bytes(b"not a checkpoint at all")
    else:
        data = Path(float_run["checkpoints"]["float"]).read_bytes()
        ckpt.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=rf"ckpt_path='{ckpt}' is not a checkpoint torch.load can read \(.+\)"):
        run(compose_cfg(*SMOKE, f"ckpt_path={ckpt}"), tmp_path / "run")


# ----------------------------------------------------------------------------------------------- the run directory lock
def _hold_lock(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_busy_run_dir_is_refused_then_free_once_released(tmp_path: Path) -> None:
    out = tmp_path / "run"
    fd = _hold_lock(out)
    (out / "theirs.txt").write_text("the other run's file")
    (out / ".hydra").mkdir()
    (out / ".hydra" / "config.yaml").write_text("theirs: true\n")
    written = [{"path": ".hydra/config.yaml", "size": 13, "sha256": hashlib.sha256(b"theirs: true\n").hexdigest()}]
    (out / "run_state.json").write_text(json.dumps({"state": "running", "pid": 4242, "written": written}))
    try:
        proc = run_train(*SMOKE, "quant=none", f"hydra.run.dir={out}", cwd=tmp_path)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, proc.stderr[-3000:]
        assert f"error: the run directory {out} is in use by another run" in errors[0]
        assert "hydra.run.dir=<another dir>" in errors[0]
        assert "Traceback" not in proc.stderr
        assert (
            not (out / "results.json").exists() and not (out / "checkpoints").exists() and not (out / "logs").exists()
        )
        assert (out / "theirs.txt").read_text() == "the other run's file" and (out / ".lock").exists()
        assert (out / ".hydra" / "config.yaml").read_text() == "theirs: true\n"  # its composed config too
        with pytest.raises(ConfigError, match=rf"the run directory {out} is in use by another run"):
            run(compose_cfg("quant=none", *SMOKE), out)  # the same refusal in-process
    finally:
        os.close(fd)
    results = run(compose_cfg("quant=none", *SMOKE), out)
    assert (out / "results.json").exists() and Path(results["checkpoints"]["float"]).exists()
    assert "quant:" in (out / ".hydra" / "config.yaml").read_text()  # written once the directory was this run's
    fd = _hold_lock(out)  # the finished run let go of it
    os.close(fd)


def test_the_refusal_names_the_holder(tmp_path: Path) -> None:
    """A run that has claimed its directory has its pid in run_state.json; a refused run names it."""
    out = tmp_path / "run"
    fd = _hold_lock(out)
    try:
        (out / "run_state.json").write_text(json.dumps({"state": "running", "pid": 4242}))
        with pytest.raises(ConfigError, match=r"in use by another run \(pid 4242\)"):
            run(compose_cfg("quant=none", *SMOKE), out)
    finally:
        os.close(fd)


def test_a_crashed_run_leaves_no_stale_lock(tmp_path: Path) -> None:
    """The OS releases a flock when its holder dies: a run killed inside the lock does not block the next run."""
    out = tmp_path / "run"
    out.mkdir()
    child = (
        "import os, signal, sys; from pathlib import Path; from quark_lightning.app.rundir import run_dir_lock\n"
        "with run_dir_lock(Path(sys.argv[1])):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", child, str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / ".lock").is_file() and (out / ".lock").read_text() == ""  # it died holding the lock (never written)
    results = run(compose_cfg("quant=none", *SMOKE), out)
    assert (out / "results.json").exists() and results["metric"]["quantized"] is None
