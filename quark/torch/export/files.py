"""Atomic file writes: the exporters write a temporary file in the target folder and rename it at the end."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(output_dir: str | Path, filename: str, write: Callable[[str], None]) -> Path:
    """``write(tmp_path)`` then rename to ``output_dir/filename``: an interrupted export never leaves a half file under
    the final name (an earlier file there stays intact), and the temporary is removed on failure."""
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0600: give it the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def _umask() -> int:
    """The process umask (read by setting it, then putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
