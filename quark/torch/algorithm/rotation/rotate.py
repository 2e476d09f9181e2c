"""Folding rotations into the weights (R1, R2); the online Hadamard of the down projections' inputs (R4) lives in
``quark.torch.quantization.online_rotation`` (the loaders, below the algorithms, install it too) and is re-exported.

Conventions (``plan.RotationPlan``): the residual stream ``h`` becomes ``h @ R1``; a head's value ``v`` becomes
``v @ R2`` (v_proj's rows and o_proj's columns of each head); a down_proj input ``x`` becomes ``x @ H`` online (a
forward pre-hook, before the layer's input quantizer) and its weight ``W @ H``, so ``(x H)(W H)^T == x W^T``. Every
product is computed in float64 and cast back to the weight's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from quark.torch.algorithm.rotation.plan import RotationPlan
from quark.torch.quantization.hf import linear_weight
from quark.torch.quantization.online_rotation import (
    ROTATION_BUFFER,
    add_online_rotation,
    install_online_rotations,
    online_rotation_modules,
    remove_online_rotation,
)

__all__ = [
    "ROTATION_BUFFER",
    "fold_r1",
    "fold_r2",
    "add_online_rotation",
    "install_online_rotations",
    "remove_online_rotation",
    "online_rotation_modules",
]


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
