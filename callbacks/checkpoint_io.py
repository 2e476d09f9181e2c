"""Checkpoints that are complete under their final name or absent: ``Trainer(plugins=[AtomicCheckpointIO()])``.

Lightning's ``TorchCheckpointIO`` serializes a checkpoint in memory and copies it into place through an fsspec
transaction whose temporary file may lie on another filesystem: when the disk fills up during that copy, a truncated
``.ckpt`` is left under the final name ("failed finding central directory" when it is loaded). ``AtomicCheckpointIO``
writes a temporary file in the destination folder, fsyncs it and renames it (``quark.torch.export.files``): on any
failure the temporary is removed and a previous file of that name stays intact. Paths on other filesystems (``s3://``,
...) are left to ``TorchCheckpointIO``.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from quark.torch.export.files import write_atomically

__all__ = ["AtomicCheckpointIO", "ensure_atomic_checkpoints", "save_checkpoint_file"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: temporary file in the destination folder (named
    ``.quarkl-tmp.<name>.<random>``), fsync, rename. Loading and removing are ``TorchCheckpointIO``'s."""

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | PathLike[str], storage_options: Any | None = None
    ) -> None:
        local = _local_path(path)
        if local is None or storage_options is not None:  # remote, or TorchCheckpointIO's own refusal of the options
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        write_atomically(local.parent, local.name, lambda tmp: _save(checkpoint, tmp))


def save_checkpoint_file(checkpoint: dict[str, Any], path: str | PathLike[str]) -> Path:
    """``torch.save`` of ``checkpoint`` to a local ``path``, complete under its name or absent (as AtomicCheckpointIO)."""
    local = Path(path)
    return write_atomically(local.parent, local.name, lambda tmp: _save(checkpoint, tmp))


def _save(checkpoint: dict[str, Any], tmp: str) -> None:
    """``torch.save`` into ``tmp`` through a Python file: a failed write (ENOSPC) is raised as the OSError it is, where
    torch's own file writer reports only "unexpected pos ..." (a RuntimeError)."""
    with open(tmp, "wb") as f:
        writer = _Writer(f)
        try:
            torch.save(checkpoint, writer)
        except RuntimeError as err:
            if writer.error is not None:
                raise writer.error from err
            raise


class _Writer:
    """The file's ``write`` and ``flush``, keeping the OSError a write raised (torch swallows it)."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _local_path(path: str | PathLike[str]) -> Path | None:
    """The local file a path names (``file://`` URLs included), None for other filesystems."""
    fs, url = fsspec.core.url_to_fs(str(path))
    if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return None
    return Path(url)


def ensure_atomic_checkpoints(trainer: Any, who: str) -> bool:
    """Give ``trainer`` an ``AtomicCheckpointIO`` when it has Lightning's default ``TorchCheckpointIO`` (a plugin of the
    user's, of any other type, is left as it is). Returns whether it was installed (``who`` names the caller in the
    one-line info)."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None or type(strategy.checkpoint_io) is not TorchCheckpointIO:
        return False
    strategy.checkpoint_io = AtomicCheckpointIO()
    rank_zero_info(
        f"{who}: checkpoints are written atomically (AtomicCheckpointIO: a temporary file in the checkpoint folder, "
        "renamed once complete); pass plugins=[...] with a CheckpointIO of yours to choose otherwise"
    )
    return True
