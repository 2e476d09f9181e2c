"""What a run directory holds, and whose it is.

``run_state.json`` records the run that owns the directory: written ``"running"`` (pid, host, start time, command line
and Hydra overrides, the places it writes to) once every check of the run has passed, then kept up to date with the
files the run wrote (``written``: each one's path relative to the directory, size and sha256; ``dirs``: the folders it
created), and rewritten ``"complete"`` or ``"failed"`` (with the error) when the run ends. A run killed with SIGKILL (or
a machine that went down) leaves ``"running"``; ``read_state`` reports it as ``"stale"`` when no live run holds the
directory's lock.

A run reusing a directory removes exactly the files the earlier run recorded, and only those that are still regular
files with the recorded size and hash, reached from the directory without passing a symbolic link; then the empty
folders that run created. A file changed or replaced since, a link, an entry under a linked folder, and a recorded path
that leaves the directory (absolute, ``..``) are left alone and named in the log. Nothing is removed by name or
pattern, except this project's own temporaries (``.quarkl-tmp.*``, see ``quark.torch.export.files``) of writes that
never finished, in the run's places (never through a link). A ``ckpt_path=`` file inside the directory (the run's input)
stays. Before any of this, ``check_free`` refuses the run when a file it would write under a fixed name (results.json,
checkpoints/quantized.ckpt, the loggers' phase folders, export/, ...) is there and is not such a recorded file: a file
of yours is never overwritten. All of this happens under the directory's lock (``run_dir_lock``, in ``lock``), so never
under a live run's feet, and only once the run's config, Trainer, data and model have passed their checks: a refused
run leaves the directory as it was.

A sweep's directory (``hydra.sweep.dir``) follows the same rule with its own state file, ``sweep_state.json``: the
files at its top that the sweep writes (``SWEEP_FILES`` and its end callback's summary, see ``quark_lightning.app.sweepdir``) are
checked (``check_free(..., state=SWEEP_STATE)``), claimed (``claim_sweep``) and recorded by the same functions; the jobs'
folders below it are runs of their own."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from quark.torch.export.files import is_temporary, write_atomically, write_text_atomically
from quark_lightning.app.lock import (
    CLAIMED,
    KINDS,
    LOCK,
    RUN_STATE,
    SWEEP_STATE,
    busy_error,
    check_writable,
    claim_key,
    file_logs_held,
    inside,
    locked,
    log_files,
    read_state,
    run_dir_lock,
    state_lock,
    state_on_disk,
    write_state,
)
from quark_lightning.app.owned import (
    identity,
    owned,
    recorded_files,
    rel_path,
    remove_recorded,
    remove_temporaries,
)

log = logging.getLogger(__name__)

#: in a sweep's directory: the float model's test metrics, shared by the jobs that start from one ckpt_path
FLOAT_TEST_CACHE = "float_test_cache.json"
#: what a sweep writes at the top of its directory besides its end callback's products: the jobs' float-test cache,
#: and Hydra's own files (its basic sweeper's multirun.yaml, the Optuna sweeper's optimization_results.yaml)
SWEEP_FILES = (FLOAT_TEST_CACHE, "multirun.yaml", "optimization_results.yaml")
#: the places a run of the app writes to in its directory, besides the loggers' folders (from the config) and
#: ``.hydra/``: where ``record`` looks for its files (the Hydra log file, appended by every run, is named in "logs")
PRODUCTS = (
    "results.json",
    "checkpoints",
    "export",
    "sensitivity.csv",
    "mixed_bits.png",
    "mixed_precision.yaml",
    "trial.json",
)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _logger_names(cfg: DictConfig) -> list[str]:
    """The folders (relative to the run directory) of the loggers that write there (no ``save_dir`` of their own)."""
    names = []
    for node in (cfg.get("logger") or {}).values():
        if node is None or node.get("save_dir") is not None:  # a save_dir of the user's: not this directory's
            continue
        name = node.get("name", "lightning_logs")
        if name:
            names.append(str(name))
    return names


def output_places(cfg: DictConfig, out: Path) -> list[Path]:
    """The files and folders a run of ``cfg`` writes into ``out``: PRODUCTS and the loggers' folders there."""
    places = [out / name for name in (*PRODUCTS, *_logger_names(cfg))]
    return [p for p in places if inside(out, p)]


