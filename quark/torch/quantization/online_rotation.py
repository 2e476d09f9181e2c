"""Online input rotations: a layer holding the buffer ``input_rotation`` ([in, in], amd-quark's export name) gets
``x -> x @ input_rotation`` on its input by a forward pre-hook that runs before its input quantizer and before any
hook registered later (GPTQ's capture sees the rotated input); its weight holds ``W @ input_rotation``.

Added by the rotations (``quark.torch.algorithm.rotation``, R4), and installed by the loaders on a fresh model where a
state dict or export holds ``<layer>.input_rotation`` (``install_online_rotations``): the engine's own checkpoint and
export paths, which sit below the algorithms, so this module is here.

Stored form (amd-quark 0.13's): ``input_rotation`` is written as one diagonal block ``[b, b]`` (``b`` the rotation
size), as int8 +-1 signs for a fixed Hadamard rotation or in float for ``trainable=True``
(``encode_input_rotation``), and read back to the ``[in, in]`` float32 buffer bit for bit
(``decode_input_rotation``; ``decoded_rotations`` wraps a loader's tensors). A float ``[in, in]`` value (this
project's earlier exports) is read as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from quark.torch.quantization.hf import linear_weight

__all__ = [
    "ROTATION_BUFFER",
    "add_online_rotation",
    "remove_online_rotation",
    "install_online_rotations",
    "online_rotation_modules",
    "untie_differing_weights",
    "rotation_block",
    "encode_input_rotation",
    "decode_input_rotation",
    "decoded_rotations",
]

#: the buffer of a layer with an online input rotation ([in, in], amd-quark's export name)
ROTATION_BUFFER = "input_rotation"


def _rotate_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The forward pre-hook: the first input times the layer's ``input_rotation`` (in the input's dtype)."""
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    rotation = getattr(module, ROTATION_BUFFER)
    return (args[0] @ rotation.to(dtype=args[0].dtype), *args[1:])


def _hook_ids(module: nn.Module) -> list[int]:
    """The ids of ``module``'s forward pre-hooks that are the online rotation's."""
    return [i for i, hook in module._forward_pre_hooks.items() if hook is _rotate_input]


def _hook(module: nn.Module) -> None:
    """Register the pre-hook once, first among the module's pre-hooks (before any capture or quantizer hook). Found
    again by identity (no handle is kept: the module stays copyable and picklable)."""
    if not _hook_ids(module):
        module.register_forward_pre_hook(_rotate_input, prepend=True)


@torch.no_grad()
def add_online_rotation(module: nn.Module, rotation: torch.Tensor) -> None:
    """Give ``module`` (a linear of weight [out, in]) the online input rotation ``rotation`` ([in, in], orthonormal):
    the buffer ``input_rotation``, the pre-hook ``x -> x @ rotation`` and the weight ``W @ rotation``."""
    weight = linear_weight(module)
    if rotation.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"rotation: online rotation {tuple(rotation.shape)} for a layer of {weight.shape[1]} inputs")
    if hasattr(module, ROTATION_BUFFER):
        raise ValueError(f"rotation: {type(module).__name__} already has an {ROTATION_BUFFER}: rotated twice?")
    weight.copy_((weight.double() @ rotation.to(device=weight.device, dtype=torch.float64)).to(weight.dtype))
    module.register_buffer(ROTATION_BUFFER, rotation.to(device=weight.device, dtype=torch.float32))
    _hook(module)


def remove_online_rotation(module: nn.Module) -> None:
    """Remove the buffer and the pre-hook ``add_online_rotation`` added (the weight is left as it is)."""
    for hook_id in _hook_ids(module):
        del module._forward_pre_hooks[hook_id]
    if ROTATION_BUFFER in module._buffers:
        del module._buffers[ROTATION_BUFFER]


