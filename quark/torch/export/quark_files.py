"""The tensors of amd-quark's export directory, read as Hugging Face lays them out: one ``model.safetensors``, or
shards (``model-0000i-of-0000n.safetensors``) named by ``model.safetensors.index.json`` (what
``quark.torch.streaming.stream_quantize`` writes for a model above one shard). Both read into the same mapping, tensor
name -> tensor, one file open at a time; every file is checked first (``check_header``) and every problem is a
ValueError naming the file and the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quark.torch.export.codec import require_safetensors
from quark.torch.export.validation import check_header

__all__ = ["INDEX_FILE", "WEIGHTS_FILE", "weight_source", "shard_map", "read_weights"]

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
            raise ValueError(f"{root} has neither {WEIGHTS_FILE} nor {INDEX_FILE} (sharded): no weights to import")
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


def read_weights(root: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export directory ``root`` by name, read a file at a time (``shard_map``). When both an
    index and ``model.safetensors`` are present, the single file must hold exactly the index's tensors, bit for bit.

    Raises:
        ValueError: ``shard_map``'s; a file that is not readable safetensors; a tensor the index places in a shard
            that lacks it; a shard holding a tensor the index does not place there; a single file beside the index
            with other content.
    """
    root = Path(root)
    files = shard_map(root)
    if WEIGHTS_FILE in files and not files[WEIGHTS_FILE]:
        return _read_file(root / WEIGHTS_FILE, None)
    out: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        out.update(_read_file(root / file, names))
    if (root / WEIGHTS_FILE).is_file() and WEIGHTS_FILE not in files:
        _check_same(root, out)
    return out


def _read_file(path: Path, names: list[str] | None) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the safetensors file ``path`` (None: all of them), which must hold exactly those."""
    st = require_safetensors()
    check_header(path)  # a tensor whose bytes do not match its dtype and shape, by name
    try:
        with st.safe_open(str(path), "pt") as f:
            keys = list(f.keys())
            if names is not None:
                _check_keys(path, set(keys), names)
            return {k: f.get_tensor(k) for k in (keys if names is None else names)}
    except ValueError:
        raise
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


def _check_same(root: Path, tensors: dict[str, torch.Tensor]) -> None:
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
