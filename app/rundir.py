"""What a run directory holds, and whose it is.

``run_state.json`` records the run that owns the directory: written ``"running"`` (pid, host, start time, command line
and Hydra overrides, the places it writes to) once the config has passed its checks, and rewritten ``"complete"`` or
``"failed"`` (with the error) when the run ends. A run killed with SIGKILL (or a machine that went down) leaves
``"running"``; ``read_state`` reports it as ``"stale"`` when no live run holds the directory's lock.

A run reusing a directory first removes what another run left at the places it writes to (results.json,
checkpoints/, export/, the loggers' folders, the mixed-precision files, trial.json) and at the places that run recorded,
so that one run's results never sit beside another's checkpoint. Only those places are touched: files of yours in the
directory stay, and so does a ``ckpt_path=`` file inside it (the run's input). Temporaries of writes that never
finished (``.<name>.<random>.tmp``, see ``quark.torch.export.files``) are removed when the run starts. All of this
happens under the directory's lock (``app.run._run_dir_lock``), so never under a live run's feet.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from quark.torch.export.files import is_temporary, remove_stale_temporaries, write_text_atomically

try:
    import fcntl
except ImportError:  # not POSIX: a "running" state cannot be told stale
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

RUN_STATE = "run_state.json"
#: in a sweep's directory: the float model's test metrics, shared by the jobs that start from one ckpt_path
FLOAT_TEST_CACHE = "float_test_cache.json"
LOCK = ".lock"
#: what a run of the app writes into its directory, besides the loggers' folders (from the config), ``.hydra/`` and the
#: Hydra log file (rewritten / appended by every run: not removed)
PRODUCTS = (
    "results.json",
    "checkpoints",
    "export",
    "sensitivity.csv",
    "mixed_bits.png",
    "mixed_precision.yaml",
    "trial.json",
)
_PHASES = ("fp32", "ptq", "qat")

#: the runs of this process that claimed a directory and have not finished: resolved directory -> its state
_claimed: dict[Path, dict[str, Any]] = {}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _inside(out: Path, path: Path) -> bool:
    """``path`` lies strictly inside ``out`` (``out`` and ``path``'s folder resolved; ``path`` itself may be a link to
    elsewhere, e.g. checkpoints/ on a larger disk)."""
    if path.name in ("", ".", ".."):
        return False
    try:
        rel = (path.parent.resolve() / path.name).relative_to(out.resolve())
    except ValueError:
        return False
    return rel != Path(".")


def output_places(cfg: DictConfig, out: Path) -> list[Path]:
    """The files and folders a run of ``cfg`` writes into ``out``: PRODUCTS and the loggers' folders there."""
    places = [out / name for name in PRODUCTS]
    for node in (cfg.get("logger") or {}).values():
        if node is None or node.get("save_dir") is not None:  # a save_dir of the user's: not this directory's
            continue
        name = node.get("name", "lightning_logs")
        if name:
            places.append(out / str(name))
    return [p for p in places if _inside(out, p)]


def remove_temporaries(out: Path) -> list[Path]:
    """The stale temporaries of writes that never finished (a killed export or checkpoint), in ``out`` and ``.hydra``
    and anywhere under checkpoints/ and export/; also the ``results.json.tmp`` of earlier versions of the app."""
    removed = remove_stale_temporaries([out, out / ".hydra"], [out / "checkpoints", out / "export"])
    legacy = out / "results.json.tmp"
    if legacy.is_file():
        legacy.unlink()
        removed.append(legacy)
    if removed:
        log.info("run directory %s: removed %d temporary file(s) of writes that never finished: %s",
                 out, len(removed), ", ".join(str(p.relative_to(out)) for p in removed))  # fmt: skip
    return removed