def planned(cfg: DictConfig, mode: str | None, mixed: bool, exporting: bool) -> tuple[list[str], list[str]]:
    """What a run of ``cfg`` writes under fixed names (relative paths): the files, and the folders it writes into
    whole (export/, each logger's phase folder, whose metrics.csv Lightning replaces). ``mode``: ptq / qat, None
    without quantization."""
    files = ["results.json", ".hydra/config.yaml", ".hydra/overrides.yaml"]
    files += ["checkpoints/quantized.ckpt"] if mode else []
    files += ["sensitivity.csv", "mixed_bits.png", "mixed_precision.yaml"] if mixed else []
    files += ["trial.json"] if cfg.get("hparams_search") else []
    folders = [f"{name}/{phase}" for name in _logger_names(cfg) for phase in ("fp32", *([mode] if mode else []))]
    return files, folders + (["export"] if exporting else [])


def check_free(out: Path, files: Sequence[str], folders: Sequence[str], state: str = RUN_STATE) -> None:
    """ValueError when the run (the sweep: ``state=SWEEP_STATE``) would overwrite a file that no earlier run (sweep)
    of this app recorded writing (or that changed since): one of ``files``, or anything in ``folders`` (paths relative
    to ``out``). Touches nothing."""
    out = Path(out)
    taken = _taken(out, files, folders, state)
    if taken:
        kind, elsewhere = KINDS[state]
        shown = ", ".join(taken[:8]) + (f" and {len(taken) - 8} more" if len(taken) > 8 else "")
        raise ValueError(
            f"the {kind} directory {out} holds {shown}, which no earlier {kind} of this app recorded writing (or which "
            f"changed since): this {kind} would write over them, so it stops here and has touched nothing. Move them "
            f"elsewhere, or give this {kind} a directory of its own: {elsewhere}"
        )


def _taken(out: Path, files: Sequence[str], folders: Sequence[str], state_name: str) -> list[str]:
    """What of ``files`` and ``folders`` (see ``check_free``) is there and not recorded by the state file (the state
    file itself when it is unreadable or a link)."""
    state = read_state(out, state_name)
    recorded = recorded_files(state)
    unreadable = os.path.lexists(out / state_name) and (state is None or (out / state_name).is_symlink())
    taken = [state_name] if unreadable else []
    taken += [rel for rel in files if os.path.lexists(out / rel) and not owned(out, rel, recorded)]
    if state_name == RUN_STATE:  # the Hydra log file, appended by every run: there before any run of ours = a user's
        ours = [] if state is None else state.get("logs", job_logs(out))  # a state without "logs": an older run's
        taken += [rel for rel in job_logs(out) if os.path.lexists(out / rel) and rel not in ours]
    for folder in folders:
        if os.path.lexists(out / folder) and not (out / folder).is_dir():
            taken.append(folder)
        for rel in _files_under(out, folder):
            if not owned(out, rel, recorded):
                taken.append(rel)
    return taken


def _files_under(out: Path, folder: str) -> list[str]:
    """Every entry (files and links, not folders) under ``out/folder`` (a link to a folder is followed there only),
    relative to ``out``; this project's temporaries aside (the claim removes them)."""
    root = out / folder
    if not root.is_dir():
        return []
    found = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not is_temporary(d)]
        found += [Path(parent, n) for n in names if not is_temporary(n)]
        found += [Path(parent, d) for d in dirs if Path(parent, d).is_symlink()]
    return sorted(rel_path(out, p) for p in found)


