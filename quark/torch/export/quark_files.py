"""The tensors of amd-quark's export directory, read as Hugging Face lays them out: one ``model.safetensors``, or
shards (``model-0000i-of-0000n.safetensors``) named by ``model.safetensors.index.json`` (what
``quark.torch.streaming.stream_quantize`` writes for a model above one shard). Both give the same mapping, tensor name
-> tensor (a shard's tensors read from it when looked up); every file's header is checked first (``check_header``) and
every problem is a ValueError naming the file and the tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from quark.torch.export.codec import require_safetensors
from quark.torch.export.validation import check_header

__all__ = ["INDEX_FILE", "WEIGHTS_FILE", "weight_source", "shard_map", "read_weights", "ShardedTensors"]

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"


def weight_source(root: str | Path) -> Path:
    """The file that names the directory's tensors: the index when there is one, else ``model.safetensors`` (used in
    error messages about the tensors as a whole)."""
    root = Path(root)
    return root / INDEX_FILE if (root / INDEX_FILE).is_file() else root / WEIGHTS_FILE


def shard_map(root: str | Path) -> dict[str, list[str]]:
    """File name -> the tensor names the index places in it, in the index's order (the shards' order of first
    appearance); ``{"model.safetensors": []}`` (every tensor of the file) without an index.

    Raises:
        ValueError: an index that is not a JSON object with a ``weight_map`` of names to file names, a file name
            outside the directory, a shard missing, or neither an index nor ``model.safetensors``.
    """
    root = Path(root)
    index = root / INDEX_FILE
    if not index.is_file():
        if not (root / WEIGHTS_FILE).is_file():
            raise ValueError(f"{root} has neither {INDEX_FILE} (sharded) nor {WEIGHTS_FILE}: no weights to read")
        return {WEIGHTS_FILE: []}
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise ValueError(f"{index} is not a JSON object with a weight_map: {err}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map each tensor name to a file name, got {weight_map!r:.200}")
    outside = sorted({f for f in weight_map.values() if Path(f).name != f or f in ("", ".", "..")})
    if outside:
        raise ValueError(f"{index}: weight_map names files outside the directory {root}: {outside}")
    missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
    if missing:
        raise ValueError(f"{index} names shard file(s) missing from {root}: {missing}")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    return files


def read_weights(root: str | Path) -> Mapping[str, torch.Tensor]:
    """Every tensor of the export directory ``root`` by name (``shard_map``), as a ``ShardedTensors`` mapping that
    reads each tensor from its file (``model.safetensors`` or a shard) when it is looked up, so the import's checks
    and its decoding hold a few tensors at a time, not every file. Every shard's header is checked first. When
    both an index and ``model.safetensors`` are present, the single file must hold exactly the index's tensors, bit
    for bit.

    Raises:
        ValueError: ``shard_map``'s; a file that is not readable safetensors; a tensor the index places in a shard
            that lacks it; a shard holding a tensor the index does not place there; a single file beside the index
            with other content.
    """
    root = Path(root)
    files = shard_map(root)
    if WEIGHTS_FILE in files and not files[WEIGHTS_FILE]:
        return ShardedTensors(root, {WEIGHTS_FILE: _file_keys(root / WEIGHTS_FILE)})
    tensors = ShardedTensors(root, files)
    if (root / WEIGHTS_FILE).is_file() and WEIGHTS_FILE not in files:
        _check_same(root, tensors)
    return tensors


class ShardedTensors(Mapping[str, torch.Tensor]):
    """The tensors of an export directory by name, each read from its file on lookup (a new tensor each time).

    Args:
        root: the directory.
        files: ``shard_map(root)``: file name -> the tensor names the index places in it.

    Raises:
        ValueError: a shard whose header is not valid safetensors, lacks a tensor the index places in it, or holds one
            the index does not.
    """

    def __init__(self, root: Path, files: dict[str, list[str]]) -> None:
        self.root = root
        self.file_of = {name: file for file, names in files.items() for name in names}
        st = require_safetensors()
        for file, names in files.items():  # headers only: no tensor data is read here
            path = root / file
            check_header(path)
            try:
                with st.safe_open(str(path), "pt") as f:
                    held = set(f.keys())
            except Exception as err:  # the reader's own errors vary
                raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
            _check_keys(path, held, names)

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self.root / self.file_of[key]
        st = require_safetensors()
        try:
            with st.safe_open(str(path), "pt") as f:
                return f.get_tensor(key)
        except Exception as err:  # a file changed or corrupt since its header was checked
            raise ValueError(f"{path}: tensor {key!r} is not readable: {err}") from err

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)

    def __contains__(self, key: Any) -> bool:
        return key in self.file_of


def _file_keys(path: Path) -> list[str]:
    """The tensor names of the safetensors file ``path`` (its header checked first)."""
    st = require_safetensors()
    check_header(path)  # a tensor whose bytes do not match its dtype and shape, by name
    try:
        with st.safe_open(str(path), "pt") as f:
            return list(f.keys())
    except Exception as err:  # a truncated or corrupt file: the reader's own errors vary
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err


def _check_keys(path: Path, held: set[str], names: list[str]) -> None:
    """ValueError unless the shard ``path`` holds exactly the tensors ``names`` the index places in it."""
    absent = [n for n in names if n not in held]
    if absent:
        raise ValueError(
            f"{path.parent / INDEX_FILE} places tensor(s) {absent[:10]} in {path.name}, which does not hold them"
        )
    extra = sorted(held - set(names))
    if extra:
        raise ValueError(
            f"{path.name} holds tensor(s) {extra[:10]} that {path.parent / INDEX_FILE} does not place there "
            "(an index that does not match its shards)"
        )


def _check_same(root: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless ``model.safetensors`` beside the index holds the same tensors, bit for bit (compared one
    tensor at a time: the single file is not read whole)."""
    st = require_safetensors()
    path = root / WEIGHTS_FILE
    where = f"{root} holds both {WEIGHTS_FILE} and {INDEX_FILE}"
    check_header(path)
    try:
        with st.safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            if keys != set(tensors):
                diff = sorted(keys ^ set(tensors))
                raise ValueError(f"{where} with different tensors ({diff[:10]} in one only); remove the stale one")
            for key, value in tensors.items():
                other = f.get_tensor(key)
                if other.dtype != value.dtype or other.shape != value.shape or not _same_bits(other, value):
                    raise ValueError(f"{where} with different content: tensor {key!r} differs; remove the stale one")
    except ValueError:
        raise
    except Exception as err:  # a truncated or corrupt file: the reader's own errors vary
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaNs included)."""
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
