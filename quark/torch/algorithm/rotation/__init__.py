"""Rotations for low-bit weights and activations (QuaRot / SpinQuant): Hadamard matrices, the rotation plan (where
R1 / R2 / R4 act in a LLaMA-like model), folding them into the weights, the online R4 of the down projections, and
RotationConfig's handler (stage ``before_calibration``, registered by ``quark.torch.algorithm``)."""

from __future__ import annotations

from quark.torch.algorithm.rotation.hadamard import (
    block_hadamard_matrix,
    can_build_hadamard,
    hadamard_factor,
    hadamard_matrix,
    random_hadamard_matrix,
)
from quark.torch.algorithm.rotation.plan import (
    SUPPORTED_FAMILIES,
    HeadSite,
    RotationPlan,
    fuse_norms,
    rotation_plan,
    untie_lm_head,
)
from quark.torch.algorithm.rotation.rotate import (
    ROTATION_BUFFER,
    add_online_rotation,
    fold_r1,
    fold_r2,
    install_online_rotations,
    online_rotation_modules,
    remove_online_rotation,
)

__all__ = [
    "hadamard_matrix",
    "random_hadamard_matrix",
    "block_hadamard_matrix",
    "can_build_hadamard",
    "hadamard_factor",
    "HeadSite",
    "RotationPlan",
    "SUPPORTED_FAMILIES",
    "rotation_plan",
    "fuse_norms",
    "untie_lm_head",
    "ROTATION_BUFFER",
    "fold_r1",
    "fold_r2",
    "add_online_rotation",
    "remove_online_rotation",
    "install_online_rotations",
    "online_rotation_modules",
]
