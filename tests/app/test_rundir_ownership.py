"""A run directory never loses what the user owns (``quark_lightning.app.rundir``): a run removes exactly the files an earlier run
recorded (path, size, sha256), never by name or pattern, never through a symbolic link, never outside the directory;
it refuses to write over a file nobody recorded; every check (data, Trainer, model) runs before the directory is
touched, so a refused run leaves it byte for byte as it was; the lock file is never written through a link."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from app_helpers import compose_cfg, run_train

from quark_lightning.app import rundir
from quark_lightning.app.conf import ConfigError
from quark_lightning.app.run import run

SMOKE = ("trainer=smoke", "trainer.accelerator=cpu")


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


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _state(out: Path) -> dict[str, Any]:
    return json.loads((out / rundir.RUN_STATE).read_text())


def _identity(path: Path) -> dict[str, Any]:
    """A ``written`` entry's size and hash, computed here independently of the app."""
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.fixture(scope="module")
def complete_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete PTQ run's directory (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("complete") / "run"
    run(compose_cfg(*SMOKE), out)
    return out


def _copy(complete_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(complete_run, out, symlinks=True)
    return out


# ----------------------------------------------------------------------------------------------- user files
@pytest.mark.parametrize("logs", ["logs", "docs"])
def test_user_files_survive_runs_into_their_folder(logs: str, tmp_path: Path) -> None:
    """Files named like the app's products (and like other tools' temporaries) in a folder that never held a run:
    two runs into it keep every one of them byte for byte."""
    out = tmp_path / "mine"
    _write(
        out,
        {
            "checkpoints/best.ckpt": "my checkpoint",
            "checkpoints/float-epoch0.ckpt": "mine, named like the app's",
            "export/model.onnx": "my export",
            f"{logs}/old/metrics.csv": "my metrics",
            f"{logs}/index.md": "my notes",
            "trial.json": "{}",
            "sensitivity.csv": "my sensitivities",
            "mixed_bits.png": "my plot",
            "notes.txt": "mine",
            ".x.abcdefgh.tmp": "an editor's",
            ".notes.abcdefgh.tmp": "another tool's",
            "results.json.tmp": "mine too",
            ".results.json.abcdefgh.tmp": "named like the app's old temporaries",
        },
    )
    mine = _tree(out)
    for _ in range(2):
        results = run(compose_cfg(*SMOKE, f"logger.csv.name={logs}"), out)
        after = _tree(out)
        assert {rel: after.get(rel) for rel in mine} == mine
        listed = [rel for kind in results["files"].values() for rel in kind]
        assert listed and not set(listed) & set(mine)  # the run's files are its own, none of the user's
        assert f"{logs}/fp32/metrics.csv" in listed and "checkpoints/quantized.ckpt" in listed


def test_a_users_file_where_the_run_writes_stops_it_untouched(tmp_path: Path) -> None:
    """A file of the user's under a name the run writes (results.json, checkpoints/quantized.ckpt, a logger's phase
    folder): the run stops, names them, and adds nothing (not even a lock file)."""
    out = tmp_path / "mine"
    _write(out, {"results.json": "my results", "checkpoints/quantized.ckpt": "my model", "logs/fp32/metrics.csv": "x"})
    before = _tree(out)
    with pytest.raises(ConfigError) as err:
        run(compose_cfg(*SMOKE), out)
    for name in ("results.json", "checkpoints/quantized.ckpt", "logs/fp32/metrics.csv", "hydra.run.dir=<another dir>"):
        assert name in str(err.value)
    assert _tree(out) == before


@pytest.fixture
def job_log(request: pytest.FixtureRequest) -> Any:
    """Hydra's job log as the app sees it: a root-logger file handler (opened at its first record) into a folder."""
    handlers: list[logging.Handler] = []

    def add(folder: Path) -> Path:
        handler = logging.FileHandler(folder / "train.log", delay=True)
        logging.getLogger().addHandler(handler)
        handlers.append(handler)
        return folder / "train.log"

    yield add
    for handler in handlers:
        logging.getLogger().removeHandler(handler)
        handler.close()


def test_a_users_train_log_stops_the_run_and_a_runs_own_log_is_appended(job_log: Any, tmp_path: Path) -> None:
    """A train.log of the user's where Hydra's job log goes: the run stops untouched (nothing appended); a directory
    whose train.log an earlier run of the app started: the log is that run's, and the next run appends to it."""
    out = tmp_path / "mine"
    _write(out, {"train.log": "my own notes\n"})
    job_log(out)
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"holds train\.log"):
        run(compose_cfg(*SMOKE), out)
    assert _tree(out) == before

    ours = tmp_path / "ours"
    log_file = job_log(ours)
    run(compose_cfg(*SMOKE), ours)
    assert _state(ours)["logs"] == ["train.log"] and log_file.stat().st_size > 0
    size = log_file.stat().st_size
    run(compose_cfg(*SMOKE), ours)
    assert log_file.stat().st_size > size and _state(ours)["state"] == "complete"


