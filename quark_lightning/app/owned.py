"""Which files in a run (or sweep) directory are the app's: a recorded file's identity (size and sha256), whether a
file is still as a run recorded it (``owned``), and the removal of exactly those files, never through a link, plus
this project's stale temporaries (``quark_lightning.app.rundir`` claims and records directories with these)."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quark.torch.export.files import remove_stale_temporaries
from quark_lightning.app.lock import inside

log = logging.getLogger(__name__)


def rel_path(out: Path, path: Path) -> str:
    """``path`` relative to ``out``, with forward slashes."""
    return path.relative_to(out).as_posix()


# ----------------------------------------------------------------------------------------------- identities
def file_hash(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def identity(path: Path) -> dict[str, Any]:
    """What a recorded file is: its size and content hash."""
    return {"size": path.stat().st_size, "sha256": file_hash(path)}


def recorded_files(state: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The files a run's state lists as written: path (as recorded) -> size and hash (malformed entries dropped)."""
    entries = (state or {}).get("written")
    found = {}
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and isinstance(entry.get("size"), int):
            found[entry["path"]] = entry
    return found


def relative_inside(rel: str) -> bool:
    """``rel`` names a place inside the run directory: relative, without ``..``, ``.`` or empty parts."""
    parts = rel.split("/")
    return bool(rel) and not os.path.isabs(rel) and "\\" not in rel and all(p not in ("", ".", "..") for p in parts)


def reach(out: Path, rel: str) -> tuple[Path | None, str | None]:
    """``out/rel`` when every folder on the way is a real folder (not a link): (path, None); else (None, why), why
    None when the way is simply gone."""
    path = out
    for part in rel.split("/")[:-1]:
        path = path / part
        if path.is_symlink():
            return None, f"{rel_path(out, path)} is a symbolic link"
        if not path.is_dir():
            return None, None
    return path / rel.rsplit("/", 1)[-1], None


def owned(out: Path, rel: str, recorded: dict[str, dict[str, Any]]) -> bool:
    """``out/rel`` is a regular file recorded with its size and hash (read through a linked folder such as
    checkpoints/ on a larger disk: it is only compared here, never removed through the link)."""
    entry, path = recorded.get(rel), out / rel
    if entry is None or not relative_inside(rel) or path.is_symlink() or not path.is_file():
        return False
    return path.stat().st_size == entry["size"] and file_hash(path) == entry.get("sha256")


# ----------------------------------------------------------------------------------------------- removal
def remove_recorded(out: Path, state: dict[str, Any] | None, keep: set[Path]) -> tuple[list[str], list[str]]:
    """Remove the files ``state`` recorded that are still as recorded (see the module's docstring), except ``keep``;
    then the empty folders it created. Returns what went and what stayed (each with why)."""
    removed: list[str] = []
    kept: list[str] = []
    for rel, entry in recorded_files(state).items():
        why = _removable(out, rel, entry, keep)
        if why is None:
            (out / rel).unlink()
            removed.append(rel)
        elif why:
            kept.append(f"{rel} ({why})")
    dirs = (state or {}).get("dirs")
    for rel in sorted((d for d in dirs if isinstance(d, str)) if isinstance(dirs, list) else [], reverse=True):
        path, _ = reach(out, rel) if relative_inside(rel) else (None, None)
        if path is not None and path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
            removed.append(rel + "/")
    return removed, kept


def _removable(out: Path, rel: str, entry: dict[str, Any], keep: set[Path]) -> str | None:
    """None when ``out/rel`` may go; else why it stays ("" when there is nothing to say: it is gone)."""
    if not relative_inside(rel):
        return "refused: a path outside the run directory"
    path, why = reach(out, rel)
    if path is None:
        return why or ""
    if path.is_symlink():
        return "a symbolic link"
    if not os.path.lexists(path):
        return ""
    if not path.is_file():
        return "not a regular file"
    if path.resolve() in keep:
        return "this run's input"
    if path.stat().st_size != entry["size"] or file_hash(path) != entry.get("sha256"):
        return "changed since that run wrote it"
    return None


def remove_temporaries(out: Path, places: Sequence[Path]) -> list[Path]:
    """The stale temporaries (this project's prefix) of writes that never finished (a killed export or checkpoint),
    in ``out`` and ``.hydra`` and anywhere under ``places`` reached without a link."""
    reachable = [p for p in places if inside(out, p) and reach(out, rel_path(out, p))[0] is not None]
    removed = remove_stale_temporaries([out, out / ".hydra"], reachable)
    if removed:
        log.info(
            "run directory %s: removed %d temporary file(s) of writes that never finished: %s",
            out,
            len(removed),
            ", ".join(rel_path(out, p) for p in removed),
        )
    return removed
