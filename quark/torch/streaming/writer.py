"""amd-quark's export directory written a part at a time: the tensors of each decoder layer go to disk as the layer
finishes (one part file each, so they are not held in memory while later layers are quantized); ``finish`` gathers
the parts into safetensors shards of at most ``max_shard_bytes`` (a tensor larger than that gets a shard of its own),
names them as Hugging Face does (``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``; one shard:
``model.safetensors``), writes ``config.json`` and only then moves the folder to its final name. Everything is built in
a temporary folder beside the target (``.quarkl-tmp.<name>.<random>``, this project's own prefix), so a directory under
the final name is complete or absent; on failure the temporary folder, created here, is removed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from quark.torch.export.codec import require_safetensors
from quark.torch.export.files import TEMP_PREFIX, write_atomically

__all__ = ["ShardedExport", "check_output_dir", "DEFAULT_SHARD_BYTES"]

#: the default largest size of one shard of the export (its tensors are in memory only while ``finish`` writes it)
DEFAULT_SHARD_BYTES = 128 * 2**20


def check_output_dir(path: str | Path) -> Path:
    """``path`` may become the export directory: absent (its parents are created), or an empty folder that is not a
    symbolic link. Anything else is refused, so that no file of anybody else's is overwritten.

    Raises:
        ValueError: naming the path and what is in the way.
    """
    out = Path(path)
    if out.is_symlink():
        raise ValueError(f"output directory {str(out)!r} is a symbolic link; give a new or empty folder")
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"output directory {str(out)!r} is a file; give a new or empty folder")
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            raise ValueError(
                f"output directory {str(out)!r} is not empty ({entries[:5]}); the export writes only into a new or "
                "empty folder (it never overwrites files it did not write): give another path or empty it"
            )
    return out


class ShardedExport:
    """The export directory being written (see the module docstring).

    Args:
        output_dir: the final directory (``check_output_dir``).
        max_shard_bytes: a shard is written once the tensors added reach this many bytes.
    """

    def __init__(self, output_dir: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
        self.out = check_output_dir(output_dir)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{self.out.name}.", dir=self.out.parent))
        self._parts: list[tuple[str, dict[str, int]]] = []  # (part file in tmp, its keys and their sizes in bytes)
        self._keys: set[str] = set()
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (full key names) to a part file at once; ``finish`` puts them into shards.

        Raises:
            ValueError: a key added before.
        """
        again = sorted(set(tensors) & self._keys)
        if again:
            raise ValueError(f"tensor(s) {again[:5]} written twice to the export")
        if not tensors:
            return
        stored = {key: value.detach().cpu().contiguous() for key, value in tensors.items()}
        sizes = {key: value.numel() * value.element_size() for key, value in stored.items()}
        name = f"part-{len(self._parts):05d}.safetensors"
        st = require_safetensors()
        write_atomically(self.tmp, name, lambda tmp: st.save_file(stored, tmp, metadata={"format": "pt"}))
        self._parts.append((name, sizes))
        self._keys.update(stored)
        self.total_bytes += sum(sizes.values())

    def _shard_plan(self) -> list[list[tuple[str, str]]]:
        """The shards, in the order the tensors were added: lists of (part file, key), each at most
        ``max_shard_bytes`` (a larger tensor alone)."""
        shards: list[list[tuple[str, str]]] = []
        size = self.max_shard_bytes
        for part, sizes in self._parts:
            for key, nbytes in sizes.items():
                if not shards or size + nbytes > self.max_shard_bytes:
                    shards.append([])
                    size = 0
                shards[-1].append((part, key))
                size += nbytes
        return shards

    def _write_shards(self) -> list[tuple[str, list[str]]]:
        """The shards written from the part files (one shard's tensors in memory at a time), the parts removed."""
        st = require_safetensors()
        shards = self._shard_plan()
        written: list[tuple[str, list[str]]] = []
        for i, members in enumerate(shards):
            tensors: dict[str, torch.Tensor] = {}
            for part in dict.fromkeys(p for p, _ in members):
                wanted = [k for p, k in members if p == part]
                with st.safe_open(str(self.tmp / part), framework="pt") as f:
                    tensors.update({k: f.get_tensor(k) for k in wanted})
            name = f"shard-{i:05d}.safetensors"
            write_atomically(self.tmp, name, lambda tmp, t=tensors: st.save_file(t, tmp, metadata={"format": "pt"}))
            written.append((name, sorted(tensors)))
            del tensors
            for part in {p for p, _ in members} - {p for later in shards[i + 1 :] for p, _ in later}:
                (self.tmp / part).unlink()  # a part file of ours, fully copied
        return written

    def finish(self, document: dict[str, Any]) -> Path:
        """Write the shards, name them, write the index (several shards) and ``config.json`` (``document``), then
        move the folder to its final name. Returns it."""
        shards = self._write_shards()
        count = len(shards)
        weight_map: dict[str, str] = {}
        for i, (name, keys) in enumerate(shards):
            final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.tmp / name, self.tmp / final)
            weight_map.update(dict.fromkeys(keys, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            _write_json(self.tmp, "model.safetensors.index.json", index)
        _write_json(self.tmp, "config.json", document)
        check_output_dir(self.out)  # still free: nothing appeared there meanwhile
        if self.out.exists():
            self.out.rmdir()  # empty (just checked), so ours to replace
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        """Remove the temporary folder (created by this object; never a link)."""
        if self.tmp.is_dir() and not self.tmp.is_symlink():
            shutil.rmtree(self.tmp, ignore_errors=True)


def _write_json(folder: Path, name: str, document: dict[str, Any]) -> None:
    """``document`` as ``folder/name`` (sorted keys, as ``export_quark_dir`` writes config.json), atomically."""
    text = json.dumps(document, indent=2, sort_keys=True) + "\n"
    write_atomically(folder, name, lambda tmp: Path(tmp).write_text(text))
