"""A run (or sweep) directory that cannot be created: one ``error:`` line naming it, why, and what to do, before Hydra's
own mkdir (which printed a PermissionError / NotADirectoryError / FileExistsError traceback) and before any work.

In-process: the reasons (``check_writable``), the run callback on a composed Hydra config, a file where a sweep job's
folder goes. Subprocesses (the real ``train.py``): a run under a read-only folder (as root: with the capability that
bypasses permission bits dropped; where that cannot be done, under a file), a sweep with a file where its first job
goes.
A writable run directory: ``test_train.py::test_train_py_default_run``; a writable sweep: ``test_sweepdir_ownership``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from app_helpers import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from quark_lightning.app.conf import CONF_DIR
from quark_lightning.app.hydra_dirs import run_dir_problem
from quark_lightning.app.lock import check_writable
from quark_lightning.app.sweepdir import check_numbered_folders

pytestmark = pytest.mark.integration

#: as root, run the app without the capabilities that let root ignore permission bits (so chmod 555 binds)
_BOUND = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps", "-dac_override,-dac_read_search"]


def _hydra_cfg(*overrides: str) -> DictConfig:
    """The composed config with its ``hydra`` node, as Hydra hands it to ``on_run_start``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def _permission_bits_bind(folder: Path) -> bool:
    """Whether this process is refused writing into ``folder`` (mode 555): False for root."""
    return not os.access(folder, os.W_OK)


