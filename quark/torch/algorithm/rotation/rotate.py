"""Folding rotations into the weights (R1, R2) and the online Hadamard of the down projections' inputs (R4).

Conventions (``plan.RotationPlan``): the residual stream ``h`` becomes ``h @ R1``; a head's value ``v`` becomes
``v @ R2`` (v_proj's rows and o_proj's columns of each head); a down_proj input ``x`` becomes ``x @ H`` online (a
forward pre-hook, before the layer's input quantizer) and its weight ``W @ H``, so ``(x H)(W H)^T == x W^T``. Every
product is computed in float64 and cast back to the weight's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from quark.torch.algorithm.rotation.plan import RotationPlan
from quark.torch.quantization.hf import linear_weight

__all__ = [
    "ROTATION_BUFFER",
    "fold_r1",
    "fold_r2",
    "add_online_rotation",
    "install_online_rotations",
    "remove_online_rotation",
    "online_rotation_modules",
]

#: the buffer of a layer with an online input rotation ([in, in], amd-quark's export name)
ROTATION_BUFFER = "input_rotation"


def _write(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """``tensor`` (a weight or a view of one) takes ``value`` in its own dtype."""
    tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))


def _rot(r: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return r.to(device=like.device, dtype=torch.float64)


@torch.no_grad()
def fold_r1(model: nn.Module, plan: RotationPlan, r1: torch.Tensor) -> None:
    """R1 ([hidden, hidden], orthonormal) folded into the plan's embeddings (``W_E @ R1``), readers (``W @ R1``) and
    writers (``R1.T @ W``, ``R1.T @ b``). Norms must have been fused (``plan.fuse_norms``)."""
    modules = dict(model.named_modules())
    for name in plan.embeddings:
        weight = modules[name].weight
        _write(weight, weight.double() @ _rot(r1, weight))
    for name in plan.readers:
        weight = linear_weight(modules[name])
        _write(weight, weight.double() @ _rot(r1, weight))
    for name in plan.writers:
        module = modules[name]
        weight = linear_weight(module)
        _write(weight, _rot(r1, weight).T @ weight.double())
        if getattr(module, "bias", None) is not None:
            _write(module.bias, _rot(r1, module.bias).T @ module.bias.double())


@torch.no_grad()
def fold_r2(model: nn.Module, plan: RotationPlan, r2: torch.Tensor) -> None:
    """R2 ([head_dim, head_dim], orthonormal) folded per head: v_proj's rows of each (kv) head ``R2.T @ W_v[h]``
    (and its bias), o_proj's columns of each head ``W_o[:, h] @ R2``. ValueError when a projection's size is not a
    multiple of the head size."""
    modules = dict(model.named_modules())
    for site in plan.heads:
        if r2.shape[0] != site.head_dim:
            raise ValueError(f"rotation: R2 of size {r2.shape[0]} for {site.v_proj}, whose heads have {site.head_dim}")
        v, o = modules[site.v_proj], modules[site.o_proj]
        wv, wo = linear_weight(v), linear_weight(o)
        if wv.shape[0] % site.head_dim or wo.shape[1] % site.head_dim:
            raise ValueError(
                f"rotation: {site.v_proj} ({wv.shape[0]} outputs) / {site.o_proj} ({wo.shape[1]} inputs) are not whole "
                f"heads of {site.head_dim}"
            )
        r = _rot(r2, wv)
        heads_v = wv.double().reshape(-1, site.head_dim, wv.shape[1])
        _write(wv, (r.T @ heads_v).reshape(wv.shape))
        if getattr(v, "bias", None) is not None:
            _write(v.bias, (v.bias.double().reshape(-1, site.head_dim) @ r).reshape(-1))
        heads_o = wo.double().reshape(wo.shape[0], -1, site.head_dim)
        _write(wo, (heads_o @ r).reshape(wo.shape))


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
    _write(weight, weight.double() @ _rot(rotation, weight))
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


def install_online_rotations(model: nn.Module, state_dict: dict[str, Any] | None = None) -> list[str]:
    """Make ``model`` ready for a rotated checkpoint: for each ``<layer>.input_rotation`` key of ``state_dict`` a
    buffer of that shape on the layer (loading fills it), and on every layer with such a buffer the pre-hook. Called
    by the loaders before they load a state dict / export; a model without rotations is left alone.

    Args:
        model: The fresh (or already rotated) model.
        state_dict: The tensors about to be loaded (keys as in ``model.state_dict()``); None: hooks only.

    Returns:
        The names of the layers given a new buffer.

    Raises:
        ValueError: For an ``input_rotation`` key naming no module of ``model``.
    """
    modules = dict(model.named_modules())
    added = []
    suffix = "." + ROTATION_BUFFER
    for key, value in (state_dict or {}).items():
        if not key.endswith(suffix):
            continue
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
    return added