def claim(cfg: DictConfig, out: Path, inputs: Sequence[str | None] = ()) -> dict[str, Any]:
    """Make ``out`` this run's (called under its lock, once every check has passed): remove the files the previous run
    recorded (``inputs``, e.g. ckpt_path, are kept) and the temporaries in this run's places, then write
    ``run_state.json`` as ``"running"``. Returns the state written."""
    out = Path(out)
    places = output_places(cfg, out)
    return _claim(out, RUN_STATE, places, [*places, out / ".hydra"], {Path(p).resolve() for p in inputs if p})


def claim_sweep(out: Path, files: Sequence[str], overrides: Sequence[str] | None = None) -> dict[str, Any]:
    """Make the sweep directory ``out`` this sweep's (under its lock, before its first job): remove the files the
    previous sweep recorded at its top and this project's temporaries there, then write ``sweep_state.json`` as
    ``"running"`` (with the sweep's command-line ``overrides``); ``files`` (names at its top) are recorded when
    written. Returns the state written."""
    out = Path(out)
    places = [out / name for name in files if inside(out, out / name)]
    return _claim(out, SWEEP_STATE, places, places, set(), overrides)


def _claim(
    out: Path, name: str, places: list[Path], scan: list[Path], keep: set[Path], overrides: Sequence[str] | None = None
) -> dict[str, Any]:
    """``claim`` for the state file ``name``: ``places`` are where the run writes (its outputs, where temporaries are
    looked for), ``scan`` where ``record`` finds what it wrote, ``keep`` the inputs never removed; ``overrides``: the
    command line's (None: Hydra's of the running job)."""
    previous = read_state(out, name)
    if previous is not None and previous.get("state") == "running":  # we hold the lock: that run is gone (killed)
        previous["state"] = "stale"
    removed, kept = remove_recorded(out, previous, keep)
    remove_temporaries(out, places)
    kind = KINDS[name][0]
    who = (
        ""
        if previous is None
        else (f" (its state: {previous.get('state')}, pid {previous.get('pid')}, started {previous.get('started')})")
    )
    if removed:
        log.info(
            "%s directory %s: removed the files the previous %s recorded%s: %s",
            kind,
            out,
            kind,
            who,
            ", ".join(removed),
        )
    if kept:
        log.warning("%s directory %s: kept files the previous %s recorded%s: %s", kind, out, kind, who, ", ".join(kept))
    state: dict[str, Any] = {
        "state": "running",
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _now(),
        "argv": list(sys.argv),
        "overrides": list(overrides) if overrides is not None else _overrides(),
        "outputs": [rel_path(out, p) for p in places],
        "written": [],
        "dirs": [],
        "logs": job_logs(out) if name == RUN_STATE else [],  # appended by each run, so not hashed: named as ours
    }
    if previous is not None:
        state["replaced"] = {"previous": _summary(previous), "removed": removed, "kept": kept}
    files, dirs = _scan(out, scan)
    CLAIMED[claim_key(out, name)] = {
        "state": state,
        "name": name,
        "scan": scan,
        "before": files,
        "dirs_before": dirs,
        "written": {},
    }
    write_state(out, state, name)
    return state


def _summary(previous: dict[str, Any] | None) -> dict[str, Any] | None:
    if previous is None:
        return None
    return {k: previous.get(k) for k in ("state", "pid", "host", "started", "finished", "overrides")}


# ----------------------------------------------------------------------------------------------- recording
def _scan(out: Path, places: Sequence[Path]) -> tuple[dict[str, tuple[int, int, int]], set[str]]:
    """The regular files in ``places`` (a place that is a link to a folder is looked into, links below it are not):
    relative path -> (size, mtime_ns, inode); and the folders there."""
    files: dict[str, tuple[int, int, int]] = {}
    dirs: set[str] = set()
    for place in places:
        if place.is_file() and not place.is_symlink():
            files[rel_path(out, place)] = _stat(place)
            continue
        for parent, _, names in os.walk(place) if place.is_dir() else ():
            dirs.add(rel_path(out, Path(parent)))
            for name in names:
                path = Path(parent, name)
                if path.is_file() and not path.is_symlink():
                    files[rel_path(out, path)] = _stat(path)
    return files, dirs


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def record(out: Path, name: str = RUN_STATE) -> list[str]:
    """Add the files the run (``name=SWEEP_STATE``: the sweep) that claimed ``out`` has written so far (new or changed
    since the claim; temporaries aside) to its state file, with their size and hash, and the folders it created for
    them; so that a later run removes them even when this one is killed. Returns the recorded paths."""
    out = Path(out)
    entry = CLAIMED.get(claim_key(out, name))
    if entry is None:
        return []
    with _state_guard(out, name):
        return _record(out, name, entry)


