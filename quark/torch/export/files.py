"""Atomic file writes: every file the project writes (exports, checkpoints, results, reports) is written to a temporary
file in its target folder, flushed to disk, and renamed to its final name, so that a file under its final name is
complete or absent: a full disk, a crash or a ``kill -9`` mid-write leaves the previous file (if any) intact.

The temporaries are named ``.quarkl-tmp.<final name>.<8 random characters>`` (``mkstemp``): this project's own prefix,
so that no file of anybody else's is ever taken for one. A process killed mid-write cannot remove its own, so
``remove_stale_temporaries`` removes them later (the app does when a run claims its directory, under its lock)."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "write_atomically",
    "write_text_atomically",
    "write_files_atomically",
    "is_temporary",
    "remove_stale_temporaries",
    "TEMP_PREFIX",
]

#: the start of every temporary this project creates (a name nobody else uses)
TEMP_PREFIX = ".quarkl-tmp."
#: ``.quarkl-tmp.<name>.<mkstemp's 8 characters>``: the names ``write_atomically`` (files) and
#: ``write_files_atomically`` (folders) create
_TEMPORARY = re.compile(rf"^{re.escape(TEMP_PREFIX)}.+\.[a-z0-9_]{{8}}$")


def write_atomically(output_dir: str | Path, filename: str, write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` then rename to ``output_dir/filename``: an interrupted export never leaves a half file under
    the final name (an earlier file there stays intact), and the temporary is removed on failure. The temporary lies in
    the same folder (a rename within one filesystem is atomic) and is fsynced before the rename, so that a full disk
    (ENOSPC, reported by ``write`` or by the sync) fails here rather than leaving a short file behind."""
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{filename}.", dir=out_dir)
    os.close(fd)
    try:
        write(tmp)
        _fsync_file(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(out_dir)  # the rename itself reaches the disk
    return path


def write_text_atomically(path: str | Path, text: str, newline: str | None = None) -> Path:
    """``Path(path).write_text(text)``, atomically (``write_atomically``)."""
    target = Path(path)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline=newline) as f:
            f.write(text)

    return write_atomically(target.parent, target.name, write)


def write_files_atomically(output_dir: str | Path, label: str, write: Callable[[str], None]) -> list[Path]:
    """``write(tmp_dir)`` (e.g. a ``save_pretrained`` that writes several files) into a temporary folder in
    ``output_dir``, then each file it wrote is synced and renamed into ``output_dir``: each file is complete under its
    final name or absent (the set is not one transaction). The temporary folder is removed in any case."""
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{label}.", dir=out_dir))
    moved: list[Path] = []
    try:
        write(str(tmp))
        for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync_file(str(file))
            os.chmod(file, 0o666 & ~_umask())
            target = out_dir / file.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(file, target)
            moved.append(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(out_dir)
    return moved


def is_temporary(name: str) -> bool:
    """Whether a file name is one of the temporaries ``write_atomically`` creates (``.quarkl-tmp.<name>.<random>``)."""
    return bool(_TEMPORARY.match(name))


def remove_stale_temporaries(folders: Iterable[str | Path], recursive: Iterable[str | Path] = ()) -> list[Path]:
    """Remove the temporaries left by writes that never finished (a killed process): those directly in ``folders``,
    and those anywhere under ``recursive``. Symbolic links are never followed (a folder that is a link is not looked
    into, a link named like a temporary stays). Only call it when no live writer uses the folders (the app holds its
    run directory's lock). Returns what was removed."""
    candidates: list[Path] = []
    for folder in folders:
        candidates.extend(_entries(Path(folder)))
    for folder in recursive:
        for parent, dirs, _ in os.walk(folder) if _real_dir(Path(folder)) else ():
            candidates.extend(_entries(Path(parent)))
            dirs[:] = [d for d in dirs if not is_temporary(d)]  # a temporary folder goes whole, not walked
    removed: list[Path] = []
    for path in dict.fromkeys(candidates):
        try:
            if _real_dir(path):
                shutil.rmtree(path)
            elif path.is_file() and not path.is_symlink():
                path.unlink()
            else:
                continue
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _real_dir(path: Path) -> bool:
    """A folder that is not a symbolic link."""
    return path.is_dir() and not path.is_symlink()


def _entries(folder: Path) -> list[Path]:
    """The temporaries directly in ``folder`` (none when it is a link or absent)."""
    return sorted(p for p in folder.iterdir() if is_temporary(p.name)) if _real_dir(folder) else []


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # a file system or platform that cannot sync
            raise
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Best effort: POSIX syncs a directory entry through the directory's own descriptor (not possible on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask (read by setting it, then putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