def online_rotation_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules of ``model`` holding an ``input_rotation`` buffer."""
    return ((n, m) for n, m in model.named_modules() if ROTATION_BUFFER in m._buffers)


def install_online_rotations(
    model: nn.Module, state_dict: Mapping[str, Any] | None = None, config: Any = None
) -> list[str]:
    """Make ``model`` ready for a rotated checkpoint: for each ``<layer>.input_rotation`` key of ``state_dict`` a
    buffer of that shape on the layer (loading fills it), and on every layer with such a buffer the pre-hook. Called
    by the loaders before they load a state dict / export; a model without rotations is left alone.

    Args:
        model: The fresh (or already rotated) model.
        state_dict: The tensors about to be loaded (keys as in ``model.state_dict()``); None: hooks only.
        config: The Config stored with them: when its ``algo_config`` holds a rotation with R1, weights the model
            ties but the file holds differently (an lm_head tied to the input embeddings) are untied
            (``untie_differing_weights``); other tied weights are left as they are (a quantized lm_head tied to a
            float embedding keeps sharing it).

    Returns:
        The names of the layers given a new buffer.

    Raises:
        ValueError: For an ``input_rotation`` key naming no module of ``model``.
    """
    modules = dict(model.named_modules())
    added = []
    suffix = "." + ROTATION_BUFFER
    for key in list(state_dict or {}):  # keys only: a lazily read export reads just these tensors
        if not key.endswith(suffix):
            continue
        value = state_dict[key]  # type: ignore[index]
        name = key[: -len(suffix)]
        module = modules.get(name)
        if module is None:
            raise ValueError(f"rotation: the checkpoint has {key}, but {type(model).__name__} has no module {name!r}")
        if ROTATION_BUFFER not in module._buffers:
            shape = tuple(value.shape)
            weight = linear_weight(module)
            module.register_buffer(ROTATION_BUFFER, torch.zeros(shape, dtype=torch.float32, device=weight.device))
            added.append(name)
    for _, module in online_rotation_modules(model):
        _hook(module)
    if any(getattr(a, "name", None) == "rotation" and getattr(a, "r1", False) for a in _algos(config)):
        untie_differing_weights(model, state_dict or {})
    return added


def _algos(config: Any) -> list[Any]:
    """The algorithm configs of a Config (none for None)."""
    return list(getattr(config, "algo_configs", None) or [])


def untie_differing_weights(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    """Give its own Parameter to each module whose weight ``model`` shares (an lm_head tied to the input embeddings)
    where ``state_dict`` holds different values for the sharers (a rotated model: R1 rotates the embeddings and the
    lm_head differently, so the rotation untied them); HF ``config.tie_word_embeddings`` set to False then. Returns
    the parameter names untied."""
    sharers: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            sharers.setdefault(id(param), []).append((f"{name}.{pname}" if name else pname, module, pname))
    untied = []
    with torch.no_grad():
        for group in sharers.values():
            keys = [k for k, _, _ in group]
            if len(group) < 2 or not all(k in state_dict for k in keys):
                continue
            first = state_dict[keys[0]]
            for key, module, pname in group[1:]:
                if state_dict[key].shape == first.shape and torch.equal(state_dict[key], first):
                    continue
                param = getattr(module, pname)
                setattr(module, pname, nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
                untied.append(key)
    if untied:
        for sub in model.modules():
            cfg = getattr(sub, "config", None)
            if getattr(cfg, "tie_word_embeddings", False):
                cfg.tie_word_embeddings = False
    return untied


def rotation_block(rotation: torch.Tensor) -> int:
    """The size ``b`` of the diagonal blocks of an online rotation ``[in, in]`` (the nonzeros of its first row)."""
    return int(torch.count_nonzero(rotation[0]))


def _from_signs(signs: torch.Tensor, size: int) -> torch.Tensor:
    """The float32 ``[size, size]`` block-diagonal rotation of the int8 signs ``[b, b]`` of one block, each entry
    ``float32(sign / sqrt(b))`` as the rotations build it (float64, then cast)."""
    b = signs.shape[0]
    block = (signs.to(torch.float64) / math.sqrt(b)).to(torch.float32)
    return block if b == size else torch.block_diag(*[block] * (size // b))


@torch.no_grad()
def encode_input_rotation(rotation: torch.Tensor, as_signs: bool = True) -> torch.Tensor:
    """The stored form of an online rotation ``[in, in]`` whose diagonal blocks ``[b, b]`` are all the same: that
    block, as its int8 +-1 signs (``as_signs``: what amd-quark 0.13 loads for a fixed Hadamard rotation, when the
    signs give ``rotation`` back bit for bit) or in float32 (what it loads for ``trainable=True``); any other matrix
    as it is (float32)."""
    rotation = rotation.detach().to(device="cpu", dtype=torch.float32)
    size, b = rotation.shape[0], rotation_block(rotation)
    if b < 1 or size % b:
        return rotation
    block = rotation[:b, :b].clone()
    if not as_signs:
        same = b == size or torch.equal(torch.block_diag(*[block] * (size // b)), rotation)
        return block if same else rotation
    signs = torch.sign(block).to(torch.int8)
    if bool((signs == 0).any()) or not torch.equal(_from_signs(signs, size), rotation):
        return rotation
    return signs


def decode_input_rotation(stored: torch.Tensor, size: int, where: str = "input_rotation") -> torch.Tensor:
    """The float32 ``[size, size]`` online rotation of its stored form (``encode_input_rotation``'s block: int8
    signs or float, repeated along the diagonal; or the float ``[size, size]`` matrix itself).

    Raises:
        ValueError: For a value that is not square, a block that does not divide ``size`` or int8 values other than
            +-1, naming ``where``.
    """
    b = stored.shape[0] if stored.dim() == 2 else 0
    if stored.shape != (b, b) or b < 1 or size % b:
        raise ValueError(
            f"{where}: {tuple(stored.shape)} is not a square block dividing the layer's {size} inputs "
            f"(expected ({size}, {size}) or a block of a divisor)"
        )
    if stored.dtype == torch.int8:
        if bool((stored.abs() != 1).any()):
            raise ValueError(f"{where}: int8 values other than +-1 (the signs of a Hadamard block are stored)")
        return _from_signs(stored, size)
    block = stored.to(torch.float32)
    return block if b == size else torch.block_diag(*[block] * (size // b))


class _DecodedRotations(Mapping[str, Any]):
    """A loader's tensors with each ``<layer>.input_rotation`` decoded (``decode_input_rotation``) on lookup."""

    def __init__(self, tensors: Mapping[str, Any], sizes: dict[str, int]) -> None:
        self._tensors, self._sizes = tensors, sizes

    def __getitem__(self, key: str) -> Any:
        value = self._tensors[key]
        return decode_input_rotation(value, self._sizes[key], key) if key in self._sizes else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def decoded_rotations(model: nn.Module, tensors: Mapping[str, Any]) -> Mapping[str, Any]:
    """``tensors`` (a loader's, keys as in ``model.state_dict()``) with every ``<layer>.input_rotation`` of a layer of
    ``model`` read as its ``[in, in]`` float32 buffer; a dict stays a dict, another mapping is wrapped (read lazily).
    Keys naming no layer are left for ``install_online_rotations`` to refuse."""
    modules = dict(model.named_modules())
    suffix = "." + ROTATION_BUFFER
    sizes = {
        key: linear_weight(modules[key[: -len(suffix)]]).shape[1]
        for key in list(tensors)
        if key.endswith(suffix) and key[: -len(suffix)] in modules
    }
    if not sizes:
        return tensors
    if isinstance(tensors, dict):
        return {k: decode_input_rotation(v, sizes[k], k) if k in sizes else v for k, v in tensors.items()}
    return _DecodedRotations(tensors, sizes)
