"""The lock of a run (or sweep) directory and its state file.

``<dir>/.lock`` is held (``flock``, exclusive, never waited for) by the one live run that owns the directory; the OS
drops it when that process ends. ``run_state.json`` (a sweep's: ``sweep_state.json``) says whose the directory is and
what it wrote (``quark_lightning.app.rundir`` writes it); ``read_state`` reads it, a ``"running"`` state whose run no
longer holds the lock reported as ``"stale"``. Until a run has claimed its directory, what Hydra would write into its
log file there is held back (``file_logs_held``): a refused run leaves the directory as it was."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from stat import S_ISREG
from typing import Any

from quark.torch.export.files import write_text_atomically
from quark_lightning.app.conf import ConfigError

try:
    import fcntl
except ImportError:  # not POSIX: a "running" state cannot be told stale
    fcntl = None  # type: ignore[assignment]


RUN_STATE = "run_state.json"
#: a sweep directory's state file: the sweep's files at the top of the directory, as ``run_state.json`` for a run
SWEEP_STATE = "sweep_state.json"
#: state file -> what the directory is called in messages, and where to go instead
KINDS = {
    RUN_STATE: ("run", "hydra.run.dir=<another dir> (hydra.sweep.dir=<another dir> with -m)"),
    SWEEP_STATE: ("sweep", "hydra.sweep.dir=<another dir>"),
}
LOCK = ".lock"
#: a sweep directory's second lock, waited for: its state file and shared files (the float-test cache) are updated
#: under it, by the sweep and by its jobs running in other processes (Hydra's joblib or submitit launchers)
STATE_LOCK = ".state.lock"

#: the runs (and sweeps) of this process that claimed a directory and have not finished: (resolved directory, state
#: file) -> its state
CLAIMED: dict[tuple[Path, str], dict[str, Any]] = {}


def claim_key(out: Path, state: str) -> tuple[Path, str]:
    """The key of a claimed directory in ``CLAIMED``: its resolved path and its state file."""
    return Path(out).resolve(), state


def read_state(out: Path, name: str = RUN_STATE) -> dict[str, Any] | None:
    """The directory's ``run_state.json`` (``name``: ``sweep_state.json``; None: there is none, or it is unreadable);
    a ``"running"`` state whose run no longer holds the lock is returned as ``"stale"`` (the run was killed)."""
    state = state_on_disk(Path(out), name)
    if (
        state is not None
        and state.get("state") == "running"
        and claim_key(out, name) not in CLAIMED
        and not locked(Path(out))
    ):
        state["state"] = "stale"
    return state


def state_on_disk(out: Path, name: str) -> dict[str, Any] | None:
    """The state file ``out/name`` as written (None: absent, a link, unreadable or not an object)."""
    path = out / name
    try:
        state = None if path.is_symlink() else json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_state(out: Path, state: dict[str, Any], name: str = RUN_STATE) -> None:
    write_text_atomically(out / name, json.dumps(state, indent=2, default=str) + "\n")


def locked(out: Path) -> bool:
    """Whether a process holds the directory's lock (unknown without fcntl: assumed held). Never through a link."""
    if fcntl is None:
        return True
    try:
        fd = os.open(out / LOCK, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the shared lock just taken
    return False


def check_writable(out: Path, kind: str = "run", instead: str = KINDS[RUN_STATE][1]) -> None:
    """ValueError naming ``out`` when the run cannot write there, before anything is written: creates ``out`` (and
    its parents) when absent. The message says why (read-only, a file in the way, a read-only folder above it, a
    folder that cannot be created) and what to do (``instead``: the option that gives the ``kind`` directory another
    place)."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        failed = None
    except OSError as err:
        failed = err
    problem, fix = why_not_writable(Path(out), failed)
    if problem:
        raise ValueError(
            f"the {kind} directory {out} cannot be written ({problem}): {fix}choose another directory: {instead}"
        )


def why_not_writable(out: Path, failed: OSError | None = None) -> tuple[str, str]:
    """Why this process cannot write into the directory ``out`` ("" when it can), and the start of the remedy;
    ``failed``: the error creating it raised. Looks, never creates: the nearest existing path at or above ``out``
    decides (not a folder: not a directory; a folder without write permission: read-only; else ``failed``'s reason)."""
    target = Path(os.path.abspath(out))
    at = target
    while not os.path.lexists(at) and at != at.parent:
        at = at.parent
    if at == target:
        where = "it"
    else:
        where = f"its parent {at}" if at == target.parent else f"{at}, a folder above it,"
    if not at.is_dir():
        return f"{where if at == target else at} is not a directory", f"move {at} away, or "
    if not os.access(at, os.W_OK | os.X_OK):
        return f"{where} is read-only", f"make {at} writable, or "
    if failed is None:
        return "", ""
    reason = failed.strerror or str(failed)
    return (reason if at == target else f"it cannot be created in {at}: {reason}"), ""


def inside(out: Path, path: Path) -> bool:
    """``path`` lies strictly inside ``out`` (``out`` and ``path``'s folder resolved; ``path`` itself may be a link to
    elsewhere, e.g. checkpoints/ on a larger disk)."""
    if path.name in ("", ".", ".."):
        return False
    try:
        rel = (path.parent.resolve() / path.name).relative_to(out.resolve())
    except ValueError:
        return False
    return rel != Path(".")


# ----------------------------------------------------------------------------------------------- the lock
def run_dir_lock(out: Path) -> contextlib.AbstractContextManager[None]:
    """An exclusive ``flock`` on ``<out>/.lock`` for the whole run, so that two runs never mix their files in one
    directory. Taken without waiting: if another live run holds it, ConfigError. The OS drops the lock when its
    process ends, so a crashed run leaves nothing stale. The ``.lock`` file is created when absent and never written
    (nor truncated); it is opened without following a link (a link there: ConfigError)."""
    if fcntl is None:
        return contextlib.nullcontext()
    return _flock(out)


@contextlib.contextmanager
def _flock(out: Path) -> Iterator[None]:
    fd = open_lock(out / LOCK)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy_error(out) from None
        yield
    finally:
        os.close(fd)  # releases the lock


#: the state locks this process holds: resolved directory -> depth (taken again inside itself: no second flock, which
#: would wait for itself)
_STATE_HELD: dict[Path, int] = {}


@contextlib.contextmanager
def state_lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<out>/.state.lock``, waited for, around a read-modify-write of the directory's
    state file or of a file its jobs share (the sweep process and its jobs in other processes or on other hosts of a
    shared file system take it in turn, so that no update is lost). Re-entrant within a process; the file is created
    when absent, never written, opened without following a link."""
    key = Path(out).resolve()
    if fcntl is None or key in _STATE_HELD:
        _STATE_HELD[key] = _STATE_HELD.get(key, 0) + 1
        try:
            yield
        finally:
            _release_depth(key)
        return
    fd = open_lock(Path(out) / STATE_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _STATE_HELD[key] = 1
        try:
            yield
        finally:
            _release_depth(key)
    finally:
        os.close(fd)  # releases the lock


def _release_depth(key: Path) -> None:
    _STATE_HELD[key] -= 1
    if not _STATE_HELD[key]:
        del _STATE_HELD[key]


def busy_error(out: Path) -> ConfigError:
    """The refusal of a run whose directory another live run holds (named by its pid once it has claimed it)."""
    holder = read_state(out) or {}
    by = f" (pid {holder.get('pid')})" if holder.get("state") == "running" and holder.get("pid") else ""
    return ConfigError(
        f"the run directory {out} is in use by another run{by}, which holds {out / LOCK}; this run stops before "
        "training or writing results there. Wait for that run to finish, or give this one a directory of its "
        "own: hydra.run.dir=<another dir> (hydra.sweep.dir=<another dir> with -m)"
    )


def open_lock(path: Path) -> int:
    """The lock file, opened without following a link, created when absent, never written (read-write only because
    an exclusive lock on NFS needs it); ConfigError when it is a link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as err:
        what = "a symbolic link" if err.errno == errno.ELOOP else f"not usable ({err.strerror})"
        raise ConfigError(
            f"{path}, the run directory's lock file, is {what}: the app never writes through a link there. Remove "
            "it, or give this run another directory: hydra.run.dir=<another dir>"
        ) from None
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(
            f"{path}, the run directory's lock file, is not a regular file: remove it, or give this run another "
            "directory: hydra.run.dir=<another dir>"
        )
    return fd


# ----------------------------------------------------------------------------------------------- the log file
class _Held(logging.Handler):
    """Keeps the records it gets, to hand them to the file handlers they were meant for once the run may write."""

    def __init__(self, files: list[logging.FileHandler]) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.files = files  # the handlers held back

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def log_files(out: Path) -> list[Path]:
    """The files in ``out`` that the root logger's file handlers write to (Hydra's job log), held back or not."""
    handlers = [h for held in logging.getLogger().handlers for h in getattr(held, "files", [held])]
    names = [Path(h.baseFilename) for h in handlers if isinstance(h, logging.FileHandler)]
    return [name for name in names if inside(out, name)]


@contextlib.contextmanager
def file_logs_held(out: Path) -> Iterator[Callable[[], None]]:
    """Hold back what the root logger's file handlers would write into ``out`` (Hydra's train.log) until the run has
    claimed it (call the yielded function then): a refused run leaves no log file there (the console still shows
    everything). Without a claim the held records are dropped."""
    root = logging.getLogger()
    files = [h for h in root.handlers if isinstance(h, logging.FileHandler) and inside(out, Path(h.baseFilename))]
    if not files:
        yield lambda: None
        return
    held = _Held(files)
    for handler in files:
        root.removeHandler(handler)
    root.addHandler(held)

    def release() -> None:
        if held in root.handlers:
            root.removeHandler(held)
            for handler in files:
                root.addHandler(handler)
                for record in held.records:
                    handler.handle(record)
            held.records.clear()

    try:
        yield release
    finally:
        if held in root.handlers:  # never claimed: the records were shown on the console, the file stays as it was
            held.records.clear()
            release()
