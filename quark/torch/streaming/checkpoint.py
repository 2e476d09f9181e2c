"""A Hugging Face checkpoint directory read one module at a time: ``config.json`` plus ``model.safetensors`` or shards
(``model-0000i-of-0000n.safetensors``) named by ``model.safetensors.index.json``. Only the tensors asked for are read
(safetensors' ``safe_open`` maps the file and copies out one tensor), so a model larger than memory can be quantized
module by module. Every file and tensor is checked before any work starts."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from quark.torch.compat import parameter_registry
from quark.torch.export.codec import require_safetensors
from quark.torch.export.quark_files import INDEX_FILE, shard_map
from quark.torch.export.quark_files import WEIGHTS_FILE as SINGLE_FILE

#: safetensors' names of the floating-point dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

__all__ = ["HFCheckpoint", "free", "INDEX_FILE", "SINGLE_FILE"]


class HFCheckpoint:
    """The tensors of a checkpoint directory by name, and the file each lives in.

    Args:
        path: the directory (``config.json`` and the safetensors file(s)).

    Raises:
        ValueError: no such directory, no ``config.json``, neither an index nor ``model.safetensors``, an index that is
            not JSON or has no ``weight_map``, a shard it names that is missing or names an unsafe path.
    """

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        if not self.root.is_dir():
            raise ValueError(f"checkpoint directory {str(self.root)!r} does not exist or is not a directory")
        if not (self.root / "config.json").is_file():
            raise ValueError(f"checkpoint directory {str(self.root)!r} has no config.json (the model's architecture)")
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        self.files = self._weight_map()

    def _weight_map(self) -> dict[str, str]:
        """Tensor name -> file name, from the index (``quark_files.shard_map`` checks it) or the single file's header."""
        files = shard_map(self.root)
        if files.get(SINGLE_FILE) == []:  # no index: every tensor of model.safetensors
            st = require_safetensors()
            with st.safe_open(str(self.root / SINGLE_FILE), "pt") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)  # noqa: SIM118 - safe_open has no items()
        return {name: file for file, names in files.items() for name in names}

    def float_dtype(self) -> torch.dtype | None:
        """The dtype of the checkpoint's first floating-point tensor (what ``from_pretrained(dtype="auto")`` loads
        when config.json names none); None when it has none."""
        st = require_safetensors()
        for name, file in self.files.items():
            with st.safe_open(str(self.root / file), "pt") as f:
                dtype = _DTYPES.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
        return None

    def check_covers(self, model: nn.Module) -> None:
        """Every Parameter of ``model`` (tied ones once) has a tensor in the checkpoint.

        Raises:
            ValueError: naming the missing tensors (the first ten) and the files looked in.
        """
        needed = [name for name, _ in model.named_parameters()]
        missing = [n for n in needed if n not in self.files]
        if missing:
            raise ValueError(
                f"checkpoint {self.root}: {len(missing)} Parameter(s) of {type(model).__name__} are in no file "
                f"({sorted(set(self.files.values()))}): {missing[:10]}"
            )

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names``, each read into memory of its own with plain file reads (no memory map: mapped pages
        would count in the resident size, and a write into a privately mapped tensor would copy its pages)."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        for file, keys in by_file.items():
            path = self.root / file
            start, header = self._header(file)
            with open(path, "rb") as f:
                for key in keys:
                    out[key] = _read_tensor(f, start, header, key, path)
        return out

    def _header(self, file: str) -> tuple[int, dict[str, Any]]:
        """(where the data starts, the JSON header) of a safetensors file, read once."""
        if file not in self._headers:
            path = self.root / file
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                try:
                    header = json.loads(f.read(size))
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {err})") from None
            self._headers[file] = (8 + size, header)
        return self._headers[file]

    def materialize(self, model: nn.Module, prefix: str, device: torch.device) -> None:
        """Read the Parameters of ``model``'s submodule ``prefix`` ('' for every Parameter not yet read) into it,
        in place of its meta Parameters (tied ones stay tied), cast to each Parameter's dtype.

        Raises:
            ValueError: a tensor whose shape differs from the model's, naming it.
        """
        module = model.get_submodule(prefix) if prefix else model
        base = f"{prefix}." if prefix else ""
        wanted = {base + n: p for n, p in module.named_parameters() if p.device.type == "meta"}
        values = self.load(n for n in wanted if n in self.files)
        new: dict[int, nn.Parameter] = {}
        for name, p in wanted.items():
            value = values.get(name)
            if value is None:
                continue  # tied: filled under its other name
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(
                    f"checkpoint {self.root}: tensor {name!r} has shape {tuple(value.shape)}, the model built from "
                    f"config.json expects {tuple(p.shape)}"
                )
            new[id(p)] = nn.Parameter(value.to(device, p.dtype), requires_grad=False)
        for sub in model.modules():  # the whole model: a tied Parameter (an lm_head's) is replaced everywhere
            registry = parameter_registry(sub)
            for key, p in list(registry.items()):
                if p is not None and id(p) in new:
                    registry[key] = new[id(p)]


#: safetensors' dtype names
_ALL_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _read_tensor(f: BinaryIO, start: int, header: dict[str, Any], key: str, path: Path) -> torch.Tensor:
    """Tensor ``key`` of the open safetensors file ``f`` (data from byte ``start``), read into a new tensor.

    Raises:
        ValueError: a key the header lacks, a dtype not listed, or a byte range that does not match dtype and shape.
    """
    entry = header.get(key)
    if not isinstance(entry, dict) or entry.get("dtype") not in _ALL_DTYPES:
        raise ValueError(f"{path}: tensor {key!r} is not in its header, or has a dtype not in {sorted(_ALL_DTYPES)}")
    dtype, shape = _ALL_DTYPES[entry["dtype"]], [int(d) for d in entry["shape"]]
    begin, end = (int(x) for x in entry["data_offsets"])
    out = torch.empty(shape, dtype=dtype)
    if end - begin != out.numel() * out.element_size():
        raise ValueError(f"{path}: tensor {key!r} has {end - begin} bytes, {entry['dtype']} {shape} needs {out.nbytes}")
    f.seek(start + begin)
    view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
    if f.readinto(view) != end - begin:
        raise ValueError(f"{path}: tensor {key!r} is cut short (the file ends before its {end - begin} bytes)")
    return out


def free(module: nn.Module, within: nn.Module | None = None) -> None:
    """Put every Parameter of ``module`` back on the meta device (its memory is released). ``within``: the model
    ``module`` belongs to, so that a Parameter tied elsewhere (an lm_head sharing the embeddings) goes too."""
    owned = {id(p) for p in module.parameters() if p.device.type != "meta"}
    meta: dict[int, nn.Parameter] = {}
    for sub in (within or module).modules():
        registry = parameter_registry(sub)
        for key, p in list(registry.items()):
            if p is not None and id(p) in owned:
                if id(p) not in meta:
                    meta[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=False)
                registry[key] = meta[id(p)]