def _record(out: Path, name: str, entry: dict[str, Any]) -> list[str]:
    files, _ = _scan(out, entry["scan"])
    written: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
    for rel, stat in sorted(files.items()):
        path = out / rel
        if stat == entry["before"].get(rel) or is_temporary(path.name):  # as before the claim (an input, a user's)
            continue
        known = entry["written"].get(rel)
        written[rel] = known if known is not None and known[0] == stat else (stat, identity(path))
    entry["written"] = written
    created = {str(parent) for rel in written for parent in Path(rel).parents if str(parent) != "."}
    entry["state"].update(
        written=[{"path": rel, **identity} for rel, (_, identity) in written.items()],
        dirs=sorted(created - entry["dirs_before"]),
    )
    _merge_jobs(out, entry["state"], name)
    write_state(out, entry["state"], name)
    return list(written)


def _state_guard(out: Path, name: str) -> contextlib.AbstractContextManager[None]:
    """A sweep's state is also updated by its jobs in other processes (parallel launchers): under its state lock."""
    return state_lock(out) if name == SWEEP_STATE else contextlib.nullcontext()


def _merge_jobs(out: Path, state: dict[str, Any], name: str = SWEEP_STATE) -> None:
    """Add to ``state["jobs"]`` the job folders the sweep's state on disk lists (added by jobs in other processes)."""
    if name != SWEEP_STATE:
        return
    jobs = state.setdefault("jobs", [])
    disk = (state_on_disk(out, name) or {}).get("jobs")
    jobs += [j for j in disk if isinstance(j, str) and j not in jobs] if isinstance(disk, list) else []


def add_job(out: Path, job: Path) -> None:
    """List ``job`` (a job's folder) in the ``jobs`` of the sweep that holds ``out``: claimed in this process, or by
    the live sweep whose state is on disk (a job that Hydra's joblib or submitit launcher runs in another process).
    The sweep's summary reads those folders only, not an earlier sweep's left beside them."""
    out = Path(out)
    if claim_key(out, SWEEP_STATE) not in CLAIMED and state_on_disk(out, SWEEP_STATE) is None:
        return  # no sweep of this app holds it: nothing written there
    rel = Path(os.path.relpath(Path(job).resolve(), out.resolve())).as_posix()
    with state_lock(out):
        entry = CLAIMED.get(claim_key(out, SWEEP_STATE))
        state = entry["state"] if entry is not None else read_state(out, SWEEP_STATE)
        if state is None or state.get("state") != "running":  # a stale or finished sweep's state stays as it is
            return
        _merge_jobs(out, state)
        if rel not in state["jobs"]:
            state["jobs"].append(rel)
            write_state(out, state, SWEEP_STATE)


def write_recorded(out: Path, name: str, content: str | Callable[[str], None], state_name: str = RUN_STATE) -> bool:
    """Write ``out/name`` (atomically: ``content`` is the text, or writes the file at the path it is given), and add it
    to the files the state file records (the search's trial.json after the run; ``state_name=SWEEP_STATE``: a sweep's
    summary, the float-test cache); False, with an error logged, when a file there is not one a run of this app
    recorded (a file of the user's is never written over)."""
    out = Path(out)
    with _state_guard(out, state_name):
        return _write_recorded(out, name, content, state_name)


