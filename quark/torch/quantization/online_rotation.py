"""Online input rotations: a layer holding the buffer ``input_rotation`` ([in, in], amd-quark's export name) gets
``x -> x @ input_rotation`` on its input by a forward pre-hook that runs before its input quantizer and before any
hook registered later (GPTQ's capture sees the rotated input); its weight holds ``W @ input_rotation``.

Added by the rotations (``quark.torch.algorithm.rotation``, R4), and installed by the loaders on a fresh model where a
state dict or export holds ``<layer>.input_rotation`` (``install_online_rotations``): the engine's own checkpoint and
export paths, which sit below the algorithms, so this module is here.
"""

from __future__ import annotations

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