def test_run_dir_dot_in_a_git_repository_keeps_tracked_files(tmp_path: Path) -> None:
    """``hydra.run.dir=.`` in a repository whose tracked files are named like the app's products: the run completes
    and git sees no tracked file deleted or changed."""
    repo = tmp_path / "repo"
    _write(
        repo,
        {
            "README.md": "# mine",
            "src/main.py": "print('mine')\n",
            "checkpoints/keep.ckpt": "tracked",
            "export/README.md": "tracked",
            "logs/notes.md": "tracked",
            "sensitivity.csv": "a,b\n",
            "trial.json": "{}",
            "mixed_bits.png": "tracked",
            ".cache.abcdefgh.tmp": "tracked",
        },
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "mine"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    proc = run_train(*SMOKE, "hydra.run.dir=.", cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (repo / "results.json").is_file() and (repo / "checkpoints" / "quantized.ckpt").is_file()
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout
    assert changed == ""


# ----------------------------------------------------------------------------------------------- links
def test_linked_checkpoints_and_logs_keep_their_targets(tmp_path: Path) -> None:
    """checkpoints/ and logs/ as links to folders elsewhere: the files there stay, even ones a previous run's state
    records with their exact size and hash (nothing is removed through a link), and the links stay links."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    _write(elsewhere, {"ckpts/a.ckpt": "theirs", "logs/old.csv": "theirs"})
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere / "ckpts", target_is_directory=True)
    (out / "logs").symlink_to(elsewhere / "logs", target_is_directory=True)
    written = [{"path": rel, **_identity(out / rel)} for rel in ("checkpoints/a.ckpt", "logs/old.csv")]
    (out / rundir.RUN_STATE).write_text(
        json.dumps(
            {"state": "complete", "pid": 1, "written": written, "outputs": ["checkpoints", "logs"], "dirs": ["logs"]}
        )
    )
    before = _tree(elsewhere)
    run(compose_cfg(*SMOKE), out)
    first = _tree(elsewhere)
    assert {rel: first.get(rel) for rel in before} == before
    kept = _state(out)["replaced"]["kept"]
    assert (
        "checkpoints/a.ckpt (checkpoints is a symbolic link)" in kept
        and "logs/old.csv (logs is a symbolic link)" in kept
    )
    run(compose_cfg(*SMOKE), out)  # the first run's files in the targets are recorded, and still not removed
    second = _tree(elsewhere)
    assert {rel: second.get(rel) for rel in before} == before
    assert second["ckpts/float-epoch0.ckpt"] == first["ckpts/float-epoch0.ckpt"]  # the second run wrote -v1
    assert "ckpts/float-epoch0-v1.ckpt" in second
    assert (out / "checkpoints").is_symlink() and (out / "logs").is_symlink()


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path: Path) -> None:
    out, target = tmp_path / "run", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("precious")
    (out / rundir.LOCK).symlink_to(target)
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"lock file, is a symbolic link"):
        run(compose_cfg(*SMOKE, "quant=none"), out)
    assert target.read_text() == "precious" and _tree(out) == before


# ----------------------------------------------------------------------------------------------- a refused run
@pytest.mark.parametrize("mistake", ["data.batch_size=0", "trainer.max_epochs=-2"])
def test_a_config_mistake_after_a_complete_run_changes_nothing(
    mistake: str, complete_run: Path, tmp_path: Path
) -> None:
    """Mistakes found by the data loaders and by the Trainer stop the run before the directory is touched: every
    file of the complete run (``.hydra/``, ``run_state.json``, the lock file included) is as it was."""
    out = _copy(complete_run, tmp_path)
    before = _tree(out)
    with pytest.raises(ConfigError, match=mistake.split("=")[0].split(".")[-1]):
        run(compose_cfg(*SMOKE, mistake), out)
    assert _tree(out) == before


def test_a_second_run_removes_exactly_the_first_runs_files(complete_run: Path, tmp_path: Path) -> None:
    """The files the first run recorded go (the second run writes its own), except one the user changed since; a
    file the user added inside checkpoints/ stays."""
    out = _copy(complete_run, tmp_path)
    first = {entry["path"] for entry in _state(out)["written"]}
    assert {"results.json", "checkpoints/quantized.ckpt", "logs/fp32/metrics.csv", ".hydra/config.yaml"} <= first
    (out / "checkpoints" / "mine.ckpt").write_text("added by the user")
    with open(out / "checkpoints" / "float-epoch0.ckpt", "ab") as f:
        f.write(b"changed by the user")
    changed = _tree(out)["checkpoints/float-epoch0.ckpt"]
    run(compose_cfg(*SMOKE), out)
    replaced = _state(out)["replaced"]
    assert sorted(r for r in replaced["removed"] if not r.endswith("/")) == sorted(
        first - {"checkpoints/float-epoch0.ckpt"}
    )
    assert replaced["kept"] == ["checkpoints/float-epoch0.ckpt (changed since that run wrote it)"]
    assert (out / "checkpoints" / "mine.ckpt").read_text() == "added by the user"
    assert _tree(out)["checkpoints/float-epoch0.ckpt"] == changed
    second = {entry["path"] for entry in _state(out)["written"]}
    assert "checkpoints/float-epoch0-v1.ckpt" in second and not second & {
        "checkpoints/mine.ckpt",
        "checkpoints/float-epoch0.ckpt",
    }


def test_a_state_file_that_points_outside_is_never_followed(tmp_path: Path) -> None:
    """``..``, absolute paths (``/etc/passwd``), a folder that is a link to elsewhere: recorded with their exact size
    and hash, and still never removed."""
    out, outside = tmp_path / "run", tmp_path / "outside"
    _write(outside, {"victim.txt": "not the run's", "sub/victim.txt": "not the run's"})
    out.mkdir()
    (out / "link").symlink_to(outside, target_is_directory=True)
    victim, deeper = outside / "victim.txt", outside / "sub" / "victim.txt"
    recorded = {
        "../outside/victim.txt": victim,
        str(victim): victim,
        "link/victim.txt": victim,
        "link/sub/victim.txt": deeper,
        "checkpoints/../../outside/victim.txt": victim,
    }
    written = [{"path": p, **_identity(file)} for p, file in recorded.items()]
    if Path("/etc/passwd").is_file():
        written.append({"path": "/etc/passwd", **_identity(Path("/etc/passwd"))})
    state = {
        "state": "complete",
        "pid": 1,
        "written": written,
        "dirs": ["..", str(outside / "sub"), "link/sub", "link"],
        "outputs": ["link", "../outside", str(outside)],
    }
    (out / rundir.RUN_STATE).write_text(json.dumps(state))
    before, passwd = _tree(outside), Path("/etc/passwd").read_bytes() if Path("/etc/passwd").is_file() else None
    run(compose_cfg(*SMOKE, "quant=none"), out)
    assert _tree(outside) == before and (out / "link").is_symlink()
    assert passwd is None or Path("/etc/passwd").read_bytes() == passwd
    kept = _state(out)["replaced"]["kept"]
    assert "../outside/victim.txt (refused: a path outside the run directory)" in kept
    assert "link/victim.txt (link is a symbolic link)" in kept


# ----------------------------------------------------------------------------------------------- unwritable
def test_a_run_directory_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    with pytest.raises(ConfigError, match=rf"the run directory {blocker / 'run'} cannot be written .*hydra.run.dir="):
        run(compose_cfg(*SMOKE, "quant=none"), blocker / "run")
    assert blocker.read_text() == "mine"


def test_a_read_only_run_directory_gets_one_clear_error(tmp_path: Path) -> None:
    """``python train.py hydra.run.dir=<read-only dir>``: one ``error:`` line naming the directory (not Hydra's
    'Unable to configure handler'), and nothing written there."""
    out = tmp_path / "ro"
    _write(out, {"results.json": "theirs"})
    out.chmod(0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("permission bits do not bind this user (root): run as another user to check")
        proc = run_train(*SMOKE, f"hydra.run.dir={out}", cwd=tmp_path)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert errors == [errors[0]] and f"the run directory {out} cannot be written" in errors[0], proc.stderr[-3000:]
        assert "Unable to configure handler" not in proc.stderr and "Traceback" not in proc.stderr
        assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    finally:
        out.chmod(0o755)


# ----------------------------------------------------------------------------------------------- after the run
def test_a_searchs_trial_file_is_recorded_and_a_users_is_kept(tmp_path: Path) -> None:
    """trial.json (written by the search after the run) joins the run's recorded files; one of the user's stays."""
    mine, job = tmp_path / "mine", tmp_path / "job"
    _write(mine, {"trial.json": "my trial"})
    assert rundir.write_recorded(mine, "trial.json", "{}") is False and (mine / "trial.json").read_text() == "my trial"
    _write(job, {rundir.RUN_STATE: json.dumps({"state": "complete", "written": []})})
    for text in ('{"status": "FAILED"}', '{"status": "COMPLETED"}'):  # the second replaces the recorded first
        assert rundir.write_recorded(job, "trial.json", text) is True
        assert _state(job)["written"] == [{"path": "trial.json", **_identity(job / "trial.json")}]
    assert (job / "trial.json").read_text() == '{"status": "COMPLETED"}'