def _write_recorded(out: Path, name: str, content: str | Callable[[str], None], state_name: str) -> bool:
    state = state_on_disk(out, state_name)
    if os.path.lexists(out / name) and not owned(out, name, recorded_files(state)):
        kind = KINDS[state_name][0]
        log.error(
            "%s directory %s: %s is not a file a %s of this app recorded: not written over", kind, out, name, kind
        )
        return False
    if isinstance(content, str):
        write_text_atomically(out / name, content)
    else:
        write_atomically(out, name, content)
    if state is not None:  # else: no run claimed the directory (refused on a first try): the file stays unrecorded
        written = [e for e in state.get("written") or [] if not (isinstance(e, dict) and e.get("path") == name)]
        state["written"] = [*written, {"path": name, **identity(out / name)}]
        write_state(out, state, state_name)
    return True


def read_recorded(out: Path, name: str, state_name: str = RUN_STATE) -> str | None:
    """The text of ``out/name`` when it is a file the state file records, unchanged (what this app wrote there); None
    when it is absent, a link, changed since, or not recorded (a file of the user's is never read as the app's)."""
    out = Path(out)
    if not owned(out, name, recorded_files(state_on_disk(out, state_name))):
        return None
    try:
        return (out / name).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _overrides() -> list[str] | None:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def run_files(out: Path) -> dict[str, list[str]]:
    """The files the run that claimed ``out`` wrote there (``record``: paths relative to it, by kind; its inputs, e.g.
    a ckpt_path inside it, are not listed): checkpoints, export, logs (the loggers' folders and the Hydra log file),
    other (results.json, .hydra/, the mixed-precision files)."""
    out = Path(out)
    found: dict[str, list[str]] = {"checkpoints": [], "export": [], "logs": [], "other": []}
    for rel in record(out):
        top = rel.split("/", 1)[0]
        kind = top if top in ("checkpoints", "export") else "other" if top in PRODUCTS or top == ".hydra" else "logs"
        found[kind].append(rel)
    found["logs"] += [rel for rel in job_logs(out) if (out / rel).is_file()]
    return found


def job_logs(out: Path) -> list[str]:
    """The files in ``out`` the root logger's file handlers write to (Hydra's job log, train.log), relative to it."""
    return [name.resolve().relative_to(out.resolve()).as_posix() for name in log_files(out)]


def finish(out: Path, error: BaseException | None, name: str = RUN_STATE) -> None:
    """Rewrite the ``run_state.json`` (``sweep_state.json``) of a run (sweep) of this process that claimed ``out``:
    ``"complete"`` with its files, or ``"failed"`` with the error. Nothing when this process did not claim it (a config
    error before the claim leaves the previous run's state as it was)."""
    out = Path(out)
    entry = CLAIMED.get(claim_key(out, name))
    if entry is None:
        return
    try:
        with _state_guard(out, name):
            _finish(out, error, name, entry)
    finally:
        CLAIMED.pop(claim_key(out, name), None)


def _finish(out: Path, error: BaseException | None, name: str, entry: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a failed run's files are recorded too (a full disk: as far as it can)
        record(out, name)
    state = dict(entry["state"], finished=_now())
    if error is None:
        state.update(
            state="complete", **({"results": "results.json", "files": run_files(out)} if name == RUN_STATE else {})
        )
    else:
        text = str(error).strip().splitlines()
        state.update(state="failed", error=f"{type(error).__name__}: {text[0] if text else ''}"[:2000])
    write_state(out, state, name)


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


#: what this module offers, the lock's part (``quark_lightning.app.lock``) included, importable from here as before
__all__ = [
    "FLOAT_TEST_CACHE",
    "LOCK",
    "PRODUCTS",
    "RUN_STATE",
    "SWEEP_FILES",
    "SWEEP_STATE",
    "add_job",
    "busy_error",
    "check_free",
    "check_writable",
    "claim",
    "claim_sweep",
    "file_logs_held",
    "finish",
    "locked",
    "output_places",
    "planned",
    "read_recorded",
    "read_state",
    "record",
    "recording",
    "remove_temporaries",
    "run_dir_lock",
    "run_files",
    "state_lock",
    "write_recorded",
]