def _train(*args: str, cwd: Path, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0"}
    cmd = [*prefix, sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _one_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The single ``error:`` line of a refused run (non-zero exit, no traceback, no Hydra warning)."""
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


# ----------------------------------------------------------------------------------------------- the reasons
def test_a_file_where_the_directory_goes_is_named(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.write_text("the user's")
    with pytest.raises(ValueError, match=rf"^the run directory {mine} cannot be written \(it is not a directory\)"):
        check_writable(mine)
    assert mine.read_text() == "the user's"


@pytest.mark.parametrize("below", ["run", "a/b/run"])
def test_a_file_above_the_directory_is_named(below: str, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.write_text("the user's")
    with pytest.raises(
        ValueError,
        match=rf"the sweep directory {mine / below} cannot be written \({mine} is not a directory\): move {mine} "
        r"away, or choose another directory: hydra.sweep.dir=<another dir>$",
    ):
        check_writable(mine / below, "sweep", "hydra.sweep.dir=<another dir>")
    assert mine.read_text() == "the user's" and sorted(tmp_path.iterdir()) == [mine]


def test_a_read_only_parent_is_named(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if not _permission_bits_bind(ro):
            pytest.skip("permission bits do not bind this user (root): see the subprocess test below")
        with pytest.raises(ValueError, match=rf"\(its parent {ro} is read-only\): make {ro} writable, or choose"):
            check_writable(ro / "run")
        with pytest.raises(ValueError, match=rf"\({ro}, a folder above it, is read-only\)"):
            check_writable(ro / "a" / "run")
        assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_refuses_new_folders_is_named() -> None:
    """/proc refuses mkdir for root too (ENOENT): the folder and the system's reason (read-only, for other users)."""
    reason = r"\(it cannot be created in /proc: |\(/proc, a folder above it, is read-only\)"
    with pytest.raises(ValueError, match=rf"/proc/quark-run/run cannot be written ({reason})"):
        check_writable(Path("/proc/quark-run/run"))


def test_a_writable_directory_passes_and_is_created(tmp_path: Path) -> None:
    check_writable(tmp_path / "a" / "run")
    assert (tmp_path / "a" / "run").is_dir()


# ----------------------------------------------------------------------------------------------- the callback
def test_the_run_callback_names_the_run_dir_and_the_output_subdir(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.write_text("the user's")
    problem = run_dir_problem(_hydra_cfg(f"hydra.run.dir={mine / 'run'}"))
    assert problem.startswith(f"the run directory {mine / 'run'} cannot be written ({mine} is not a directory)")
    assert problem.endswith("choose another directory: hydra.run.dir=<another dir>")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hydra").write_text("the user's")
    problem = run_dir_problem(_hydra_cfg(f"hydra.run.dir={run}", "hydra.output_subdir=.hydra"))
    assert problem.startswith(f"the Hydra output directory {run / '.hydra'} cannot be written (it is not a directory)")
    assert "hydra.output_subdir=<another dir>" in problem and (run / ".hydra").read_text() == "the user's"


def test_the_run_callback_creates_the_folder_hydra_will_use(tmp_path: Path) -> None:
    """The time in the default run dir (``${now:...}``) is resolved once: the folder created is the one Hydra uses."""
    cfg = _hydra_cfg(f"hydra.run.dir={tmp_path}/" + "${now:%H-%M-%S-%f}", "hydra.output_subdir=.hydra")
    assert run_dir_problem(cfg) == ""
    (made,) = tmp_path.iterdir()
    assert made == Path(str(OmegaConf.select(cfg, "hydra.run.dir"))) and (made / ".hydra").is_dir()


def test_a_file_where_a_sweep_job_goes_is_named(tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()  # an earlier sweep's job: reused
    for name in ("007", "notes", "\u00b2"):  # no job's folder is called that (Hydra numbers them 0, 1, ...)
        (tmp_path / name).write_text("the user's")
    check_numbered_folders(tmp_path)
    check_numbered_folders(tmp_path / "absent")
    (tmp_path / "12").write_text("the user's")
    (tmp_path / "3").write_text("the user's")
    with pytest.raises(ValueError, match=rf"{tmp_path / '3'} is not a directory, and job 3 of the sweep would get"):
        check_numbered_folders(tmp_path)


# ----------------------------------------------------------------------------------------------- train.py
def test_train_py_under_a_read_only_folder_gets_one_error_line(tmp_path: Path) -> None:
    """Under a read-only folder (as root: without the capability that ignores permission bits, dropped by setpriv);
    where permission bits cannot bind, under a file instead (the in-process tests above check both messages)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        prefix: tuple[str, ...] = ()
        if not _permission_bits_bind(ro) and os.geteuid() == 0 and shutil.which("setpriv") is not None:
            prefix = tuple(_BOUND)
        bound = _permission_bits_bind(ro) or bool(prefix)
        proc = _train(f"hydra.run.dir={ro / 'run'}", cwd=tmp_path, prefix=prefix) if bound else None
        if proc is None or (prefix and "setpriv:" in proc.stderr):  # setpriv refused: nothing ran
            ro.chmod(0o755)
            ro.rmdir()
            ro.write_text("the user's")  # a file where a folder should be: refused for every user
            proc = _train(f"hydra.run.dir={ro / 'run'}", cwd=tmp_path)
            assert _one_error(proc) == (
                f"error: the run directory {ro / 'run'} cannot be written ({ro} is not a directory): move {ro} away, "
                "or choose another directory: hydra.run.dir=<another dir>"
            )
            assert ro.read_text() == "the user's" and sorted(tmp_path.iterdir()) == [ro]
            return
        assert _one_error(proc) == (
            f"error: the run directory {ro / 'run'} cannot be written (its parent {ro} is read-only): make {ro} "
            "writable, or choose another directory: hydra.run.dir=<another dir>"
        )
        assert list(ro.iterdir()) == [] and sorted(tmp_path.iterdir()) == [ro]
    finally:
        if ro.is_dir():
            ro.chmod(0o755)


def test_a_sweep_with_a_file_where_its_first_job_goes_gets_one_error_line(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "0").write_text("the user's")
    error = _one_error(_train("-m", "seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path))
    assert error.startswith(f"error: the sweep directory {sweep} cannot be used: {sweep / '0'} is not a directory")
    assert error.endswith("hydra.sweep.dir=<another dir>")
    assert sorted(p.name for p in sweep.iterdir()) == ["0"]  # no lock, no multirun.yaml, no state