def read_state(out: Path) -> dict[str, Any] | None:
    """The directory's ``run_state.json`` (None: there is none, or it is unreadable); a ``"running"`` state whose run
    no longer holds the lock is returned as ``"stale"`` (the run was killed)."""
    try:
        state = json.loads((Path(out) / RUN_STATE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    if state.get("state") == "running" and Path(out).resolve() not in _claimed and not _locked(Path(out)):
        state["state"] = "stale"
    return state


def _locked(out: Path) -> bool:
    """Whether a process holds the directory's lock (unknown without fcntl: assumed held)."""
    if fcntl is None or not (out / LOCK).exists():
        return fcntl is None
    fd = os.open(out / LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return False


def claim(cfg: DictConfig, out: Path, inputs: Sequence[str | None] = ()) -> dict[str, Any]:
    """Make ``out`` this run's (called under its lock, once the config has passed its checks): remove another run's
    files at this run's places and at the places that run recorded (``inputs``, e.g. ckpt_path, are kept), then write
    ``run_state.json`` as ``"running"``. Returns the state written."""
    out = Path(out)
    previous = read_state(out)
    if previous is not None and previous.get("state") == "running":  # we hold the lock: that run is gone (killed)
        previous["state"] = "stale"
    places = output_places(cfg, out)
    recorded = [
        out / p for p in (previous or {}).get("outputs", []) if isinstance(p, str) and ".." not in Path(p).parts
    ]
    keep = {Path(p).resolve() for p in inputs if p}
    removed: list[str] = []
    for place in dict.fromkeys(places + [p for p in recorded if _inside(out, p)]):
        removed.extend(_remove(out, place, keep))
    if removed:
        who = (
            ""
            if previous is None
            else f" (its state: {previous.get('state')}, pid {previous.get('pid')}, started {previous.get('started')})"
        )
        log.warning("run directory %s held another run's files%s; removed them: %s", out, who, ", ".join(removed))
    state: dict[str, Any] = {
        "state": "running", "pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
        "argv": list(sys.argv), "overrides": _overrides(), "outputs": [p.relative_to(out).as_posix() for p in places],
    }  # fmt: skip
    if previous is not None or removed:
        state["replaced"] = {"previous": _summary(previous), "removed": removed}
    _write_state(out, state)
    _claimed[out.resolve()] = {"state": state, "places": places, "inputs": keep}
    return state


def _summary(previous: dict[str, Any] | None) -> dict[str, Any] | None:
    if previous is None:
        return None
    return {k: previous.get(k) for k in ("state", "pid", "host", "started", "finished", "overrides")}


def _remove(out: Path, place: Path, keep: set[Path]) -> list[str]:
    """Remove ``place`` (a file, or a folder and what it holds) except the files in ``keep``; returns what went, as
    paths relative to ``out`` (a folder as ``name/``)."""
    if not place.is_dir():
        if not (place.is_symlink() or place.is_file()) or place.resolve() in keep:
            return []
        place.unlink()
        return [place.relative_to(out).as_posix()]
    if not place.is_symlink() and not any(_inside(place, k) for k in keep):
        shutil.rmtree(place)
        return [place.relative_to(out).as_posix() + "/"]
    # a folder holding an input, or a link to a folder elsewhere (e.g. checkpoints/ on a larger disk; the link stays)
    removed = []
    for path in sorted(place.rglob("*"), reverse=True):  # children before their folders
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.resolve() not in keep:
            path.unlink()
            removed.append(path.relative_to(out).as_posix())
    return removed


def _overrides() -> list[str] | None:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def _write_state(out: Path, state: dict[str, Any]) -> None:
    write_text_atomically(out / RUN_STATE, json.dumps(state, indent=2, default=str) + "\n")


def run_files(out: Path) -> dict[str, list[str]]:
    """The files the run that claimed ``out`` wrote there (paths relative to it, by kind; its inputs, e.g. a ckpt_path
    inside it, are not listed): checkpoints, export, logs (the loggers' folders and the Hydra log file), other
    (results.json, .hydra/, the mixed-precision files)."""
    out = Path(out)
    entry = _claimed.get(out.resolve())
    places = entry["places"] if entry is not None else [out / name for name in PRODUCTS]
    inputs = entry["inputs"] if entry is not None else set()
    found: dict[str, list[str]] = {"checkpoints": [], "export": [], "logs": [], "other": []}
    for place in [*places, out / ".hydra"]:
        paths = (
            [place] if place.is_file() else sorted(p for p in place.rglob("*") if p.is_file()) if place.is_dir() else []
        )
        for path in paths:
            if is_temporary(path.name) or path.resolve() in inputs:
                continue
            rel = path.relative_to(out).as_posix()
            top = rel.split("/", 1)[0]
            kind = (
                top if top in ("checkpoints", "export") else "other" if top in PRODUCTS or top == ".hydra" else "logs"
            )
            found[kind].append(rel)
    for handler in logging.getLogger().handlers:  # Hydra's job log (train.log), when it lies in the directory
        name = getattr(handler, "baseFilename", None)
        if name and _inside(out, Path(name)) and Path(name).is_file():
            found["logs"].append(Path(name).resolve().relative_to(out.resolve()).as_posix())
    return found


def finish(out: Path, error: BaseException | None) -> None:
    """Rewrite the ``run_state.json`` of a run of this process that claimed ``out``: ``"complete"`` with its files,
    or ``"failed"`` with the error. Nothing when this process did not claim it (a config error before the claim leaves
    the previous run's state as it was)."""
    out = Path(out)
    entry = _claimed.get(out.resolve())
    if entry is None:
        return
    state = dict(entry["state"], finished=_now())
    try:
        if error is None:
            state.update(state="complete", results="results.json", files=run_files(out))
        else:
            text = str(error).strip().splitlines()
            state.update(state="failed", error=f"{type(error).__name__}: {text[0] if text else ''}"[:2000])
        _write_state(out, state)
    finally:
        _claimed.pop(out.resolve(), None)


@contextlib.contextmanager
def recording(out: Path) -> Iterator[None]:
    """Around a run: its ``run_state.json`` ends ``"complete"``, or ``"failed"`` when the body raises (a run that never
    claimed the directory, e.g. a config error, changes nothing)."""
    try:
        yield
    except BaseException as err:
        try:
            finish(out, err)
        except OSError as failed:  # e.g. the disk that filled up: the run's own error is the one to see
            log.warning("run directory %s: could not record the failed state: %s", out, failed)
        raise
    finish(out, None)
